"""Adapter groups in the batching lane, tick by tick, on the fake engine (no model): each adapter in use has its own
batch, every tick steps every group (no head-of-line blocking between adapters), a group's lone sequence decodes
solo, base-model requests keep the single-stream fast path; lane tasks run one per tick between decode steps."""

from __future__ import annotations

import pytest

from server.errors import ShuttingDown
from server.lane import Lane
from tests.unit.fake_lane import FakeEngine, job


def make_lane(max_batch=8, chunk=4):
    engine = FakeEngine(prefill_chunk=chunk)
    return Lane(engine, max_batch=max_batch), engine


def run_until_idle(lane, limit=500):
    for _ in range(limit):
        if not lane._waiting and not lane._active and not lane._tasks:
            return
        lane.tick()
    raise AssertionError("the lane did not become idle")


def steps(log):
    return [e for e in log if e[0] == "batch"]


def test_two_adapters_each_get_a_batch_and_both_step_every_tick():
    lane, engine = make_lane()
    for name, p0, adapter in (("x1", 1, "X"), ("x2", 2, "X"), ("y1", 3, "Y"), ("y2", 4, "Y")):
        lane.submit(job(name, [p0, 9], max_tokens=5, adapter=adapter)[0])
    for _ in range(3):
        lane.tick()
    groups = [(e[1], e[2]) for e in steps(engine.log)]
    assert ("X", ("x1", "x2")) in groups and ("Y", ("y1", "y2")) in groups
    per_tick_x = [g for g in groups if g[0] == "X"]
    per_tick_y = [g for g in groups if g[0] == "Y"]
    assert len(per_tick_x) == len(per_tick_y) == 3  # both groups stepped in every tick: neither waits
    run_until_idle(lane)
    for name, p0 in (("x1", 1), ("x2", 2), ("y1", 3), ("y2", 4)):
        assert engine.finished[name][1] == [p0 * 100 + i for i in range(1, 6)]  # the tokens it makes alone
    assert set(lane._batches) == {None}  # the adapter groups' batches are gone once empty


def test_a_lone_sequence_per_group_decodes_solo_and_base_keeps_its_fast_path():
    lane, engine = make_lane()
    lane.submit(job("base", [1, 9], max_tokens=4)[0])
    lane.submit(job("ad", [2, 9], max_tokens=4, adapter="X")[0])
    run_until_idle(lane)
    assert not steps(engine.log)  # two groups of one: each runs the solo path, no batch of one
    assert ("solo", "base") in engine.log and ("solo", "ad") in engine.log
    assert engine.finished["base"][1] == [101, 102, 103, 104]
    assert engine.finished["ad"][1] == [201, 202, 203, 204]


def test_a_long_adapter_request_does_not_hold_back_base_requests():
    lane, engine = make_lane()
    lane.submit(job("long", [1, 9], max_tokens=50, adapter="X")[0])
    lane.submit(job("long2", [2, 9], max_tokens=50, adapter="X")[0])
    lane.tick()
    lane.submit(job("b1", [3, 9], max_tokens=3)[0])
    lane.submit(job("b2", [4, 9], max_tokens=3)[0])
    for _ in range(5):
        lane.tick()
    assert "b1" in engine.finished and "b2" in engine.finished  # while the adapter group runs on
    assert "long" not in engine.finished
    assert engine.finished["b1"][1] == [301, 302, 303]


def test_a_batch_of_one_in_a_group_goes_solo_when_its_group_has_nothing_else():
    lane, engine = make_lane()
    lane.submit(job("a", [1, 9], max_tokens=8, adapter="X")[0])
    lane.submit(job("b", [2, 9], max_tokens=2, adapter="X")[0])
    lane.submit(job("c", [3, 9], max_tokens=8)[0])  # base, alone in its group
    run_until_idle(lane)
    assert ("resume_solo", "a") in engine.log  # b ended: a left the X batch although c (base) still decodes
    assert engine.finished["a"][1] == [100 + i for i in range(1, 9)]


def test_tasks_run_on_the_lane_one_per_tick_between_decode_steps():
    lane, engine = make_lane()
    lane.submit(job("a", [1, 9], max_tokens=6)[0])
    lane.submit(job("b", [2, 9], max_tokens=6)[0])
    lane.tick()
    futures = [lane.call(lambda i=i: engine.log.append(("task", i)) or i * 10) for i in range(3)]
    for _ in range(3):
        lane.tick()
    assert [f.result(timeout=0) for f in futures] == [0, 10, 20]
    order = [e[0] for e in engine.log if e[0] in ("task", "batch")]
    # one task, then that tick's decode step: never two tasks back to back while sequences decode
    assert "task" in order and all(not (x == y == "task") for x, y in zip(order, order[1:]))


def test_a_failing_task_reports_its_error_and_a_draining_lane_refuses_tasks():
    lane, _ = make_lane()

    def boom():
        raise ValueError("bad input")

    f = lane.call(boom)
    run_until_idle(lane)
    with pytest.raises(ValueError, match="bad input"):
        f.result(timeout=0)
    lane.drain()
    with pytest.raises(ShuttingDown):
        lane.call(lambda: 1)
