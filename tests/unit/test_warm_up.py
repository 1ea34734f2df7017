"""The warm-up run in steps (server.lane.warm), without a model: ``WarmUp``'s rule on a fake clock (the grace after
ready, the settle after work, the account /stats shows, a step that raises ends it), then a started lane thread over
the fake engine of test_lane_executor.py: ready before any step with --warm-up behind, after all of them with
before-ready; a request that arrives during a step waits for that step alone, never for the next; steps run on the
lane thread; a failing step leaves the lane serving; a sharded lane always warms up before ready. The real engine's
steps on a tiny model are at the end."""

from __future__ import annotations

import logging
import threading

import pytest

from server.lane.events import Failed, Finished, SamplingParams
from server.lane.seam import WarmStep
from server.lane.sequence import Sequence
from server.lane.warm import WarmMode, WarmState, WarmUp
from tests.unit.test_lane_executor import FakeEngine, lane_with

WAIT_S = 30  # a deadline for what must happen, never a measure of how fast


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def recording_steps(names, ran, fail_at=None, clock=None, cost=0.0):
    def make(name):
        def run():
            if clock is not None:
                clock.now += cost
            if name == fail_at:
                raise RuntimeError(f"{name} broke")
            ran.append(name)
        return WarmStep(name, run)
    return [make(n) for n in names]


# -- the rule, on a fake clock ----------------------------------------------------------------------------------------
def test_behind_waits_for_ready_then_the_grace_then_runs_every_step_in_order():
    clock, ran = Clock(), []
    warm = WarmUp("behind", grace_s=1.5, settle_s=0.25, clock=clock)
    warm.load(recording_steps(["a", "b", "c"], ran, clock=clock, cost=0.5))
    assert warm.as_dict() == {"mode": "behind", "state": "pending", "steps_done": 0, "steps": 3, "seconds": 0.0}
    assert warm.delay() is None  # not ready yet
    warm.on_ready()
    assert warm.delay() == pytest.approx(1.5)
    clock.now += 1.0
    assert warm.delay() == pytest.approx(0.5)
    clock.now += 0.5
    assert warm.delay() == 0.0
    warm.step()
    assert ran == ["a"] and warm.state == WarmState.RUNNING and not warm.finished
    warm.step()
    warm.step()
    assert ran == ["a", "b", "c"] and warm.finished
    assert warm.as_dict() == {"mode": "behind", "state": "done", "steps_done": 3, "steps": 3, "seconds": 1.5}
    assert warm.delay() is None
    warm.step()  # nothing left: nothing runs
    assert ran == ["a", "b", "c"]


@pytest.mark.parametrize("worked_at, now, delay", [
    (0.1, 0.1, 0.25),  # a request served early ends the grace: the next step waits only to settle
    (0.1, 0.3, 0.05),
    (3.0, 3.1, 0.15),  # work after the grace: a step waits for the lane to have been idle a while
    (3.0, 3.5, 0.0),
])
def test_work_ends_the_grace_and_each_step_waits_for_the_lane_to_settle(worked_at, now, delay):
    clock = Clock()
    start = clock.now
    warm = WarmUp("behind", grace_s=1.5, settle_s=0.25, clock=clock)
    warm.load(recording_steps(["a"], []))
    warm.on_ready()
    clock.now = start + worked_at
    warm.worked()
    clock.now = start + now
    assert warm.delay() == pytest.approx(delay)


def test_a_step_that_raises_is_logged_once_and_ends_the_warm_up(caplog):
    ran = []
    warm = WarmUp("behind", grace_s=0, clock=Clock())
    warm.load(recording_steps(["a", "b", "c"], ran, fail_at="b"))
    warm.on_ready()
    with caplog.at_level(logging.ERROR, logger="mlx_lane.lane"):
        warm.step()
        warm.step()
        warm.step()
    assert ran == ["a"] and warm.state == WarmState.FAILED and warm.finished and warm.delay() is None
    assert warm.as_dict()["steps_done"] == 1 and warm.as_dict()["state"] == "failed"
    assert len([r for r in caplog.records if "'b' failed" in r.getMessage()]) == 1


