"""The lane executing its plans, tick by tick, with the real engine on a tiny random model (no tokenizer files, no
server): several sequences at once give each the tokens it makes alone, across solo -> batch -> solo moves and
adapter groups; a cancelled one leaves the others untouched; the queue limit, drain and abort; one task per tick.
The rules that decide each tick are tested on plans alone in test_scheduler.py."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import mlx.core as mx
import pytest

from cache.prompt_cache import NullPromptCache, PromptCache
from server.engine.batch import Layout
from server.engine.engine import Engine, EngineConfig
from server.errors import DeviceLost, InvalidRequest, QueueFull, ShuttingDown
from server.lane.budget import MemoryBudget
from server.lane.events import Delta, Failed, Finished, SamplingParams
from server.lane.lane import Lane, LaneState
from server.lane.sequence import Phase, Sequence
from server.lane.target import Target
from server.stats import ServingStats
from tests.fixtures.tiny_models import IdTokenizer, tiny_llama

EOS = 0


@pytest.fixture(scope="module")
def models():
    return {None: tiny_llama(seed=11), "X": tiny_llama(seed=12), "Y": tiny_llama(seed=13)}


def make_lane(models, *, max_batch=8, max_queue=0, chunk=4, prefill_batch=1, budget=None, cache_bytes=0,
              speculation=None, spec_in_batch=True, engine_class=Engine):
    loaded = SimpleNamespace(model=models[None], tokenizer=IdTokenizer(), fingerprint="0" * 16)
    cache = PromptCache(cache_bytes) if cache_bytes else NullPromptCache()
    stats = ServingStats()
    config = EngineConfig(prefill_chunk=chunk, speculation=speculation, layout=Layout(spec_in_batch=spec_in_batch))
    engine = engine_class(loaded, cache, stats, config)
    engine.bind_stream()
    return Lane(engine, cache, stats, max_queue=max_queue, max_batch=max_batch, budget=budget,
                prefill_batch=prefill_batch)


def adapter(models, name):
    return SimpleNamespace(identity=name, name=name, model=models[name])


def submit(lane, name, prompt, max_tokens=6, adapter=None, served=None, **kw):
    events = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    target = Target(served if served is not None else lane.engine.base, adapter)
    seq = Sequence(prompt=list(prompt), params=params, sink=events.append, id=name, target=target,
                   ns=lane.engine.namespace_for(target, params))
    lane.submit(seq)
    return seq, events


def rows_of(lane, adapter_identity) -> int:
    """Rows in the decode batches of one adapter."""
    return sum(len(b) for g, b in lane.engine.decoder.groups.items() if g.adapter == adapter_identity)


def batch_kinds(lane, min_rows=1) -> set:
    """The kinds of the decode batches holding at least ``min_rows`` rows now."""
    return {b.kind for _, b in lane.engine.decoder.groups.items() if len(b) >= min_rows}


def run_until_idle(lane, limit=400):
    for _ in range(limit):
        if lane.idle():
            return
        lane.tick()
    raise AssertionError("the lane did not become idle")


def finished(events) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


PROMPTS = {"a": [5, 17, 99, 3, 42], "b": [8, 1, 2, 3, 4, 5, 6, 7, 9, 10], "c": [200, 201, 7], "d": [61, 62, 63, 64]}


def alone(models, name, max_tokens, **kw):
    lane = make_lane(models)
    seq, events = submit(lane, name, PROMPTS[name], max_tokens, **kw)
    run_until_idle(lane)
    return list(seq.generated), text(events)


def test_sequences_run_together_make_the_tokens_each_makes_alone(models):
    lengths = {"a": 9, "b": 3, "c": 6, "d": 12}
    want = {n: alone(models, n, m) for n, m in lengths.items()}
    lane = make_lane(models)
    a, ea = submit(lane, "a", PROMPTS["a"], lengths["a"])
    lane.tick()  # a alone: the solo path
    assert a.phase == Phase.SOLO
    runs = {"a": (a, ea)}
    for n in "bcd":
        runs[n] = submit(lane, n, PROMPTS[n], lengths[n])
    phases = set()
    for _ in range(200):
        if lane.idle():
            break
        lane.tick()
        phases |= {s.phase for s, _ in runs.values()}
    assert Phase.BATCHED in phases  # they did share a batch (a migrated into it) ...
    for n, (s, events) in runs.items():
        assert (s.generated, text(events)) == want[n], n  # ... and each made its own tokens, text included
        assert finished(events).finish_reason == "length"
    assert lane.engine.batch_rows() == 0


def test_cancelling_one_sequence_mid_batch_leaves_the_others_untouched(models):
    want_b = alone(models, "b", 8)
    lane = make_lane(models)
    a, ea = submit(lane, "a", PROMPTS["a"], 8)
    b, eb = submit(lane, "b", PROMPTS["b"], 8)
    for _ in range(6):
        lane.tick()
    assert a.phase == Phase.BATCHED and b.phase == Phase.BATCHED
    a.cancel.set()
    lane.tick()
    assert finished(ea).finish_reason == "cancelled" and a.phase == Phase.FINISHED
    run_until_idle(lane)
    assert (b.generated, text(eb)) == want_b and finished(eb).finish_reason == "length"


def test_adapter_groups_each_have_a_batch_and_make_the_tokens_they_make_alone(models):
    def seqs(lane):
        out = {}
        for name, group in (("x1", "X"), ("x2", "X"), ("y1", "Y"), ("y2", "Y"), ("base", None)):
            prompt = PROMPTS["abcd"[len(out) % 4]]
            kw = {"adapter": adapter(models, group)} if group else {}
            out[name] = submit(lane, name, prompt, 16, **kw)
        return out

    lane1 = make_lane(models, max_batch=1)  # one sequence at a time: each alone
    runs1 = seqs(lane1)
    run_until_idle(lane1)
    single = {n: list(s.generated) for n, (s, _) in runs1.items()}

    lane = make_lane(models)
    runs = seqs(lane)
    steps = []
    for _ in range(100):
        if lane.idle():
            break
        before = {g: rows_of(lane, g) for g in ("X", "Y")}
        lane.tick()
        steps.append(before)
    assert any(s["X"] == 2 and s["Y"] == 2 for s in steps)  # both adapter groups batched at the same time
    for name, (s, _) in runs.items():
        assert s.generated == single[name], name
    assert rows_of(lane, "X") == rows_of(lane, "Y") == 0


def test_fifo_admission_under_the_batch_limit(models):
    lane = make_lane(models, max_batch=2)
    for n in "abc":
        submit(lane, n, PROMPTS[n], 3)
    lane.tick()
    assert lane.queue_depth == 1 and lane.running_ids == ("a", "b")
    run_until_idle(lane)
    assert list(lane.stats.recent_started) == ["a", "b", "c"]


def test_a_sequence_cancelled_while_waiting_ends_without_being_admitted(models):
    lane = make_lane(models, max_batch=1)
    submit(lane, "a", PROMPTS["a"], 3)
    b, eb = submit(lane, "b", PROMPTS["b"], 3)
    b.cancel.set()
    run_until_idle(lane)
    assert finished(eb).finish_reason == "cancelled" and finished(eb).completion_tokens == 0
    assert b not in lane.engine._work and b.cached == 0  # never admitted: no cache was taken for it


def test_the_queue_limit_is_a_429_and_drain_then_abort_end_every_sequence(models):
    lane = make_lane(models, max_queue=1)
    submit(lane, "a", PROMPTS["a"])
    with pytest.raises(QueueFull):
        submit(lane, "b", PROMPTS["b"])

    lane = make_lane(models)
    a, ea = submit(lane, "a", PROMPTS["a"], 3)
    lane.tick()
    assert lane.drain() == 1
    with pytest.raises(ShuttingDown):
        submit(lane, "b", PROMPTS["b"])
    run_until_idle(lane)
    assert finished(ea).finish_reason == "length"

    lane = make_lane(models)
    c, ec = submit(lane, "c", PROMPTS["c"], 50)
    lane.tick()
    lane.drain()
    assert lane.abort() == 1 and lane.aborted and lane.state == LaneState.ABORTED
    lane.tick()
    assert finished(ec).finish_reason == "cancelled" and 0 < len(c.generated) < 50


def test_a_request_the_budget_can_never_admit_is_a_400(models):
    lane = make_lane(models, budget=MemoryBudget(400, 10.0, fixed_bytes=100))
    with pytest.raises(InvalidRequest, match="memory-budget"):
        lane.check_fits(2, 30)
    lane.check_fits(2, 10)


def test_a_prompt_computed_by_one_sequence_serves_the_next_from_the_cache(models):
    lane = make_lane(models, cache_bytes=1 << 26)
    shared = list(range(20, 60))
    a, ea = submit(lane, "a", shared + [1, 2], 3)
    run_until_idle(lane)
    b, eb = submit(lane, "b", shared + [1, 2, 4, 5], 3)
    run_until_idle(lane)
    assert finished(ea).cached_tokens == 0
    assert finished(eb).cached_tokens >= len(shared) + 2  # a's whole prompt (and what it generated) was stored


def test_one_task_per_tick_between_decode_steps(models):
    lane = make_lane(models)
    seq, events = submit(lane, "a", PROMPTS["a"], 6)
    lane.tick()
    done_at = []
    futures = [lane.call(lambda i=i: done_at.append((i, len(seq.generated))) or i) for i in range(3)]
    for _ in range(3):
        lane.tick()
    assert [f.result(timeout=0) for f in futures] == [0, 1, 2]
    assert [n for _, n in done_at] == sorted(n for _, n in done_at) and len({n for _, n in done_at}) == 3
    lane.drain()
    with pytest.raises(ShuttingDown):
        lane.call(lambda: None)
    assert isinstance(futures[0], concurrent.futures.Future)


class FaultyEngine(Engine):
    """The real engine, whose admission of a sequence named "bad" raises (after it took its cache)."""

    def admit(self, seq):
        admitted = super().admit(seq)
        if seq.id == "bad":
            raise RuntimeError("injected")
        return admitted


def test_a_failing_step_fails_its_sequence_and_the_lane_serves_on(models):
    lane = make_lane(models, engine_class=FaultyEngine)
    _, bad = submit(lane, "bad", PROMPTS["a"], 3)
    good, eg = submit(lane, "good", PROMPTS["b"], 3)
    run_until_idle(lane)
    assert isinstance(bad[-1], Failed) and finished(eg).finish_reason == "length"
    assert len(good.generated) == 3
    assert not lane.engine._work  # the failed sequence's engine state went with it


class FailingStepEngine(Engine):
    """The real engine, whose third batched decode step raises as a GPU out of memory does; it counts the rows
    copied out of a batch (``decoder.leave``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = self.copied_out = 0
        leave = self.decoder.leave

        def counted(seqs):
            self.copied_out += 1
            return leave(seqs)

        self.decoder.leave = counted

    def step_batch(self, group):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return super().step_batch(group)


def test_a_batch_whose_step_failed_goes_whole_and_the_lane_serves_on(models):
    """No row is copied out of a batch whose step raised (its state is not to be trusted; on a GPU out of memory a
    copy asks for more): its rows fail, the engine holds nothing of them, and the next requests are served."""
    lane = make_lane(models, engine_class=FailingStepEngine, max_batch=4)
    sent = [submit(lane, name, PROMPTS[p], 8) for name, p in (("x", "a"), ("y", "b"))]
    run_until_idle(lane)
    assert all(isinstance(events[-1], Failed) for _, events in sent)
    assert lane.engine.copied_out == 0 and not lane.engine._work and lane.engine.batch_rows() == 0
    again, events = submit(lane, "again", PROMPTS["c"], 3)
    run_until_idle(lane)
    assert finished(events).finish_reason == "length" and len(again.generated) == 3


class LostDeviceEngine(Engine):
    """The real engine, whose admission of a sequence named "lost" raises CUDA's sticky error."""

    def admit(self, seq):
        admitted = super().admit(seq)
        if seq.id == "lost":
            raise RuntimeError("cudaMallocManaged(&data, size) failed: an illegal memory access was encountered")
        return admitted


def test_a_lost_device_ends_every_request_with_a_503_and_refuses_new_ones(models):
    """server.lane.device_loss: the sequence that hit the error and every other one in the lane end with
    ``DeviceLost``; later submissions and tasks are refused with it; the server's hook is called once."""
    lane = make_lane(models, engine_class=LostDeviceEngine, max_batch=2)
    calls = []
    lane.on_device_lost = lambda: calls.append(1)
    running, er = submit(lane, "first", PROMPTS["b"], 50)
    lane.tick()
    _, el = submit(lane, "lost", PROMPTS["a"], 3)
    _, ew = submit(lane, "waiting", PROMPTS["c"], 3)  # behind the batch limit of 2
    for _ in range(200):
        if lane.executor.device_lost is not None:
            break
        lane.tick()
    assert "illegal memory access" in lane.executor.device_lost
    lane._lose_device()  # what the lane thread does after the tick that saw it
    assert lane.state == LaneState.DEVICE_LOST and calls == [1]
    for events in (er, el, ew):
        assert isinstance(events[-1], Failed) and isinstance(events[-1].error, DeviceLost), events[-1]
        assert sum(isinstance(e, Failed) for e in events) == 1  # one end each
        assert events[-1].error.status_code == 503 and events[-1].error.code == "device_lost"
    with pytest.raises(DeviceLost):
        submit(lane, "later", PROMPTS["d"], 3)
    with pytest.raises(DeviceLost):
        lane.call(lambda: None)
    assert lane.idle()


class OutOfMemoryEngine(Engine):
    """The real engine, whose prefill of a sequence named "oom" runs out of memory its first ``fails`` times."""

    fails = 1

    def prefill(self, chunks, store_now):
        if any(seq.id == "oom" for seq, _ in chunks) and self.fails > 0:
            self.fails -= 1
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return super().prefill(chunks, store_now)


def test_a_prefill_out_of_memory_sends_the_prompt_back_to_the_queue_and_it_makes_its_tokens(models):
    want, _ = alone(models, "a", 5)
    lane = make_lane(models, engine_class=OutOfMemoryEngine, cache_bytes=1 << 26)
    other, eo = submit(lane, "other", PROMPTS["b"], 5)
    run_until_idle(lane)  # an entry in the RAM tier: it yields a quarter of its bytes after the failure
    evicted = lane.prompt_cache.stats()["evictions"]
    seq, events = submit(lane, "oom", PROMPTS["a"], 5)
    run_until_idle(lane)
    assert finished(events).finish_reason == "length" and list(seq.generated) == want
    assert seq.oom_retries == 1 and not any(isinstance(e, Failed) for e in events)
    assert lane.prompt_cache.stats()["evictions"] > evicted and lane.executor.device_lost is None


def test_a_prompt_that_keeps_running_out_of_memory_fails_after_its_retries(models):
    from server.lane.device_loss import MAX_OOM_RETRIES

    lane = make_lane(models, engine_class=OutOfMemoryEngine)
    lane.engine.fails = 100
    seq, events = submit(lane, "oom", PROMPTS["a"], 5)
    good, eg = submit(lane, "good", PROMPTS["b"], 3)
    run_until_idle(lane)
    assert isinstance(events[-1], Failed) and "out of memory" in str(events[-1].error)
    assert seq.oom_retries == MAX_OOM_RETRIES and lane.engine.fails == 100 - MAX_OOM_RETRIES - 1
    assert finished(eg).finish_reason == "length" and len(good.generated) == 3  # the lane served on


def test_an_anchor_is_stored_as_an_entry_of_its_own_and_what_was_written_is_reported(models):
    lane = make_lane(models, cache_bytes=1 << 26, chunk=8)
    prompt = list(range(20, 60))
    events = []
    params = SamplingParams(max_tokens=3, temperature=0.0)
    target = lane.engine.base_target()
    seq = Sequence(prompt=prompt, params=params, sink=events.append, id="a", target=target,
                   ns=lane.engine.namespace_for(target, params), anchors=(13,))
    lane.submit(seq)
    run_until_idle(lane)
    keys = lane.engine.prompt_cache.keys()
    assert (seq.ns, tuple(prompt[:13])) in keys  # the breakpoint's prefix, kept beside the whole conversation
    assert max(len(tokens) for _, tokens in keys) > len(prompt)  # the whole conversation, generated tokens too
    f = finished(events)
    assert f.cached_tokens == 0 and f.cache_write_tokens == len(prompt)
    b, eb = submit(lane, "b", prompt[:13] + [7, 7, 7], 2)
    run_until_idle(lane)
    assert finished(eb).cached_tokens == 13 and finished(eb).cache_write_tokens == 3


def test_prompts_that_arrive_together_compute_their_shared_prefix_once(models):
    """Two agents with one long system prompt arrive in the same tick: the first computes it and stores it at the
    point where the two prompts part (a dynamic anchor), the second waits and takes it from the cache, and each
    still makes the tokens it makes alone."""
    shared = list(range(100, 180))  # 80 tokens, above SHARED_PREFIX_MIN
    pa, pb = shared + [1, 2], shared + [3, 4, 5]
    solo = {}
    for name, prompt in (("a", pa), ("b", pb)):
        lane = make_lane(models, chunk=16)
        seq, _ = submit(lane, name, prompt, 4)
        run_until_idle(lane)
        solo[name] = list(seq.generated)
    lane = make_lane(models, chunk=16, cache_bytes=1 << 26)
    a, ea = submit(lane, "a", pa, 4)
    b, eb = submit(lane, "b", pb, 4)
    run_until_idle(lane)
    assert finished(ea).cached_tokens == 0
    assert finished(eb).cached_tokens == len(shared)  # b computed only its own tail
    assert (b.ns, tuple(shared)) in lane.engine.prompt_cache.keys()
    assert list(a.generated) == solo["a"] and list(b.generated) == solo["b"]


def test_a_forward_of_several_prompts_feeds_the_cost_model_each_prompts_share(models):
    """Two prompts prefilled in one forward both waited for all of it, but the SSD tier's cost model must learn this
    machine's prefill rate: each prompt is charged its share of the forward by tokens, so the two charges add up to
    the forward once (charging each the whole forward made the rate look 2x lower)."""
    lane = make_lane(models, chunk=64, prefill_batch=2, cache_bytes=1 << 26)
    seen = []
    cache = lane.engine.prompt_cache
    cache.observe_prefill = lambda tokens, seconds: seen.append((tokens, seconds))
    a, _ = submit(lane, "a", list(range(300, 308)), 2)  # 7 tokens to compute (the last one is decoded)
    b, _ = submit(lane, "b", list(range(400, 424)), 2)  # 23
    run_until_idle(lane)
    assert lane.stats.prefill_batches == 1  # both in one forward
    (ta, ca), (tb, cb) = sorted(seen)
    assert (ta, tb) == (7, 23) and ca > 0
    assert ca / cb == pytest.approx(7 / 23)  # shares of one forward, by tokens


def test_only_the_base_models_prefill_feeds_the_cost_model(models):
    """The SSD tier's cost model is the base model's (its rate is saved across restarts): the prefill of another
    model of the server (a ModelSlot) must not move it."""
    from server.engine.slot import ModelSlot

    other = ModelSlot(SimpleNamespace(model=models["X"], tokenizer=IdTokenizer(), fingerprint="1" * 16,
                                      model_id="x", context_length=4096), name="x", base=False)
    lane = make_lane(models, chunk=64, cache_bytes=1 << 26)
    seen = []
    lane.engine.prompt_cache.observe_prefill = lambda tokens, seconds: seen.append(tokens)
    submit(lane, "other", list(range(300, 340)), 2, served=other)
    submit(lane, "base", list(range(500, 520)), 2)
    run_until_idle(lane)
    assert seen == [19]


def spec_lane(models, *, in_batch: bool, max_batch=8):
    from server.engine.speculation import Speculation
    from spec import NgramProvider

    speculation = Speculation(NgramProvider(), num_draft_tokens=4, kind="ngram")
    return make_lane(models, max_batch=max_batch, chunk=64, speculation=speculation, spec_in_batch=in_batch)


def tokens_alone(models, prompts: dict, max_tokens: int, **kw) -> dict:
    """What each prompt makes alone on a fresh lane, without speculation: the reference of the batch tests."""
    out = {}
    for name, prompt in prompts.items():
        lane = make_lane(models, chunk=64)
        seq, _ = submit(lane, name, prompt, max_tokens, **kw)
        run_until_idle(lane)
        out[name] = list(seq.generated)
    return out


def spec_batches_seen(lane) -> list:
    """Run the lane until idle; the speculating batches that held more than one row on some tick."""
    seen = []
    for _ in range(400):
        if lane.idle():
            break
        lane.tick()
        seen += [b for _, b in lane.engine.decoder.groups.items() if len(b) > 1 and b.kind == "speculating"]
    assert lane.idle()
    return seen


ECHO = {  # prompts that repeat themselves, so that prompt lookup has something to propose
    "e1": [5, 6, 7, 8, 9] * 6,
    "e2": [40, 41, 42] * 9 + [40],
    "e3": [100, 7, 100, 8, 100, 9] * 4,
    "e4": list(range(60, 75)) * 2,
}


def test_speculating_requests_verify_their_drafts_in_one_batch_and_make_the_tokens_they_make_alone(models):
    """Four n-gram requests at once share one verify forward per step (rows of different draft lengths, each
    rewound by its own rejected count) and each makes the tokens it makes alone without speculation."""
    alone_tokens = tokens_alone(models, ECHO, 24)
    lane = spec_lane(models, in_batch=True)
    seqs = {name: submit(lane, name, prompt, 24) for name, prompt in ECHO.items()}
    spec_batches = spec_batches_seen(lane)
    assert spec_batches, "the speculating requests never ran in one batch"
    assert max(b.accepted for b in spec_batches) > 0  # drafts were accepted while several rows ran together
    for name, (seq, events) in seqs.items():
        assert finished(events).finish_reason in ("length", "stop")
        assert list(seq.generated) == alone_tokens[name], name


def test_a_step_that_raised_inside_the_compiled_sampler_leaves_the_next_sampled_request_working(models):
    """mlx-lm's sampler is compiled over MLX's global random state: a filter that raises inside it (top_k past the
    vocabulary, which the HTTP layer now clamps) left that state unusable, and every later sampled request of the
    server failed with "[eval] Attempting to eval an array without a primitive". The engine reseeds it."""
    lane = make_lane(models)
    results = {}
    for name, top_k in (("bad", 257 + 10), ("next", 0), ("greedy-too", 0)):
        events = []
        params = SamplingParams(max_tokens=4, temperature=0.0 if name == "greedy-too" else 0.8, top_k=top_k)
        target = lane.engine.base_target()
        lane.submit(Sequence(prompt=[5, 17, 99, 3], params=params, sink=events.append, id=name, target=target,
                             ns=lane.engine.namespace_for(target, params)))
        run_until_idle(lane)
        results[name] = events
    assert isinstance(results["bad"][-1], Failed)
    done = finished(results["next"])  # sampled from a random model: it may meet its EOS before 4 tokens
    assert 1 <= done.completion_tokens <= 4 and done.finish_reason in ("length", "stop"), results["next"][-1]
    assert finished(results["greedy-too"]).completion_tokens == 4


def test_an_on_demand_model_speculates_with_ngram_drafts_in_its_own_batch_and_makes_its_own_tokens(models):
    """n-gram drafting has no draft model, so it applies to every model of the server (issue 25): requests of
    another model (a ModelSlot, as server.pool loads them) verify their drafts in one batch of that model and make
    the tokens that model makes alone without speculation; its KV goes to its own namespace."""
    from server.engine.slot import ModelSlot

    other = ModelSlot(SimpleNamespace(model=models["X"], tokenizer=IdTokenizer(), fingerprint="1" * 16,
                                      model_id="x", context_length=4096), name="x", base=False)
    alone_tokens = tokens_alone(models, ECHO, 16, served=other)
    lane = make_lane(models, chunk=64)
    seq, _ = submit(lane, "e1-base", ECHO["e1"], 16)
    run_until_idle(lane)
    assert list(seq.generated) != alone_tokens["e1"]  # the other model's tokens are its own
    lane = spec_lane(models, in_batch=True)
    seqs = {name: submit(lane, name, prompt, 16, served=other) for name, prompt in ECHO.items()}
    assert all(s.ns.startswith("1" * 16) for s, _ in seqs.values())
    spec_batches = spec_batches_seen(lane)
    assert spec_batches and all(b.model is models["X"] for b in spec_batches)
    assert max(b.accepted for b in spec_batches) > 0
    for name, (seq, events) in seqs.items():
        assert finished(events).finish_reason in ("length", "stop")
        assert list(seq.generated) == alone_tokens[name], name


def test_a_speculating_batch_whose_drafts_do_not_pay_hands_its_rows_to_the_plain_batch(models, monkeypatch):
    """Once a speculating batch has made fewer than PAYS_YIELD tokens per row per step over its last JUDGE_STEPS
    steps, its rows go on in their group's plain batch (on the H200 a speculating step costs 1.6-2x a plain one),
    and each row still makes the tokens it makes alone. (The tiny model repeats itself, so its drafts do pay: the
    yield asked for is raised past anything a step can make, to reach the hand-over.)"""
    import server.engine.batch.speculating as speculating

    monkeypatch.setattr(speculating, "JUDGE_STEPS", 2)
    monkeypatch.setattr(speculating, "PAYS_YIELD", 100.0)
    prompts = {name: PROMPTS[name] for name in ("a", "b", "c")}
    alone_tokens = tokens_alone(models, prompts, 20)
    from server.engine.speculation import SpecTotals

    lane = spec_lane(models, in_batch=True)
    lane.stats.spec = SpecTotals("ngram", 4)
    seqs = {name: submit(lane, name, prompt, 20) for name, prompt in prompts.items()}
    kinds = []
    for _ in range(400):
        if lane.idle():
            break
        lane.tick()
        kinds.append(batch_kinds(lane, min_rows=2))
    assert lane.idle()
    first_spec = next(i for i, k in enumerate(kinds) if "speculating" in k)
    assert any(k & {"mlx", "ragged"} for k in kinds[first_spec:]), kinds  # went on in the plain batch
    assert lane.stats.spec.as_dict()["in_batch"]["handed_to_plain"] == 3
    for name, (seq, events) in seqs.items():
        assert finished(events).finish_reason in ("length", "stop")
        assert list(seq.generated) == alone_tokens[name], name
        assert not seq.group.speculating and seq.group.adapter is None  # the base model's plain group


def test_forwards_begun_above_mlxs_memory_limit_are_counted_and_still_make_their_tokens(models):
    """Above MLX's memory limit every evaluation waits for the device after each operation (slow, not wrong): the
    engine counts the batched steps and prefill forwards that began there (/stats memory.over_limit)."""
    want = {n: alone(models, n, 5) for n in "ab"}
    lane = make_lane(models)
    assert lane.engine.over_limit_stats() == {"decode_steps": 0, "prefill_forwards": 0}
    before = mx.set_memory_limit(1)  # every live array is over it
    try:
        runs = {n: submit(lane, n, PROMPTS[n], 5) for n in "ab"}
        run_until_idle(lane)
    finally:
        mx.set_memory_limit(before)
    counts = lane.engine.over_limit_stats()
    assert counts["prefill_forwards"] >= 2 and counts["decode_steps"] >= 3, counts
    for n, (seq, events) in runs.items():
        assert (list(seq.generated), text(events)) == want[n], n
    runs = {n: submit(lane, n, PROMPTS[n], 5) for n in "ab"}  # back under the limit: nothing more is counted
    run_until_idle(lane)
    assert lane.engine.over_limit_stats() == counts
