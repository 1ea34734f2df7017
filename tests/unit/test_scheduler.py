"""The lane's scheduling rules, table by table, on plans (server.lane.scheduler): no model, no engine, no lane.

Each case builds the queue and the running sequences as plain data (phase, prompt, what the engine recorded of
them) and checks the ``TickPlan`` the scheduler makes for that tick.
"""

from __future__ import annotations

import pytest

from server.lane.budget import MemoryBudget
from server.lane.events import SamplingParams
from server.lane.plan import Start
from server.lane.scheduler import SHARED_PREFIX_MIN, Limits, Scheduler
from server.lane.seam import SeqFacts
from server.lane.sequence import Phase, Sequence

GRAMMAR = object()  # any grammar: the scheduler only asks whether there is one


def seq(name: str, prompt_len: int = 3, *, phase: Phase = Phase.WAITING, done: int = 0, group=None,
        batchable: bool = True, together: bool = True, max_tokens: int = 4, cancelled: bool = False,
        prefilled: bool = False, generated: int = 0, grammar=None, window=None, prompt=None,
        yields: bool = False) -> Sequence:
    if prefilled and phase == Phase.PREFILL:
        phase = Phase.READY  # its prompt is computed
    s = Sequence(prompt=list(prompt) if prompt is not None else [7] * prompt_len,
                 params=SamplingParams(max_tokens=max_tokens, grammar=grammar), sink=lambda e: None, id=name,
                 phase=phase, covered=done,
                 facts=SeqFacts(group=group, batchable=batchable, prefill_together=together, window=window,
                                yields=yields, drafting=yields))
    s.generated = [1] * generated
    if cancelled:
        s.cancel.set()
    return s


def names(seqs) -> list[str]:
    return [s.id for s in seqs]


def chunks(plan) -> list[list[tuple[str, int]]]:
    return [[(c.seq.id, c.tokens) for c in group] for group in (*plan.prefill, *plan.prefill_late)]


def starts(plan) -> list[tuple]:
    return [(st.group, names(st.batch), names(st.solo)) for st in plan.start]


def sched(max_batch=8, chunk=4, prefill_batch=1, budget=None, together_max=0) -> Scheduler:
    return Scheduler(Limits(max_batch=max_batch, prefill_chunk=chunk, prefill_batch=prefill_batch,
                            together_max=together_max), budget)


# -- admission ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_batch,running,queued,admitted", [
    (2, 0, "abc", "ab"),  # FIFO up to the batch limit; c waits
    (2, 1, "abc", "a"),  # one slot left
    (2, 2, "abc", ""),  # full
    (8, 0, "abc", "abc"),
])
def test_admission_is_fifo_up_to_max_batch(max_batch, running, queued, admitted):
    run = [seq(f"r{i}", phase=Phase.SOLO, prefilled=True, generated=1) for i in range(running)]
    plan = sched(max_batch=max_batch).schedule([seq(n) for n in queued], run)
    assert names(plan.admit) == list(admitted)


def test_cancelled_sequences_end_queued_ones_without_the_model_and_take_no_slot():
    queue = [seq("a", cancelled=True), seq("b"), seq("c")]
    running = [seq("r", phase=Phase.BATCHED, prefilled=True, generated=2, cancelled=True),
               seq("s", phase=Phase.SOLO, prefilled=True, generated=2)]
    plan = sched(max_batch=3).schedule(queue, running)
    assert names(plan.end_waiting) == ["a"] and names(plan.cancel) == ["r"]
    assert names(plan.admit) == ["b", "c"]  # r ends this tick: its slot is free
    assert starts(plan) == [(None, ["s", "b", "c"], [])]  # nothing of r runs: b and c start the batch with s
    assert "r" not in names(plan.solo) + names(plan.leave)


def test_a_prompt_whose_prefix_is_still_being_read_waits_outside_and_blocks_no_one():
    queue = [seq("a"), seq("b"), seq("c")]
    plan = sched(max_batch=2).schedule(queue, [], ready=lambda s: s.id != "a")
    assert names(plan.waiting_io) == ["a"] and names(plan.admit) == ["b", "c"]