@pytest.mark.parametrize("mode, ran_before_ready, state", [
    ("before-ready", ["a", "b"], "done"),
    ("off", [], "off"),
])
def test_before_ready_runs_everything_at_once_and_off_runs_nothing(mode, ran_before_ready, state):
    ran = []
    warm = WarmUp(mode, grace_s=0, clock=Clock())
    warm.load(recording_steps(["a", "b"], ran))
    if warm.mode == WarmMode.BEFORE_READY:
        warm.run_all()
    warm.on_ready()
    assert ran == ran_before_ready and warm.as_dict()["state"] == state and warm.finished
    assert warm.delay() is None  # nothing ever runs behind the requests


def test_no_steps_is_done_and_steps_that_cannot_be_planned_are_a_failure(caplog):
    empty = WarmUp("behind")
    empty.load([])
    assert empty.state == WarmState.DONE
    broken = WarmUp("behind")
    with caplog.at_level(logging.ERROR, logger="mlx_lane.lane"):
        try:
            raise RuntimeError("no steps")
        except RuntimeError:
            broken.fail("planning the steps")
    assert broken.state == WarmState.FAILED and "planning the steps failed" in caplog.text
    with pytest.raises(ValueError):
        WarmUp("later")


# -- a started lane over the fake engine ------------------------------------------------------------------------------
class WarmingEngine(FakeEngine):
    """The fake engine with warm-up steps that record where they ran, between the engine's other verbs (``calls``);
    ``gate[name]``, when set, holds that step until the test releases it."""

    def __init__(self, names=("a", "b", "c"), fail_at=None):
        super().__init__()
        self.names, self.fail_at = names, fail_at
        self.gate: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {n: threading.Event() for n in names}
        self.threads: set[str] = set()
        self.planned = 0

    def warmup_steps(self):
        self.planned += 1

        def make(name):
            def run():
                self.started[name].set()
                self.threads.add(threading.current_thread().name)
                if name in self.gate:
                    assert self.gate[name].wait(WAIT_S)
                if name == self.fail_at:
                    raise RuntimeError(f"{name} broke")
                self.calls.append(("warm", name))
            return WarmStep(name, run)
        return [make(n) for n in self.names]


def started_lane(engine, mode="behind", grace_s=0.0, settle_s=0.0, **kw):
    lane = lane_with(engine, warm_up=mode, **kw)
    lane.warm.grace_s, lane.warm.settle_s = grace_s, settle_s
    lane.start()
    assert lane.ready.wait(WAIT_S)
    return lane


def request(lane, name, prompt=(1, 2, 3), max_tokens=3):
    done, events = threading.Event(), []

    def sink(event):
        events.append(event)
        if isinstance(event, (Finished, Failed)):
            done.set()

    seq = Sequence(prompt=list(prompt), params=SamplingParams(max_tokens=max_tokens, temperature=0.0), sink=sink,
                   id=name, ns="ns")
    lane.submit(seq)
    return done, events


def wait_until(predicate):
    deadline = threading.Event()
    for _ in range(WAIT_S * 100):
        if predicate():
            return True
        deadline.wait(0.01)
    return predicate()


def test_behind_the_lane_is_ready_before_any_step_and_the_steps_run_on_its_thread_while_idle():
    engine = WarmingEngine()
    engine.gate["a"] = threading.Event()
    lane = started_lane(engine)
    try:
        assert lane.ready.is_set() and lane.warm.steps_done == 0  # ready first: step "a" is held, none done
        engine.gate["a"].set()
        assert wait_until(lambda: lane.warm.state == WarmState.DONE), lane.warm.as_dict()
        assert [c for c in engine.calls if c[0] == "warm"] == [("warm", "a"), ("warm", "b"), ("warm", "c")]
        assert engine.threads == {"mlx-lane"} and engine.planned == 1
        assert lane.warm.as_dict()["steps_done"] == 3 and lane.warm.as_dict()["steps"] == 3
    finally:
        lane.stop()


