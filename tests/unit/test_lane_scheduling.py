"""The batching lane's scheduling, tick by tick, on a fake engine (no model): FIFO admission, batch limits, one
prefill chunk per tick interleaved with decode steps, solo sequences beside the batch, migration into and out of
the batch, cancellation mid-batch, the queue limit, drain / abort, the memory budget."""

from __future__ import annotations

import pytest

from server.errors import InvalidRequest, QueueFull, ShuttingDown
from server.jobs import Delta, Finished
from server.lane import Lane, LaneState
from server.scheduler import MemoryBudget
from tests.unit.fake_lane import FakeEngine, job


def make_lane(max_batch=8, max_queue=0, chunk=4, budget=None, prefill_batch=1):
    engine = FakeEngine(prefill_chunk=chunk)
    return Lane(engine, max_queue=max_queue, max_batch=max_batch, budget=budget, prefill_batch=prefill_batch), engine


def run_until_idle(lane, limit=500):
    for _ in range(limit):
        if not lane._waiting and not lane._active:
            return
        lane.tick()
    raise AssertionError("the lane did not become idle")


def kinds(log, kind):
    return [e for e in log if e[0] == kind]


def test_fifo_admission_and_the_batch_limit():
    lane, engine = make_lane(max_batch=2)
    jobs = [job(n, [i + 1, 5, 6], max_tokens=3) for i, n in enumerate("abc")]
    for j, _ in jobs:
        lane.submit(j)
    lane.tick()
    assert [e[1] for e in kinds(engine.log, "admit")] == ["a", "b"]  # c waits: the batch is full
    assert lane.queue_depth == 1
    run_until_idle(lane)
    assert [e[1] for e in kinds(engine.log, "admit")] == ["a", "b", "c"]
    assert list(engine.stats.recent_started) == ["a", "b", "c"]
    # c was admitted only once a or b had finished
    log = engine.log
    assert log.index(("admit", "c")) > min(log.index(("finish", "a", "length")), log.index(("finish", "b", "length")))


def test_one_prefill_chunk_per_tick_never_stalls_running_decodes():
    lane, engine = make_lane(chunk=4)
    a, _ = job("a", [1, 2], max_tokens=40)
    lane.submit(a)
    for _ in range(3):
        lane.tick()  # a is decoding (solo)
    b, _ = job("b", [2] + list(range(30)), max_tokens=2)  # 30 tokens to prefill: 8 chunks of 4
    lane.submit(b)
    start = len(engine.log)
    for _ in range(8):
        lane.tick()
    ticks = engine.log[start:]
    prefills = [e for e in ticks if e[0] == "prefill" and e[1] == "b"]
    assert len(prefills) == 8  # exactly one chunk per tick
    # every tick also advanced a: the first decode step after each chunk of b includes a
    for i, e in enumerate(ticks):
        if e[0] == "prefill":
            step = next(x for x in ticks[i + 1:] if x[0] in ("solo", "batch"))
            assert step == ("solo", "a") or (step[0] == "batch" and "a" in step[1]), ticks


def test_one_sequence_decodes_solo_a_second_joins_both_into_the_batch_and_the_last_goes_solo_again():
    lane, engine = make_lane()
    a, ra = job("a", [1, 9], max_tokens=6)
    lane.submit(a)
    lane.tick()  # admit, prefill done (1 token prompt body), first solo step
    assert ("solo", "a") in engine.log and not kinds(engine.log, "join")
    b, rb = job("b", [2, 9], max_tokens=2)
    lane.submit(b)
    lane.tick()
    assert [e[1] for e in kinds(engine.log, "join")] == ["a", "b"]  # a migrated, then b joined
    run_until_idle(lane)
    assert ("resume_solo", "a") in engine.log  # b finished first: a went on alone
    gen_a = engine.finished["a"][1]
    assert gen_a == [101, 102, 103, 104, 105, 106]  # the same tokens as alone, across solo -> batch -> solo
    assert engine.finished["b"][1] == [201, 202]


