"""server.engine.prefill.PrefillClock: /stats ``lane.prefill_parts``, its totals and its last forwards one by one with
their parts (the host's graph building of a lone forward, the buffers handed back after one)."""

from __future__ import annotations

from server.engine.prefill import RECENT_FORWARDS, PrefillClock


def test_forwards_count_alone_and_together_and_list_their_parts():
    clock = PrefillClock()
    clock.forward(1, 300, 300, 0.050, cached=5000, build_s=0.004, clear_s=0.001)
    clock.forward(3, 200, 450, 0.120, cached=5500, clear_s=0.002)
    clock.forward(1, 300, 300, 0.040, cached=5000, build_s=0.003)
    got = clock.as_dict()
    assert got["forwards"] == {"alone": 2, "together": 1, "together_rows": 3}
    assert got["tokens"] == 1050 and got["forward_s"] == 0.21 and got["forward_shapes"] == 2
    first, gathered, again = got["recent"]
    assert first == {"rows": 1, "length": 300, "tokens": 300, "cached": 5000, "ms": 50.0, "new_shape": True,
                     "build_ms": 4.0, "clear_ms": 1.0, "wait_ms": None}
    # a gathered forward's graph is built and evaluated inside mlx-lm's one call: no build time of its own
    assert gathered["build_ms"] is None and gathered["clear_ms"] == 2.0 and gathered["new_shape"] is True
    assert again["new_shape"] is False and again["clear_ms"] == 0.0  # nothing handed back (the CPU)


def test_only_the_last_forwards_are_listed():
    clock = PrefillClock()
    for i in range(RECENT_FORWARDS + 5):
        clock.forward(1, i + 1, i + 1, 0.001)
    recent = clock.as_dict()["recent"]
    assert len(recent) == RECENT_FORWARDS and recent[0]["length"] == 6 and recent[-1]["length"] == RECENT_FORWARDS + 5


def test_a_forwards_wait_for_the_queued_work_is_listed_apart_when_measured():
    clock = PrefillClock()
    clock.forward(1, 3, 3, 0.015, cached=2048, build_s=0.002, wait_s=0.0551)
    clock.forward(2, 8, 12, 0.030, cached=100, wait_s=0.0)
    alone, gathered = clock.as_dict()["recent"]
    assert alone["wait_ms"] == 55.1 and alone["ms"] == 15.0  # the wait is not part of the forward's time
    assert gathered["wait_ms"] == 0.0
    assert clock.as_dict()["forward_s"] == 0.045


def test_the_wait_first_knob_waits_on_the_lanes_stream_and_times_it(monkeypatch):
    import mlx.core as mx

    from server.engine import prefill

    waited = []
    monkeypatch.setattr(mx, "synchronize", lambda stream=None: waited.append(stream))
    stream = mx.default_stream(mx.default_device())
    filler = prefill.Prefiller(lambda seq: None, writer=None, prompt_cache=None, gpu=False, stream_of=lambda: stream)
    assert filler._wait_for_the_stream() is None and waited == []  # off: no wait, nothing recorded
    try:
        prefill.configure(wait_first=True)
        got = filler._wait_for_the_stream()
        assert waited == [stream] and got is not None and got >= 0.0
    finally:
        prefill.configure()
    assert prefill.WAIT_FIRST is False and prefill.KEEP_BUFFERS is False