def test_a_request_that_arrives_during_a_step_waits_for_that_step_alone():
    engine = WarmingEngine()
    engine.gate["a"] = threading.Event()
    lane = started_lane(engine, settle_s=0.05)
    try:
        assert engine.started["a"].wait(WAIT_S)  # step "a" runs (held)
        done, events = request(lane, "r")
        engine.gate["a"].set()
        assert done.wait(WAIT_S) and isinstance(events[-1], Finished)
        assert wait_until(lambda: lane.warm.state == WarmState.DONE)
        order = [c[1] if c[0] == "warm" else c[0] for c in engine.calls]
        # the request ran right after the step in progress, to its end; the next steps only once the lane was idle
        assert order[0] == "a" and order[1] == "admit" and order[-2:] == ["b", "c"]
        assert "b" not in order[:order.index("end")]
    finally:
        lane.stop()


def test_no_step_runs_in_the_grace_unless_a_request_was_served_first():
    engine = WarmingEngine()
    lane = started_lane(engine, grace_s=WAIT_S * 10)  # a grace no test waits out
    try:
        done, _ = request(lane, "first")
        assert done.wait(WAIT_S)
        # the first request ran on a cold lane, then the steps: its service ended the grace
        assert wait_until(lambda: lane.warm.state == WarmState.DONE), lane.warm.as_dict()
        order = [c[1] if c[0] == "warm" else c[0] for c in engine.calls]
        assert order[0] == "admit" and order[-3:] == ["a", "b", "c"]
    finally:
        lane.stop()


def test_a_failing_step_stops_the_warm_up_and_the_lane_serves_on():
    engine = WarmingEngine(fail_at="b")
    lane = started_lane(engine)
    try:
        assert wait_until(lambda: lane.warm.state == WarmState.FAILED)
        done, events = request(lane, "after")
        assert done.wait(WAIT_S) and isinstance(events[-1], Finished)
        assert [c for c in engine.calls if c[0] == "warm"] == [("warm", "a")]
        assert lane.warm.as_dict()["steps_done"] == 1
    finally:
        lane.stop()


@pytest.mark.parametrize("mode, done, planned", [("before-ready", 3, 1), ("off", 0, 0)])
def test_before_ready_warms_everything_before_ready_and_off_plans_nothing(mode, done, planned):
    engine = WarmingEngine()
    lane = started_lane(engine, mode=mode)
    try:
        # at the moment ready is set, the warm-up is already what it will be: nothing runs behind the requests
        assert lane.warm.steps_done == done and lane.warm.finished and engine.planned == planned
        req, _ = request(lane, "r")
        assert req.wait(WAIT_S)
        assert lane.warm.steps_done == done
    finally:
        lane.stop()


def test_a_sharded_lane_warms_up_before_ready_whatever_was_asked():
    assert lane_with(FakeEngine(), warm_up="behind", replay=object()).warm.mode == WarmMode.BEFORE_READY
    assert lane_with(FakeEngine(), warm_up="off", replay=object()).warm.mode == WarmMode.OFF
    assert lane_with(FakeEngine(), warm_up="behind").warm.mode == WarmMode.BEHIND


# -- the real engine's steps, on a tiny model -------------------------------------------------------------------------
SAMPLING = ["short prompt, greedy and temperature", "sampling with top-p", "sampling with top-k and min-p"]
GPU_STEPS = ["weights", "prefill chunk 1", "prefill chunk 2", "one-token steps", *SAMPLING, "batched step (ragged)",
             "batched prefill", "batched prefill past a cache", "batched tail past a cache", "free buffers"]


