"""--debug-cuda-profile-steps (server.lane.cuda_profile): the profiler starts right before the A-th batch step and
stops right after the B-th, the device waited for at both ends, and nothing happens outside the range. The calls are
recorded through injected functions (no CUDA driver here); the lane's placement of them is checked with the fake
engine of test_lane_executor, and the flag on a live server in tests/integration/test_lane_behaviour.py."""

from __future__ import annotations

import pytest

from server.lane import cuda_profile
from server.lane.cuda_profile import StepRange
from tests.unit.test_lane_executor import FakeEngine, lane_with, run, submit


def recorded(first: int, last: int, calls: list) -> StepRange:
    def profiler(on: bool) -> bool:
        calls.append("start" if on else "stop")
        return True

    return StepRange(first, last, profiler=profiler, synchronize=lambda: calls.append("sync"))


def test_the_range_holds_exactly_steps_a_to_b():
    calls: list = []
    r = recorded(3, 4, calls)
    for step in range(1, 7):
        r.before_step()
        calls.append(f"step {step}")
        r.after_step()
    assert calls == ["step 1", "step 2", "sync", "start", "step 3", "step 4", "sync", "stop", "step 5", "step 6"]
    assert r.done and r.started is True


@pytest.mark.parametrize("spec, want", [("", None), ("  ", None), ("7", ("step", 7, 7)),
                                        ("200:203", ("step", 200, 203)), ("step:4:5", ("step", 4, 5)),
                                        ("prefill:2:9", ("prefill", 2, 9)), ("prefill:3", ("prefill", 3, 3))])
def test_a_spec_parses_to_its_steps(spec, want):
    r = StepRange.parse(spec)
    assert (None if r is None else (r.kind, r.first, r.last)) == want


@pytest.mark.parametrize("spec", ["0:3", "5:2", "a:b", "3:", ":3", "1:2:3", "prefill", "prefill:", "decode:1:2"])
def test_a_malformed_spec_says_the_form_it_wants(spec):
    with pytest.raises(ValueError, match="expected A:B"):
        StepRange.parse(spec)


def test_without_a_cuda_driver_the_profiler_answers_false():
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert cuda_profile.driver_profiler(True) is False and cuda_profile.driver_profiler(False) is False
    else:
        pytest.skip("this machine has a CUDA driver")


def test_the_lane_brackets_its_batch_steps_and_its_answers_do_not_change():
    def batch_of_two(range_: StepRange | None):
        cuda_profile._range = range_
        engine = FakeEngine()
        lane = lane_with(engine, max_batch=4)
        seqs = [submit(lane, n, p, 6)[0] for n, p in (("a", [10, 11, 12]), ("b", [50, 51]))]
        try:
            run(lane)
        finally:
            cuda_profile._range = None
        return engine, [s.generated for s in seqs]

    calls: list = []
    profiled = recorded(2, 3, calls)
    engine, tokens = batch_of_two(profiled)
    assert tokens == batch_of_two(None)[1] == [[13, 14, 15, 16, 17, 18], [52, 53, 54, 55, 56, 57]]
    steps = [c for c in engine.calls if c[0] == "step"]
    assert len(steps) > 3 and profiled.done and profiled.steps == 3  # the steps after it are not counted
    assert calls == ["sync", "start", "sync", "stop"]  # one range, around batch steps 2 and 3
    assert cuda_profile.current() is None  # nothing configured after the test


def test_a_prefill_range_brackets_the_lanes_prefill_calls_and_not_its_steps():
    cuda_profile._range = None
    calls: list = []
    profiled = recorded(2, 3, calls)
    profiled.kind = "prefill"
    cuda_profile._range = profiled
    try:
        assert cuda_profile.current() is None and cuda_profile.current("prefill") is profiled
        engine = FakeEngine()
        lane = lane_with(engine)
        seq, _ = submit(lane, "a", list(range(1, 16)), 2)  # 14 prompt tokens: prefill calls of 4, 4, 4, 2
        run(lane)
    finally:
        cuda_profile._range = None
    assert [c for c in engine.calls if c[0] == "prefill"] == [("prefill", "a", 4)] * 3 + [("prefill", "a", 2)]
    assert calls == ["sync", "start", "sync", "stop"] and profiled.steps == 3 and seq.generated == [16, 17]
