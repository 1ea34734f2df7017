"""Rank 0 leads the lane, the other ranks replay it: the tick plans of a model sharded over processes.

A sharded model's forward is a collective: every rank must run the same model calls, on the same shapes, in the
same order, or the group deadlocks or computes garbage. Only rank 0 sees the HTTP side, so only rank 0 schedules:
at the start of every tick in which it does model work it broadcasts the ``TickPlan`` (server.lane.plan, every
sequence by id, admissions as full specs: prompt, session, sampling parameters, the grammar's source text) and every
follower executes the very same plan (``Lane.execute``) on its own sequences.

What the plan leaves to execution is the same on every rank: the sharded forward ends with the same logits on every
rank (an all-reduce), sampling is seeded the same on every rank (``Group.same_seed`` for unseeded requests, the
request's seed otherwise), grammars are compiled from the same text, and prefix-cache hits are agreed by all ranks
(cache.sharded). Cancellations are part of the plan (the scheduler ends a cancelled sequence at the start of a tick,
never in the middle of one), so a client that disconnects mid-tick changes nothing until every rank knows of it. The
plan also carries each running sequence's generated-token count, which followers check: a divergence is logged as
an error, never silent. Each follower computes its own cache namespace (its shard's fingerprint) for the sequences
it rebuilds.

A stop message ends the followers (rank 0's lane stopped: shutdown); they flush their SSD tier and exit. A rest
message, which rank 0 sends when its lane goes idle, sends them to wait on its doorbell (server.engine.doorbell)
instead of in the next broadcast, whose wait polls a core on MLX's ring backend; rank 0 rings before the broadcast
that follows.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import orjson

from server.lane.events import SamplingParams
from server.lane.plan import TickPlan
from server.lane.sequence import Sequence

log = logging.getLogger("mlx_lane.replay")

_STOP = orjson.dumps({"stop": True})
_REST = orjson.dumps({"rest": True})


def seq_spec(seq: Sequence) -> dict:
    """What a follower needs to rebuild ``seq`` (no sink: a follower's events go nowhere)."""
    params = dataclasses.asdict(dataclasses.replace(seq.params, grammar=None))
    if params.get("logit_bias"):
        params["logit_bias"] = [[int(k), float(v)] for k, v in params["logit_bias"].items()]
    params["stop"] = list(params["stop"])
    grammar = seq.params.grammar.grammar if seq.params.grammar is not None else None
    return {"id": seq.id, "prompt": list(seq.prompt), "session": seq.session, "params": params,
            "grammar": grammar, "cancelled": seq.cancelled, "anchors": list(seq.anchors),
            "checkpoints": list(seq.checkpoints)}


def seq_from_spec(spec: dict, compile_grammar=None, engine=None) -> Sequence:
    """The follower's own sequence for a spec (its target, namespace and facts from its own ``engine``, when given:
    a sharded server serves its base model alone).
    ``compile_grammar(text)``: the grammar spec of a grammar's source text (server.core.grammar.GrammarSpec.compile
    with this rank's tokenizer; the lane does not import the core, so the process wiring hands it in)."""
    params = dict(spec["params"])
    params.pop("grammar", None)
    if params.get("logit_bias"):
        params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"]}
    params["stop"] = tuple(params["stop"])
    grammar = None
    if spec.get("grammar") is not None:
        if compile_grammar is None:
            raise ValueError("a sequence with a grammar needs compile_grammar to rebuild it")
        grammar = compile_grammar(spec["grammar"])
    sampling = SamplingParams(**params, grammar=grammar)
    target = engine.base_target() if engine is not None else None
    seq = Sequence(prompt=list(spec["prompt"]), params=sampling, sink=_discard, session=spec.get("session"),
                   id=spec["id"], target=target, ns=engine.namespace_for(target, sampling) if engine is not None else "",
                   anchors=tuple(spec.get("anchors") or ()), checkpoints=tuple(spec.get("checkpoints") or ()))
    if engine is not None:
        seq.facts = engine.classify(seq)
    if spec.get("cancelled"):
        seq.cancel.set()
    return seq


def _discard(event) -> None:
    pass


class Leader:
    """Rank 0's side: broadcasts each tick's plan before the lane executes it."""

    def __init__(self, group):
        self.group = group
        self.doorbell = None  # server.engine.doorbell.Doorbell, where the group has one (open)
        self.resting = False  # the followers wait on the doorbell

    def open(self) -> None:
        """Every rank at the same point of its start (collectives): the doorbell, where the group can have one."""
        self.doorbell = self.group.open_doorbell()

    def lead(self, plan: TickPlan, running: list) -> None:
        check = {s.id: len(s.generated) for s in running}
        self._wake()
        self.group.share_bytes(plan.encode(seq_spec, check))

    def rest(self) -> None:
        """The lane is idle: the followers wait on the doorbell until the next broadcast (no-op without one)."""
        if self.doorbell is not None and not self.resting:
            self.group.share_bytes(_REST)
            self.resting = True

    def stop(self) -> None:
        """Tell the followers the lane stopped (they flush their SSD tier and exit)."""
        self._wake()
        self.group.share_bytes(_STOP)
        if self.doorbell is not None:
            self.doorbell.close()

    def _wake(self) -> None:
        if self.resting:
            self.doorbell.ring()
            self.resting = False

    def describe(self) -> dict:
        """For /stats: how idle followers wait (``doorbell``: blocked, no CPU; ``polling``: MLX's own wait)."""
        return {"idle_followers": "doorbell" if self.doorbell is not None else "polling"}


class Follower:
    """A follower's side: receives each plan and executes it on its own lane."""

    def __init__(self, group, compile_grammar=None):
        self.group = group
        self.compile_grammar = compile_grammar  # see seq_from_spec
        self.diverged = 0
        self.doorbell = None

    def open(self) -> None:
        """See ``Leader.open``."""
        self.doorbell = self.group.open_doorbell()

    def follow(self, lane) -> None:
        """Execute plans on ``lane`` until a stop message (lane thread)."""
        while True:
            message = orjson.loads(self.group.share_bytes(None))
            if message.get("rest"):
                self.doorbell.wait()  # rank 0 is idle: blocked here, not polling in the next broadcast
                continue
            if message.get("stop"):
                log.info("rank 0 stopped; rank %d stops", self.group.rank)
                if self.doorbell is not None:
                    self.doorbell.close()
                return
            running = {s.id: s for s in lane.running()}
            plan, check = TickPlan.decode_from(message, running, lambda spec: seq_from_spec(
                spec, self.compile_grammar, lane.engine))
            self._check(check, running)
            for seq in plan.cancel:
                seq.cancel.set()
            lane.execute(plan)

    def _check(self, check: dict, running: dict) -> None:
        for seq_id, n in check.items():
            seq = running.get(seq_id)
            mine: Optional[int] = len(seq.generated) if seq is not None else None
            if mine != n:
                self.diverged += 1
                log.error("rank %d diverged from rank 0 on sequence %s: %s generated tokens here, %d on rank 0",
                          self.group.rank, seq_id, mine, n)