@pytest.mark.parametrize("arch, gpu, names", [
    ("llama", False, ["weights", "prefill chunk 1", "one-token steps", *SAMPLING, "batched step (ragged)",
                      "free buffers"]),
    ("llama", True, GPU_STEPS),
    # a hybrid prefills together too (its padding kept out of the state): its batched forwards past cached
    # prefixes are warmed up like a plain model's
    ("qwen3_5", True, GPU_STEPS),
    ("gpt_oss", True, GPU_STEPS),  # sliding windows and sinks
])
def test_the_engines_warm_up_is_its_old_work_in_steps_that_each_run(arch, gpu, names):
    from types import SimpleNamespace

    from cache.prompt_cache import NullPromptCache
    from server.engine.batch import Layout
    from server.engine.engine import Engine, EngineConfig
    from server.stats import ServingStats
    from tests.fixtures import zoo
    from tests.fixtures.tiny_models import IdTokenizer, tiny_llama

    model = tiny_llama(seed=11) if arch == "llama" else zoo.build(arch, vocab=257, seed=11)
    loaded = SimpleNamespace(model=model, tokenizer=IdTokenizer(), fingerprint="0" * 16)
    engine = Engine(loaded, NullPromptCache(), ServingStats(),
                    EngineConfig(prefill_chunk=16, layout=Layout(batch_layout="ragged", gpu=gpu)))
    engine.bind_stream()
    steps = engine.warmup_steps()
    assert [s.name for s in steps] == names
    from server.lane.seam import WARMER_CHAINS

    assert {s.chain for s in steps} - {""} <= set(WARMER_CHAINS)  # every chain a kernel warmer can be dealt
    warm = WarmUp("before-ready")
    warm.load(steps)
    warm.run_all()
    assert warm.state == WarmState.DONE, warm.as_dict()


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_a_speculating_server_warms_a_request_speculating_on_its_own_on_a_gpu(kind):
    """With speculation on, the GPU warm-up ends with a request's speculative rounds (verify forwards of 1 + drafts,
    the draft's own forwards, rejected drafts taken back), on the zoo's hybrid with its MTP layer: each step runs here
    on the CPU as the lane would run it (on a GPU they compile those kernels before the first request)."""
    from types import SimpleNamespace

    from cache.prompt_cache import NullPromptCache
    from models.mtp import facts_of, tap
    from server.engine.batch import Layout
    from server.engine.engine import Engine, EngineConfig
    from server.engine.speculation import Speculation
    from server.stats import ServingStats
    from spec import NgramProvider
    from spec.mtp import MtpProvider
    from tests.fixtures import zoo_mtp
    from tests.fixtures.tiny_models import IdTokenizer

    model, head = zoo_mtp.build("qwen3_5", vocab=257, seed=11)
    provider = (NgramProvider() if kind == "ngram" else
                MtpProvider(head, tap(model), identity="mtp:test", target_params=10 * head.params,
                            facts=facts_of(head, "qwen3_5")))
    speculation = Speculation(provider, num_draft_tokens=3, kind=kind)
    loaded = SimpleNamespace(model=model, tokenizer=IdTokenizer(), fingerprint="0" * 16)
    engine = Engine(loaded, NullPromptCache(), ServingStats(),
                    EngineConfig(prefill_chunk=16, layout=Layout(batch_layout="ragged", gpu=True),
                                 speculation=speculation))
    engine.bind_stream()
    steps = engine.warmup_steps()
    assert [s.name for s in steps][-2:] == ["speculative rounds", "free buffers"]
    warm = WarmUp("before-ready")
    warm.load(steps)
    warm.run_all()
    assert warm.state == WarmState.DONE, warm.as_dict()

    cpu = Engine(loaded, NullPromptCache(), ServingStats(),
                 EngineConfig(prefill_chunk=16, layout=Layout(batch_layout="ragged"), speculation=speculation))
    cpu.bind_stream()
    assert "speculative rounds" not in [s.name for s in cpu.warmup_steps()]  # nothing compiles on the CPU
