"""server.stack_sampler: the in-process profiler behind GET /admin/profile, on real threads."""

from __future__ import annotations

import threading
import time

from server.stack_sampler import Profile, sample


def _busy_python(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _sleeping(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)


def test_samples_say_which_function_each_named_thread_is_in():
    stop = threading.Event()
    threads = [threading.Thread(target=_busy_python, args=(stop,), name="busy-one"),
               threading.Thread(target=_sleeping, args=(stop,), name="sleepy-one")]
    for t in threads:
        t.start()
    try:
        profile = sample(["busy-one", "sleepy-one", "no-such-thread"], 0.5, 0.002)
    finally:
        stop.set()
        for t in threads:
            t.join()
    body = profile.as_dict(top=5)
    assert body["missing_threads"] == ["no-such-thread"]
    assert body["samples"] > 20
    busy, sleepy = body["threads"]["busy-one"], body["threads"]["sleepy-one"]
    assert busy["samples"] > 20 and sleepy["samples"] > 20
    top = {row["function"]: row["share"] for row in busy["top_total"]}
    assert top["tests/unit/test_stack_sampler.py _busy_python"] == 1.0
    assert "tests/unit/test_stack_sampler.py _sleeping" not in top
    assert any(row["line"].startswith("tests/unit/test_stack_sampler.py:") for row in busy["top_self"])
    assert sleepy["top_total"][0]["share"] == 1.0
    # folded stacks: outermost first, the count last; every sample counted once
    counts = [int(line.rsplit(" ", 1)[1]) for line in busy["folded"]]
    assert sum(counts) == busy["samples"]
    assert all(line.startswith("threading.py:") for line in busy["folded"])
    assert any("_busy_python" in line.rsplit(";", 1)[1] for line in busy["folded"])


def test_a_stop_event_ends_sampling_early_and_limits_are_clamped():
    stop = threading.Event()
    stop.set()
    t0 = time.perf_counter()
    profile = sample(["MainThread"], 60, 0.001, stop=stop)
    assert time.perf_counter() - t0 < 5
    assert profile.samples == 0 and profile.as_dict()["threads"]["MainThread"]["samples"] == 0
    assert Profile().as_dict()["threads"] == {}
