"""The lane's executor against a small fake of the ``LaneEngine`` protocol (server.lane.seam): no model, no MLX. The
fake decodes a known token stream (each token the previous one plus one), so what the lane makes of the engine's
records is checked exactly: phases, coverage, tokens, the one ``Finished`` or ``Failed`` per sequence, the verbs in
their order, a batch step that raises, a row that moves to another group. The real engine on a tiny model is
test_lane.py's."""

from __future__ import annotations

from typing import Optional

import pytest

from server.lane.events import Delta, Failed, Finished, Progress, SamplingParams
from server.lane.lane import Lane
from server.lane.seam import Admitted, BatchStep, Emitted, Ended, GroupKey, LaneEngine, Prefilled, SeqFacts
from server.lane.sequence import Phase, Sequence
from server.stats import ServingStats
from tests.fixtures.tiny_models import TextOfIds

GROUP = GroupKey("model")


class FakeEngine:
    """A ``LaneEngine`` whose model is arithmetic: after token t comes t + 1. Records every verb it is asked."""

    prefill_chunk = 4
    stream = None

    def __init__(self, fail_step: bool = False, regroup_to: Optional[GroupKey] = None):
        self.calls: list[tuple] = []
        self.fail_step, self.regroup_to = fail_step, regroup_to
        self.covered: dict = {}
        self.batches: dict = {}  # group -> [seq]
        self.ended: list = []

    def base_target(self):
        return None

    def namespace_for(self, target, params) -> str:
        return "ns"

    def bind_stream(self, as_default: bool = False) -> None:
        pass

    def warmup_steps(self):
        return ()

    def task_context(self):
        import contextlib

        return contextlib.nullcontext()

    def classify(self, seq, company: bool = False) -> SeqFacts:
        return SeqFacts(group=GROUP, batchable=True)

    def admit(self, seq) -> Admitted:
        self.calls.append(("admit", seq.id))
        self.covered[seq] = 0
        return Admitted(0, TextOfIds(), frozenset({0}))

    def take_longer_prefix(self, seq) -> Optional[int]:
        return None

    def prefill(self, chunks, store_now: bool) -> list[Prefilled]:
        out = []
        for seq, n in chunks:
            self.calls.append(("prefill", seq.id, n))
            self.covered[seq] = min(len(seq.prompt) - 1, self.covered[seq] + n)
            out.append(Prefilled(seq, self.covered[seq], self.covered[seq] >= len(seq.prompt) - 1))
        return out

    def join_batch(self, group, seqs) -> None:
        self.calls.append(("join", tuple(s.id for s in seqs)))
        self.batches.setdefault(group, []).extend(seqs)

    def leave_batch(self, seq) -> None:
        self.calls.append(("leave", seq.id))
        self.batches[seq.group].remove(seq)

    def _next(self, seq) -> int:
        history = seq.prompt + seq.generated
        return history[-1] + 1

    def step_batch(self, group):
        self.calls.append(("step", group))
        if self.fail_step:
            raise RuntimeError("the batch's forward failed")
        out = [Emitted(s, self._next(s)) for s in self.batches.get(group, [])]
        if self.regroup_to is not None:  # the rows now decode in another group
            moved = self.batches.pop(group, [])
            self.batches.setdefault(self.regroup_to, []).extend(moved)
            regrouped = tuple((s, SeqFacts(group=self.regroup_to, batchable=True)) for s in moved)
            self.regroup_to = None
            return BatchStep(out, regrouped)
        return BatchStep(out)

    def step_solo(self, seq) -> Optional[Emitted]:
        self.calls.append(("solo", seq.id))
        return Emitted(seq, self._next(seq))

    def end(self, seqs) -> list[Ended]:
        self.calls.append(("end", tuple(s.id for s in seqs)))
        for seq in seqs:
            for rows in self.batches.values():
                if seq in rows:
                    rows.remove(seq)
            self.ended.append(seq.id)
        return [Ended(stored=len(s.prompt) - 1) for s in seqs]

    def abandon(self, seq) -> None:
        self.calls.append(("abandon", seq.id))
        for rows in self.batches.values():
            if seq in rows:
                rows.remove(seq)

    def reset_batch(self, group, seqs=()) -> None:
        self.calls.append(("reset", group, tuple(s.id for s in seqs)))
        self.batches.pop(group, None)

    def batch_rows(self) -> int:
        return sum(len(r) for r in self.batches.values())

    def batch_kv_bytes(self) -> int:
        return 0


