"""The tick plan: a frozen record of everything one lane tick does, decided before any of it runs.

The scheduler (server.lane.scheduler) makes a ``TickPlan`` from the queue and the running sequences; the lane
(server.lane.lane) executes it through the engine (server.lane.seam), in this order, and writes what each step
returns into the sequences' own state (phase, tokens, covered):

    end_waiting  sequences cancelled while still queued: ended without touching the model
    make_room    bytes the RAM prefix cache yields first, so that the admissions fit the memory budget
    admit        queued sequences that join, FIFO (their prefix-cache take)
    cancel       running sequences whose client went away: what they computed is stored, then they end
    anchor       new anchors (sequence, prompt position): where a prefix another sequence waits for ends
    prefill      groups of chunks, in order, each of which completes its sequences' prefills (they are READY and
                 decode in this tick's step); a group of several is one batched forward. Before its group each sequence takes
                 again from the prefix cache (a prompt just computed may cover more of it); a chunk is never more
                 than planned, less when the cache now covers more
    store_now    those prefills store their prompt in the cache as soon as it is computed (requests wait, or
                 several prefill together: they may share it)
    start        sequences that begin decoding (their prefill completes in ``prefill``, or completed before):
                 per group, the ones that join the group's batch (with the solo ones migrating into it), and
                 the ones that decode on their own. A planned start whose prefill did not complete waits
    leave        a batch's last row goes on decoding solo (a batch of one is slower than the solo path)
    decode       the groups whose batch steps once (one batched forward each)
    solo         the solo sequences that step once, in this order
    prefill_late the other prefill groups, after the decode step (as ``prefill``; their sequences start next tick)
    task         one lane task (embeddings, loading an adapter) runs this tick
    waiting_io   (not an action) queued sequences passed over because their prefix is still being read

A sequence that finishes while the plan runs (EOS, a stop string, max_tokens) leaves its batch and ends at once;
the next plan no longer sees it. A model of several processes broadcasts each plan from rank 0 (``encode``) and
every other rank runs the same plan on its own sequences (``decode``; server.lane.replay).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import orjson

from server.lane.seam import GroupKey
from server.lane.sequence import Sequence

__all__ = ["Chunk", "Start", "TickPlan"]


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    tokens: int  # prompt tokens to compute (0: the prompt is covered already; only its prefill completes)


@dataclass(frozen=True)
class Start:
    group: Any  # the batch group (server.lane.seam.GroupKey)
    batch: tuple[Sequence, ...] = ()  # join the group's batch in one step: migrating solo ones first
    solo: tuple[Sequence, ...] = ()  # decode on their own


@dataclass(frozen=True)
class TickPlan:
    end_waiting: tuple[Sequence, ...] = ()
    make_room: int = 0
    admit: tuple[Sequence, ...] = ()
    cancel: tuple[Sequence, ...] = ()
    anchor: tuple[tuple[Sequence, int], ...] = ()
    prefill: tuple[tuple[Chunk, ...], ...] = ()
    prefill_late: tuple[tuple[Chunk, ...], ...] = ()
    store_now: bool = False
    start: tuple[Start, ...] = ()
    leave: tuple[Sequence, ...] = ()
    decode: tuple[Any, ...] = ()
    solo: tuple[Sequence, ...] = ()
    task: bool = False
    waiting_io: tuple[Sequence, ...] = ()  # queued ones whose prefix is being read from SSD: they keep their place

    @property
    def model_work(self) -> bool:
        """Does the plan touch the model (or a sequence)? A plan of nothing but a task does not."""
        return bool(self.end_waiting or self.admit or self.cancel or self.anchor or self.prefill or self.start
                    or self.prefill_late
                    or self.leave or self.decode or self.solo)

    @property
    def empty(self) -> bool:
        return not (self.model_work or self.task or self.make_room)

    # -- one plan for every rank of a sharded model (server.lane.replay) -----------------------------------------
    def encode(self, spec_of: Callable[[Sequence], dict], check: Optional[dict] = None) -> bytes:
        """The plan with every sequence as its id, admissions as full specs (``spec_of``: what a follower needs to
        rebuild the sequence) and ``check``: rank 0's generated-token count of each running sequence."""
        ids = lambda seqs: [s.id for s in seqs]  # noqa: E731
        return orjson.dumps({
            "end_waiting": [spec_of(s) for s in self.end_waiting], "make_room": self.make_room,
            "admit": [spec_of(s) for s in self.admit], "cancel": ids(self.cancel),
            "anchor": [[s.id, pos] for s, pos in self.anchor],
            "prefill": [[[c.seq.id, c.tokens] for c in group] for group in self.prefill], "store_now": self.store_now,
            "prefill_late": [[[c.seq.id, c.tokens] for c in group] for group in self.prefill_late],
            "start": [[_wire(s.group), ids(s.batch), ids(s.solo)] for s in self.start], "leave": ids(self.leave),
            "decode": [_wire(g) for g in self.decode], "solo": ids(self.solo), "check": check or {},
        })

    @classmethod
    def decode_from(cls, data, running: dict, make: Callable[[dict], Sequence]) -> tuple["TickPlan", dict]:
        """The plan ``encode`` wrote (bytes, or already parsed), on another rank: ``running`` maps ids to that rank's
        own sequences, ``make`` rebuilds a sequence from its spec. Returns the plan and rank 0's ``check``."""
        d = orjson.loads(data) if isinstance(data, (bytes, bytearray, memoryview, str)) else data
        admitted = [make(spec) for spec in d["admit"]]
        known = {**running, **{s.id: s for s in admitted}}
        seqs = lambda ids: tuple(known[i] for i in ids if i in known)  # noqa: E731
        chunks = lambda groups: tuple(tuple(Chunk(known[i], n) for i, n in g if i in known)  # noqa: E731
                                      for g in groups)
        plan = cls(
            end_waiting=tuple(make(spec) for spec in d["end_waiting"]), make_room=d["make_room"],
            admit=tuple(admitted), cancel=seqs(d["cancel"]),
            anchor=tuple((known[i], pos) for i, pos in d.get("anchor", ()) if i in known),
            prefill=chunks(d["prefill"]), prefill_late=chunks(d.get("prefill_late", ())),
            store_now=d["store_now"],
            start=tuple(Start(_unwire(group), seqs(batch), seqs(solo)) for group, batch, solo in d["start"]),
            leave=seqs(d["leave"]), decode=tuple(_unwire(g) for g in d["decode"]), solo=seqs(d["solo"]),
        )
        return plan, d["check"]

    def replace(self, **changes) -> "TickPlan":
        return dataclasses.replace(self, **changes)


def _wire(group):
    return group.wire() if isinstance(group, GroupKey) else group


def _unwire(value):
    return GroupKey.from_wire(value) if isinstance(value, list) else value