@pytest.mark.parametrize("needs,cache,admitted,make_room", [
    # budget 400, weights 100, 10 bytes per token: 300 bytes for KV and the RAM tier together
    ([12, 12, 22, 3], 0, "ab", 0),  # a 120 + b 120 fit; c 220 does not, and d (30) must not overtake it
    ([12], 250, "a", 70),  # 50 free: the cache yields 70 more
    ([12, 12], 250, "ab", 190),  # and 120 more for b
    ([40], 0, "", 0),  # larger than the whole room: never admitted here (check_fits refuses it up front)
])
def test_memory_budget_admits_fifo_without_overtaking_and_the_cache_yields_first(needs, cache, admitted, make_room):
    budget = MemoryBudget(400, 10.0, fixed_bytes=100, cache_bytes=lambda: cache)
    queue = [seq(n, prompt_len=2, max_tokens=need - 2) for n, need in zip("abcd", needs)]
    plan = sched(budget=budget).schedule(queue, [])
    assert names(plan.admit) == list(admitted) and plan.make_room == make_room


def test_running_sequences_reserve_their_kv():
    budget = MemoryBudget(400, 10.0, fixed_bytes=100)
    running = [seq("r", prompt_len=2, max_tokens=18, phase=Phase.SOLO, prefilled=True, generated=1)]  # 200
    plan = sched(budget=budget).schedule([seq("a", prompt_len=2, max_tokens=8), seq("b", prompt_len=2,
                                                                                      max_tokens=8)], running)
    assert names(plan.admit) == ["a"]  # 200 + 100 = the whole room; b waits


def test_a_hybrids_recurrent_state_is_priced_per_sequence_not_per_token():
    from server.lane.budget import KVPrice

    budget = MemoryBudget(400, KVPrice(per_token=1.0, per_sequence=100.0), fixed_bytes=100)
    assert budget.need(2, 8) == 110  # 10 tokens of KV and one state
    assert budget.never_fits(150, 40) is None  # 290: a long prompt still fits (priced per token it would not)
    assert "MiB of KV cache" in budget.never_fits(150, 60)
    queue = [seq(n, prompt_len=2, max_tokens=8) for n in "abc"]
    assert names(sched(budget=budget).schedule(queue, []).admit) == ["a", "b"]  # 110 + 110; c's state does not fit


@pytest.mark.parametrize("batch_bytes,admitted", [
    (0, "a"),  # the batch's buffers say nothing: its row reserves its own 100
    (100, "a"),  # exactly the row's need: nothing beside it
    (250, ""),  # free slots and unused positions hold 150 more: a (100) no longer fits beside them
])
def test_the_decode_batches_buffers_count_when_they_hold_more_than_their_rows_need(batch_bytes, admitted):
    budget = MemoryBudget(400, 10.0, fixed_bytes=100)
    running = [seq("r", prompt_len=2, max_tokens=8, phase=Phase.BATCHED, prefilled=True, generated=1),  # 100
               seq("s", prompt_len=2, max_tokens=8, phase=Phase.SOLO, prefilled=True, generated=1)]  # 100
    plan = sched(budget=budget).schedule([seq("a", prompt_len=2, max_tokens=8)], running, batch_bytes=batch_bytes)
    assert names(plan.admit) == list(admitted)


@pytest.mark.parametrize("measured,cache,admitted,make_room,unaccounted", [
    # budget 400, weights 100, a running row reserving 100, 10 bytes per token; a (100) asks to join
    (150, 0, "a", 0, 0),  # the device holds less than the accounting says: the accounting decides
    (350, 0, "", 0, 150),  # 150 held beyond fixed + reserved (200): 50 free, no cache to yield: a waits
    (350, 100, "a", 50, 50),  # 350 measured vs 300 accounted: 50 free, and the cache yields the 50 a lacks
    (500, 0, "", 0, 300),  # the device is over the budget: nothing more joins
])
def test_memory_the_device_holds_beyond_the_accounting_is_not_free(measured, cache, admitted, make_room, unaccounted):
    budget = MemoryBudget(400, 10.0, fixed_bytes=100, cache_bytes=lambda: cache, measured_bytes=lambda: measured)
    running = [seq("r", prompt_len=2, max_tokens=8, phase=Phase.SOLO, prefilled=True, generated=1)]  # 100
    plan = sched(budget=budget).schedule([seq("a", prompt_len=2, max_tokens=8)], running)
    assert names(plan.admit) == list(admitted) and plan.make_room == make_room
    assert budget.unaccounted == unaccounted