class NoCache:
    def ready(self, prompt, ns, session):
        return True

    def peek(self, prompt, ns, session, local=False):
        return 0

    def make_room(self, nbytes):
        pass


def lane_with(engine, **kw) -> Lane:
    return Lane(engine, NoCache(), ServingStats(), **kw)


def submit(lane, name, prompt, max_tokens):
    events = []
    seq = Sequence(prompt=list(prompt), params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   sink=events.append, id=name, ns="ns")
    lane.submit(seq)
    return seq, events


def run(lane, limit=200):
    for _ in range(limit):
        if lane.idle():
            return
        lane.tick()
    raise AssertionError("the lane did not become idle")


@pytest.mark.parametrize("impl", ["fake", "engine"])
def test_the_fake_and_the_real_engine_are_lane_engines(impl):
    import inspect

    from server.engine.engine import Engine

    cls = FakeEngine if impl == "fake" else Engine
    verbs = [n for n, _ in inspect.getmembers(LaneEngine, inspect.isfunction) if not n.startswith("_")]
    assert len(verbs) >= 15
    for verb in verbs:
        mine = inspect.signature(getattr(cls, verb))
        theirs = inspect.signature(getattr(LaneEngine, verb))
        assert list(mine.parameters) == list(theirs.parameters), verb


def test_sequences_get_the_engines_tokens_one_finish_each_and_share_a_batch():
    engine = FakeEngine()
    lane = lane_with(engine, max_batch=4)
    runs = {n: submit(lane, n, p, 5) for n, p in (("a", [10, 11, 12, 13, 14, 15]), ("b", [50, 51]))}
    run(lane)
    for name, (seq, events) in runs.items():
        last = seq.prompt[-1]
        assert seq.generated == [last + i for i in range(1, 6)]
        assert "".join(e.text for e in events if isinstance(e, Delta)) == "".join(f"<{t}>" for t in seq.generated)
        (done,) = [e for e in events if isinstance(e, Finished)]
        assert events[-1] is done and done.finish_reason == "length" and done.completion_tokens == 5
        assert seq.phase == Phase.FINISHED and seq.stored == len(seq.prompt) - 1
    assert any(c[0] == "join" and set(c[1]) == {"a", "b"} for c in engine.calls)  # they decoded in one batch
    assert sorted(engine.ended) == ["a", "b"]
    progress = [e for e in runs["a"][1] if isinstance(e, Progress)]
    assert progress and progress[-1].done == 5  # the prompt, chunk by chunk, but its last token
    assert lane.stats.requests_served == 2


def test_a_lone_sequence_decodes_solo_and_its_prefill_comes_in_chunks():
    engine = FakeEngine()
    lane = lane_with(engine)
    seq, events = submit(lane, "a", list(range(1, 12)), 3)  # 10 prompt tokens to compute: chunks of 4, 4, 2
    run(lane)
    assert [c for c in engine.calls if c[0] == "prefill"] == [("prefill", "a", 4), ("prefill", "a", 4),
                                                               ("prefill", "a", 2)]
    assert [c[0] for c in engine.calls].count("solo") == 3 and not any(c[0] == "join" for c in engine.calls)
    assert seq.generated == [12, 13, 14]


def test_a_batch_step_that_raises_fails_its_rows_and_starts_the_group_afresh():
    engine = FakeEngine(fail_step=True)
    lane = lane_with(engine)
    a, ea = submit(lane, "a", [1, 2, 3], 4)
    b, eb = submit(lane, "b", [7, 8, 9], 4)
    run(lane)
    for seq, events in ((a, ea), (b, eb)):
        assert isinstance(events[-1], Failed) and not any(isinstance(e, Finished) for e in events)
        assert seq.phase == Phase.FINISHED
    resets = [i for i, c in enumerate(engine.calls) if c[0] == "reset"]
    assert [engine.calls[i][1:] for i in resets] == [(GROUP, ("a", "b"))]
    abandons = [i for i, c in enumerate(engine.calls) if c[0] == "abandon"]
    assert {engine.calls[i][1] for i in abandons} == {"a", "b"}
    assert resets[0] < min(abandons)  # the batch went whole before its rows were abandoned
    assert lane.stats.requests_failed == 2