def test_solo_sequences_run_beside_the_batch_each_tick_without_a_drain():
    lane, engine = make_lane()
    engine.solo_only.add("s")
    for name, p0, n in (("a", 1, 20), ("b", 2, 20), ("s", 3, 4)):
        lane.submit(job(name, [p0, 9], max_tokens=n)[0])
    for _ in range(4):  # the three short prompts share tick 1's prefill budget; then four decode ticks
        lane.tick()
    batch_steps = kinds(engine.log, "batch")
    assert batch_steps and all("s" not in e[1] for e in batch_steps)
    assert engine.finished["s"][1] == [301, 302, 303, 304]  # one solo step per tick
    assert "a" not in engine.finished and "b" not in engine.finished  # ... while the batch kept running
    assert len(batch_steps) == 4  # no drain: the batch stepped in every one of those ticks too
    # /stats says where the lane's time went, phase by phase, over exactly these ticks
    spent = engine.stats.batch_block()["tick_seconds"]
    assert set(spent) == {"admit", "prefill", "batch_step", "batch_rows", "solo"}
    assert all(v >= 0 for v in spent.values())


def test_cancelling_one_sequence_mid_batch_leaves_the_others_untouched():
    lane, engine = make_lane()
    a, ra = job("a", [1, 9], max_tokens=8)
    b, rb = job("b", [2, 9], max_tokens=8)
    lane.submit(a)
    lane.submit(b)
    lane.tick()
    lane.tick()
    a.cancel.set()
    lane.tick()
    assert engine.finished["a"][0].finish_reason == "cancelled"
    run_until_idle(lane)
    assert engine.finished["b"][0].finish_reason == "length"
    assert engine.finished["b"][1] == [201 + i for i in range(8)]
    text_b = "".join(e.text for e in rb.events if isinstance(e, Delta))
    assert text_b == "".join(f"<{201 + i}>" for i in range(8))


def test_a_job_cancelled_while_waiting_ends_without_being_admitted():
    lane, engine = make_lane(max_batch=1)
    a, _ = job("a", [1, 9], max_tokens=3)
    b, rb = job("b", [2, 9], max_tokens=3)
    lane.submit(a)
    lane.submit(b)
    b.cancel.set()
    run_until_idle(lane)
    assert ("admit", "b") not in engine.log
    assert isinstance(rb.events[-1], Finished) and rb.events[-1].finish_reason == "cancelled"


def test_eos_stops_and_max_tokens_is_length():
    lane, engine = make_lane()
    lane.submit(job("e", [-4, 9], max_tokens=10)[0])  # generates 401, EOS
    lane.submit(job("l", [5, 9], max_tokens=2)[0])
    run_until_idle(lane)
    assert engine.finished["e"][0].finish_reason == "stop"
    assert engine.finished["e"][0].completion_tokens == 2
    assert engine.finished["l"][0].finish_reason == "length"


def test_queue_limit_is_a_429():
    lane, _ = make_lane(max_queue=1)
    lane.submit(job("a", [1, 2])[0])
    with pytest.raises(QueueFull):
        lane.submit(job("b", [1, 2])[0])


def test_drain_refuses_new_jobs_and_lets_running_ones_finish_abort_cancels_them():
    lane, engine = make_lane()
    a, ra = job("a", [1, 9], max_tokens=3)
    lane.submit(a)
    lane.tick()
    assert lane.drain() == 1
    with pytest.raises(ShuttingDown):
        lane.submit(job("b", [1, 2])[0])
    run_until_idle(lane)
    assert engine.finished["a"][0].finish_reason == "length"

    lane2, engine2 = make_lane()
    c, _ = job("c", [1, 9], max_tokens=50)
    lane2.submit(c)
    lane2.tick()
    lane2.drain()
    assert lane2.abort() == 1 and lane2.aborted and lane2.state == LaneState.ABORTED
    lane2.tick()
    assert engine2.finished["c"][0].finish_reason == "cancelled"