def test_with_nothing_running_the_measured_memory_never_holds_the_queue_up():
    budget = MemoryBudget(400, 10.0, fixed_bytes=100, measured_bytes=lambda: 10_000)
    plan = sched(budget=budget).schedule([seq("a", prompt_len=2, max_tokens=8)], [])
    assert names(plan.admit) == ["a"] and budget.unaccounted == 0


# -- prefill --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk,prompts,expected", [
    (4, [31], [[("a", 4)]]),  # a long prompt: one chunk per tick
    (8, [4, 4, 4], [[("a", 3)], [("b", 3)], [("c", 2)]]),  # short prompts share the tick's budget
    (8, [1, 4], [[("a", 0)], [("b", 3)]]),  # nothing to compute but the last token: a chunk of 0 completes it
    (4, [9, 4], [[("b", 3)], [("a", 1)]]),  # the cheapest first; the rest of the budget to the long one
    (8, [6, 6], [[("a", 5)], [("b", 3)]]),  # ties keep admission order
])
def test_one_chunks_worth_of_prompt_per_tick_cheapest_first(chunk, prompts, expected):
    queue = [seq(n, prompt_len=p) for n, p in zip("abc", prompts)]
    assert chunks(sched(chunk=chunk).schedule(queue, [])) == expected


def test_a_chunk_ends_at_an_anchor_so_that_prefix_is_stored_as_an_entry_of_its_own():
    a = seq("a", prompt_len=30)
    a.anchors = (6, 20)
    assert chunks(sched(chunk=16).schedule([a], [])) == [[("a", 6)]]
    running = seq("r", prompt_len=30, phase=Phase.PREFILL, done=6)
    running.anchors = (6, 20)
    assert chunks(sched(chunk=16).schedule([], [running])) == [[("r", 14)]]  # up to the next one
    hit = seq("h", prompt_len=30)
    hit.anchors = (6,)
    assert chunks(sched(chunk=16).schedule([hit], [], lookup=lambda s: 10)) == [[("h", 16)]]  # cached past it


def test_an_almost_cached_turn_does_not_wait_behind_a_long_prompt():
    long = seq("long", prompt_len=2000, phase=Phase.PREFILL, done=100)
    plan = sched(chunk=512).schedule([seq("turn", prompt_len=900)], [long], lookup=lambda s: 880)
    assert chunks(plan) == [[("turn", 19)], [("long", 493)]]  # the turn completes and decodes in this very tick
    assert starts(plan) == [(None, [], ["turn"])]
    # ... and the long prompt's chunk waits until after that decode step: the turn's first token waits for its own
    # 19 tokens, not for 493 of another prompt's too
    assert [[c.seq.id for c in g] for g in plan.prefill] == [["turn"]]
    assert [[c.seq.id for c in g] for g in plan.prefill_late] == [["long"]]


def test_decodes_run_before_the_chunks_that_do_not_complete_a_prompt():
    batch = [seq(f"r{i}", phase=Phase.BATCHED, prefilled=True, generated=3) for i in range(2)]
    long = seq("long", prompt_len=1000, phase=Phase.PREFILL, done=100)
    plan = sched(chunk=512).schedule([], [*batch, long])
    assert not plan.prefill and chunks(plan) == [[("long", 512)]] and plan.decode == (None,) and not plan.start
    # its last chunk completes it: before the decode, which it joins
    long.covered = 612
    plan = sched(chunk=512).schedule([seq("new", prompt=range(3000))], [*batch, long])  # shares nothing
    assert chunks(plan) == [[("long", 387)], [("new", 125)]]
    assert [[c.seq.id for c in g] for g in plan.prefill] == [["long"]] and starts(plan) == [(None, ["long"], [])]
    starved = sched(chunk=512)
    starved._passed = {"long": 99}  # a starved long prompt goes first: the short one after it waits for the decode
    plan = starved.schedule([seq("short", prompt_len=10)], [*batch, seq("long", prompt_len=9000, done=10,
                                                                       phase=Phase.PREFILL)])
    assert not plan.prefill and chunks(plan) == [[("long", 512)]]