def test_a_cancelled_row_ends_with_what_it_computed_and_the_others_go_on():
    engine = FakeEngine()
    lane = lane_with(engine)
    a, ea = submit(lane, "a", [1, 2, 3], 30)
    b, eb = submit(lane, "b", [7, 8, 9], 6)
    for _ in range(4):
        lane.tick()
    assert a.phase == b.phase == Phase.BATCHED
    a.cancel.set()
    run(lane)
    assert ea[-1].finish_reason == "cancelled" and 0 < len(a.generated) < 30
    assert eb[-1].finish_reason == "length" and b.generated == [10, 11, 12, 13, 14, 15]
    assert ("end", ("a",)) in engine.calls


def test_rows_that_move_to_another_group_are_stepped_there_from_then_on():
    other = GroupKey("model", speculating=True)
    engine = FakeEngine(regroup_to=other)
    lane = lane_with(engine)
    a, _ = submit(lane, "a", [1, 2, 3], 6)
    b, _ = submit(lane, "b", [7, 8, 9], 6)
    run(lane)
    assert a.group == other and b.group == other
    steps = [c[1] for c in engine.calls if c[0] == "step"]
    assert steps[0] == GROUP and other in steps[1:]
    assert a.generated == [4, 5, 6, 7, 8, 9] and b.generated == [10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("verb", ["admit", "prefill"])
def test_a_verb_that_raises_fails_that_sequence_alone(verb):
    class Failing(FakeEngine):
        def admit(self, seq):
            if verb == "admit" and seq.id == "bad":
                raise RuntimeError("no")
            return super().admit(seq)

        def prefill(self, chunks, store_now):
            if verb == "prefill" and any(s.id == "bad" for s, _ in chunks):
                raise RuntimeError("no")
            return super().prefill(chunks, store_now)

    engine = Failing()
    lane = lane_with(engine)
    _, bad = submit(lane, "bad", [1, 2, 3], 3)
    good, eg = submit(lane, "good", [5, 6, 7], 3)
    run(lane)
    assert isinstance(bad[-1], Failed)
    assert eg[-1].finish_reason == "length" and good.generated == [8, 9, 10]


def test_a_sequence_whose_classification_raises_ends_with_an_error_not_a_wait():
    """Before, an exception in the engine's classify lost the arriving sequences (taken from the inbox, never queued):
    their requests waited forever."""
    engine = FakeEngine()
    engine.classify = lambda seq, company=False: (_ for _ in ()).throw(RuntimeError("classify broke"))
    lane = lane_with(engine)
    seq, events = submit(lane, "a", [1, 2, 3], 4)
    run(lane)
    assert isinstance(events[-1], Failed) and "classify broke" in str(events[-1].error)
    assert seq.phase == Phase.FINISHED and lane.idle()


def test_ticks_that_keep_failing_end_the_requests_in_the_lane_with_an_error():
    """The lane thread's last resort: a tick that raises every time (a bug in planning) would leave every request
    waiting forever; after a few in a row they end with ``Failed`` and the lane is empty again."""
    import threading

    engine = FakeEngine()
    lane = lane_with(engine)
    lane.scheduler.schedule = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planning broke"))
    ended = threading.Event()
    events = []

    def sink(event):
        events.append(event)
        if isinstance(event, (Failed, Finished)):
            ended.set()

    params = SamplingParams(max_tokens=4, temperature=0.0)
    seq = Sequence(prompt=[1, 2, 3], params=params, sink=sink, id="a", ns="ns")
    lane.start()
    try:
        lane.submit(seq)
        assert ended.wait(30), "the request was left waiting"
        assert isinstance(events[-1], Failed) and "planning broke" in str(events[-1].error)
    finally:
        lane.stop()