def test_memory_budget_admits_fifo_without_overtaking_and_refuses_what_never_fits():
    # 10 bytes per token, 100 for the model: 300 left. a needs 2+10=120 (fits), b 120 (fits), c 2+30=320 never fits
    budget = MemoryBudget(400, 10.0, fixed_bytes=100)
    lane, engine = make_lane(budget=budget)
    with pytest.raises(InvalidRequest, match="memory-budget"):
        lane.check_fits(2, 30)
    lane.check_fits(2, 10)
    jobs = [job(n, [i + 1, 9], max_tokens=mt) for i, (n, mt) in enumerate([("a", 10), ("b", 10), ("c", 20), ("d", 1)])]
    for j, _ in jobs:
        lane.submit(j)
    lane.tick()
    # a (120) + b (120) fit in 300; c (220) does not, and d (30) would but must not overtake c
    assert [e[1] for e in kinds(engine.log, "admit")] == ["a", "b"]
    run_until_idle(lane)
    order = [e[1] for e in kinds(engine.log, "admit")]
    assert order == ["a", "b", "c", "d"]


def test_the_ram_tier_yields_before_a_sequence_waits():
    held = {"bytes": 250}

    def make_room(n):
        freed = min(n, held["bytes"])
        held["bytes"] -= freed
        return freed

    budget = MemoryBudget(400, 10.0, fixed_bytes=100, cache_bytes=lambda: held["bytes"], make_room=make_room)
    assert budget.fits(120, running=0)  # 300 - 250 = 50 free: the cache gives up 70
    assert held["bytes"] == 180
    assert not budget.fits(400, running=0)  # more than the whole room: the cache is not emptied for nothing
    assert held["bytes"] == 180


def test_short_prompts_share_a_ticks_prefill_budget_and_join_the_batch_together():
    lane, engine = make_lane(chunk=8)
    for name, p0 in (("a", 1), ("b", 2), ("c", 3)):
        lane.submit(job(name, [p0, 5, 6, 9], max_tokens=3)[0])  # 3 tokens to prefill each: 8 per tick
    lane.tick()
    prefills = kinds(engine.log, "prefill")
    assert [(e[1], e[2]) for e in prefills] == [("a", 3), ("b", 3), ("c", 2)]  # 3 + 3 + 2 = the tick's budget
    assert [e[1] for e in kinds(engine.log, "join")] == ["a", "b"]  # both finished: they joined in one go
    lane.tick()
    assert ("prefill", "c", 3) in engine.log and ("join", "c") in engine.log
    run_until_idle(lane)
    assert all(engine.finished[n][0].finish_reason == "length" for n in "abc")


def test_prefill_batch_computes_several_prompts_chunks_in_one_forward_per_tick():
    lane, engine = make_lane(chunk=4, prefill_batch=2)
    for name, p0 in (("a", 1), ("b", 2), ("c", 3)):
        lane.submit(job(name, [p0] + list(range(10, 16)), max_tokens=3)[0])  # 6 tokens to prefill each
    lane.tick()
    # at most prefill_batch prompts per tick, each at most one chunk, in one batched forward; c waits its turn
    assert kinds(engine.log, "prefill_together") == [("prefill_together", ("a", "b"))]
    assert not kinds(engine.log, "prefill")
    lane.tick()
    assert kinds(engine.log, "prefill_together")[1] == ("prefill_together", ("a", "b"))  # their last 2 tokens
    run_until_idle(lane)
    assert ("prefill_together", ("c",)) not in engine.log  # a group of one is a plain prefill step
    assert [e[1] for e in kinds(engine.log, "prefill")] == ["c", "c"]
    assert all(engine.finished[n][0].finish_reason == "length" for n in "abc")


def test_a_prompt_sharing_a_prefix_with_one_in_the_group_waits_to_retake_it():
    lane, engine = make_lane(chunk=4096, prefill_batch=4)
    shared = list(range(100, 200))  # 100 tokens: more than SHARED_PREFIX_MIN
    lane.submit(job("a", [1] + shared + [7], max_tokens=2)[0])
    lane.submit(job("b", [1] + shared + [8], max_tokens=2)[0])  # same first 101 tokens as a
    lane.submit(job("c", [3] + list(range(300, 400)), max_tokens=2)[0])  # nothing in common
    lane.tick()
    # b is not gathered with a (it would compute a's prefix again): a's group is computed (and its prompt shared)
    # first, then b re-takes before it computes; c has nothing in common with b and goes with it
    log = engine.log
    a_done = log.index(("prefill", "a", len(shared) + 1))  # a group of one: a plain prefill step
    assert log.index(("prefill_together", ("b", "c"))) > a_done
    assert not any(e[0] == "prefill" and e[1] == "b" for e in log)