def test_a_long_prompt_passed_over_too_often_goes_first():
    from server.lane.scheduler import STARVE_TICKS

    s = sched(chunk=4)
    long = seq("long", prompt_len=40, phase=Phase.PREFILL, done=0)
    for i in range(STARVE_TICKS):  # each tick a new short prompt takes the whole budget
        plan = s.schedule([seq(f"short{i}", prompt_len=5)], [long])
        assert [c.seq.id for g in (*plan.prefill, *plan.prefill_late) for c in g] == [f"short{i}"]
    plan = s.schedule([seq("one-more", prompt_len=5)], [long])
    assert chunks(plan) == [[("long", 4)]]  # its turn now; the short one waits


def test_the_cached_prefix_sizes_a_new_sequences_first_chunk():
    plan = sched(chunk=512).schedule([seq("a", prompt_len=100)], [], lookup=lambda s: 90)
    assert chunks(plan) == [[("a", 9)]]  # 99 prompt tokens before the last; 90 of them come from the cache


def test_a_sequence_already_prefilling_goes_before_new_ones():
    running = [seq("r", prompt_len=20, phase=Phase.PREFILL, done=16)]
    plan = sched(chunk=8).schedule([seq("a", prompt_len=9)], running)
    assert chunks(plan) == [[("r", 3)], [("a", 5)]]


def test_prefill_batch_gathers_chunks_into_forwards_of_prompts_that_may_go_together():
    queue = [seq("a", prompt_len=7), seq("b", prompt_len=7), seq("c", prompt_len=7)]
    plan = sched(chunk=4, prefill_batch=2).schedule(queue, [])
    assert chunks(plan) == [[("a", 4), ("b", 4)]]  # at most prefill_batch prompts a tick, each one chunk

    queue = [seq("a", prompt_len=7), seq("s", prompt_len=7, together=False), seq("b", prompt_len=7)]
    plan = sched(chunk=4, prefill_batch=3).schedule(queue, [])
    assert chunks(plan) == [[("a", 4)], [("s", 4)], [("b", 4)]]  # one that may not go together runs alone

    hit = seq("h", prompt_len=900)  # a long cached prefix: its rows would be copied in and out
    plan = sched(chunk=512, prefill_batch=2).schedule([seq("a", prompt_len=9), hit], [], lookup=lambda s: 600 * (s is hit))
    assert chunks(plan) == [[("a", 8)], [("h", 299)]]


def test_short_chunks_past_long_hits_gather_up_to_together_max():
    """An agent's next turn: a long cached conversation and a few hundred new tokens. Such chunks join one batched
    forward when they are at most --prefill-together-max tokens; a longer one past a long hit still runs alone."""
    turns = [seq(f"t{i}", prompt=[i] + [7] * 1000) for i in range(3)]  # distinct first tokens: no shared prefix
    cached = {id(s): 700 for s in turns}  # 300 new tokens each, past a 700-token hit (longer than a 512 chunk)
    plan = sched(chunk=512, prefill_batch=4, together_max=300).schedule(turns, [], lookup=lambda s: cached[id(s)])
    assert chunks(plan) == [[("t0", 300), ("t1", 300), ("t2", 300)]]
    plan = sched(chunk=512, prefill_batch=4, together_max=299).schedule(
        [seq(f"u{i}", prompt=[i] + [7] * 1000) for i in range(3)], [], lookup=lambda s: 700)
    assert chunks(plan) == [[("u0", 300)], [("u1", 300)], [("u2", 300)]]  # one token over: each alone


