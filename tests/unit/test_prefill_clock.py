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
                     "build_ms": 4.0, "clear_ms": 1.0}
    # a gathered forward's graph is built and evaluated inside mlx-lm's one call: no build time of its own
    assert gathered["build_ms"] is None and gathered["clear_ms"] == 2.0 and gathered["new_shape"] is True
    assert again["new_shape"] is False and again["clear_ms"] == 0.0  # nothing handed back (the CPU)


def test_only_the_last_forwards_are_listed():
    clock = PrefillClock()
    for i in range(RECENT_FORWARDS + 5):
        clock.forward(1, i + 1, i + 1, 0.001)
    recent = clock.as_dict()["recent"]
    assert len(recent) == RECENT_FORWARDS and recent[0]["length"] == 6 and recent[-1]["length"] == RECENT_FORWARDS + 5