def test_a_shared_prefix_is_computed_once_the_others_wait_for_it():
    shared = list(range(100, 100 + SHARED_PREFIX_MIN + 136))  # 200 shared tokens after the first
    queue = [seq("a", prompt=[1, *shared, *range(500, 540)]), seq("b", prompt=[1, *shared, *range(600, 650)]),
             seq("c", prompt=list(range(300, 400)))]
    plan = sched(chunk=4096, prefill_batch=4).schedule(queue, [])
    # b would compute a's 201 shared tokens again: it waits, a gets an anchor where they end and its chunk stops
    # there (stored at once), c has nothing in common and goes with a
    assert [(s.id, pos) for s, pos in plan.anchor] == [("a", 201)]
    assert chunks(plan) == [[("c", 99), ("a", 201)]]
    a, b = queue[0], queue[1]
    a.phase, a.covered, a.anchors = Phase.PREFILL, 201, (201,)  # the next tick: a stored its prefix
    b.phase, b.cached = Phase.PREFILL, 0
    plan = sched(chunk=4096, prefill_batch=4).schedule([], [a, b])
    assert {c.seq.id for g in (*plan.prefill, *plan.prefill_late) for c in g} == {"a", "b"} and not plan.anchor  # b takes it, then goes on


def test_one_that_computed_part_of_its_prompt_itself_never_waits():
    shared = list(range(100, 100 + 2 * SHARED_PREFIX_MIN))
    a = seq("a", prompt=[1, *shared, 5], phase=Phase.PREFILL, done=0)
    b = seq("b", prompt=[1, *shared, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], phase=Phase.PREFILL, done=10)
    b.cached = 0  # 10 tokens of its own: a take could not replace its caches any more
    plan = sched(chunk=4096, prefill_batch=4).schedule([], [a, b])
    assert [c.seq.id for g in (*plan.prefill, *plan.prefill_late) for c in g] == ["b"]  # b goes on; a, which has nothing yet, waits for it
    assert [(s.id, pos) for s, pos in plan.anchor] == [("b", 1 + 2 * SHARED_PREFIX_MIN)]


@pytest.mark.parametrize("queued,prefilling,share", [(0, 1, False), (1, 1, True), (0, 2, True)])
def test_prompts_are_shared_at_once_when_others_wait_or_prefill(queued, prefilling, share):
    queue = [seq(f"p{i}", prompt_len=3) for i in range(prefilling)] + [seq(f"w{i}") for i in range(queued)]
    plan = sched(max_batch=prefilling).schedule(queue, [])
    assert plan.store_now is share


# -- start, leave, decode -------------------------------------------------------------------------------------------
def test_the_only_plain_decoding_sequence_goes_solo():
    plan = sched().schedule([seq("a")], [])
    assert starts(plan) == [(None, [], ["a"])] and names(plan.solo) == ["a"] and not plan.decode


def test_a_second_plain_sequence_starts_the_batch_and_the_solo_one_migrates_into_it():
    running = [seq("s", phase=Phase.SOLO, prefilled=True, generated=3)]
    plan = sched().schedule([seq("a")], running)
    assert starts(plan) == [(None, ["s", "a"], [])]
    assert plan.decode == (None,) and not plan.solo


def test_sequences_that_cannot_batch_stay_solo_beside_the_batch():
    running = [seq("x", phase=Phase.BATCHED, prefilled=True, generated=2),
               seq("y", phase=Phase.BATCHED, prefilled=True, generated=2),
               seq("spec", phase=Phase.SOLO, prefilled=True, generated=2, batchable=False)]
    plan = sched().schedule([seq("q", batchable=False)], running)
    assert starts(plan) == [(None, [], ["q"])]
    assert plan.decode == (None,) and names(plan.solo) == ["spec", "q"]  # both solo, the batch steps too


def test_a_sequence_that_speculates_alone_for_want_of_company_joins_the_batch_others_start():
    # a hybrid's request that arrived alone speculates solo (its model cannot speculate in a batch); when a plain
    # one starts in its group, it joins their batch (as the plain sequence would have gone solo otherwise)
    running = [seq("spec", phase=Phase.SOLO, prefilled=True, generated=3, batchable=False, yields=True)]
    plan = sched().schedule([seq("a")], running)
    assert starts(plan) == [(None, ["spec", "a"], [])]
    assert plan.decode == (None,) and not plan.solo

    # with a grammar it stays where it is, as any solo sequence whose processor must see each token once
    held = [seq("spec", phase=Phase.SOLO, prefilled=True, generated=3, batchable=False, yields=True,
                grammar=GRAMMAR)]
    plan = sched().schedule([seq("a")], held)
    assert starts(plan) == [(None, [], ["a"])] and names(plan.solo) == ["spec", "a"]

    # a sequence that cannot batch and does not yield stays solo (the rule before)
    stays = [seq("spec", phase=Phase.SOLO, prefilled=True, generated=3, batchable=False)]
    plan = sched().schedule([seq("a")], stays)
    assert starts(plan) == [(None, [], ["a"])] and names(plan.solo) == ["spec", "a"]


def test_a_yielding_sequence_ready_beside_a_batch_starts_in_it_and_alone_goes_solo():
    batch = [seq("x", phase=Phase.BATCHED, prefilled=True, generated=2),
             seq("y", phase=Phase.BATCHED, prefilled=True, generated=2)]
    plan = sched().schedule([seq("q", batchable=False, yields=True)], batch)
    assert starts(plan) == [(None, ["q"], [])] and plan.decode == (None,) and not plan.solo

    plan = sched().schedule([seq("q", batchable=False, yields=True)], [])
    assert starts(plan) == [(None, [], ["q"])] and names(plan.solo) == ["q"]

    # ready after a plain one that went solo (it was ready first, alone): the two start a batch, not two solos
    solo = [seq("p", phase=Phase.SOLO, prefilled=True, generated=2)]
    plan = sched().schedule([seq("q", batchable=False, yields=True)], solo)
    assert starts(plan) == [(None, ["p", "q"], [])] and plan.decode == (None,) and not plan.solo


@pytest.mark.parametrize("kwargs", [dict(grammar=GRAMMAR), dict(window=8)])
def test_a_sequence_that_cannot_move_stays_where_it_is(kwargs):
    # a grammar processor must see each token once; a sliding window that wrapped cannot take the trim
    running = [seq("s", phase=Phase.SOLO, prefilled=True, generated=6, prompt_len=3, **kwargs)]
    plan = sched().schedule([seq("a")], running)
    assert starts(plan) == [(None, [], ["a"])]  # a goes solo too: s does not migrate, so a is the only plain one
    assert names(plan.solo) == ["s", "a"]


def test_a_batch_down_to_one_row_goes_solo_unless_its_group_is_busy():
    alone = [seq("x", phase=Phase.BATCHED, prefilled=True, generated=5)]
    plan = sched().schedule([], alone)
    assert names(plan.leave) == ["x"] and names(plan.solo) == ["x"] and not plan.decode

    busy = alone + [seq("p", prompt_len=40, phase=Phase.PREFILL, done=4)]
    plan = sched().schedule([], busy)
    assert not plan.leave and plan.decode == (None,)

    held = [seq("g", phase=Phase.BATCHED, prefilled=True, generated=5, grammar=GRAMMAR)]
    assert not sched().schedule([], held).leave


def test_each_adapter_group_has_its_own_batch_and_every_group_steps_every_tick():
    running = [seq(f"{g}{i}", phase=Phase.BATCHED, prefilled=True, generated=1, group=g) for g in "XY" for i in (1, 2)]
    running.append(seq("base", phase=Phase.SOLO, prefilled=True, generated=1))
    plan = sched().schedule([], running)
    assert set(plan.decode) == {"X", "Y"} and names(plan.solo) == ["base"]
    plan = sched().schedule([seq("y3", group="Y")], running)
    assert starts(plan) == [("Y", ["y3"], [])]  # joins its own group's batch, not the base model's


def test_a_prefill_that_completed_early_is_started_on_the_next_plan():
    running = [seq("a", prompt_len=9, phase=Phase.PREFILL, done=4, prefilled=True),
               seq("b", phase=Phase.SOLO, prefilled=True, generated=2)]
    plan = sched().schedule([], running)
    assert not plan.prefill and not plan.prefill_late and starts(plan) == [(None, ["b", "a"], [])]


def test_a_task_runs_and_an_idle_plan_is_empty():
    assert sched().schedule([], []).empty
    plan = sched().schedule([], [], task=True)
    assert plan.task and not plan.model_work


def test_start_records_are_frozen():
    with pytest.raises(Exception):
        Start(None).group = "X"  # type: ignore[misc]
