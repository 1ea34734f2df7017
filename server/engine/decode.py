"""Decoding: every sequence past its prefill is a row of a ``Batch`` (server.engine.batch): its group's batch, or a
solo batch of its own; every batch is built by ``server.engine.batch.choose.make``.

- ``join(group, seqs)``: ready sequences, or solo ones migrating in, join their group's batch in one step. A row's
  caches must cover its history but its next input; a solo decoder that fed one token ahead (mlx-lm's pipelining)
  hands back one more, trimmed here (``_entry``). A sequence that speculated alone only for want of company
  (``SeqFacts.yields``: its model's caches cannot speculate in a batch) joins its plain group's batch drafting no more;
  ``join`` returns the new facts of such rows.
- ``go_solo(seq)``: a batch row goes on in a solo batch of its own (a batch of one is slower than the solo path).
- ``step(group)`` / ``step_solo(seq)``: one forward; a batch that no longer pays for its kind (a speculating one
  whose drafts stopped paying) first hands its rows to their plain group (``BatchStep.regrouped`` tells the lane their
  new group).
- ``leave(seqs)``: rows out of wherever they decode, each with the tokens its caches cover (``Covered``), told how
  many tokens the lane kept of what it generated.

A sequence is read only through the seam's ``SeqView``, at the verbs: its prompt and the tokens it kept make a row's
history at a join, and what it kept at a leave. Lane thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

from mlx_lm.models.cache import trim_prompt_cache

from models.facts import CacheFacts
from server.engine.batch import (Batch, BatchGroups, Covered, Emitted, GroupKey, Layout, Row, RowDraft, choose, make,
                                 make_solo)
from server.engine.batch.speculating import PlainStepClock, VerifyStep
from server.engine.speculation import Speculation
from server.engine.work import SeqWork
from server.lane.seam import BatchStep, SeqFacts, SeqView

__all__ = ["Decoder"]

log = logging.getLogger("mlx_lane.engine")


class Decoder:
    def __init__(self, work_of: Callable[[SeqView], SeqWork], layout: Layout, *, stats: Any,
                 speculation: Optional[Speculation], stream_of: Callable[[], Any],
                 facts_of: Callable[[SeqView, GroupKey], SeqFacts]):
        self._work_of = work_of
        self.layout = layout
        self._stats = stats
        self._speculation = speculation
        self._stream = stream_of
        self._facts_of = facts_of  # the facts of a sequence moved to another group
        self.groups = BatchGroups(self._make)
        self.plain_steps = PlainStepClock()  # the plain batches' steps: what a speculating batch must beat
        self._made_of: dict[GroupKey, tuple[Any, CacheFacts]] = {}  # group -> (the weights it computes with, their
        # cache facts)

    def _make(self, group: GroupKey) -> Batch:
        model, caches = self._made_of[group]
        return make(choose(self.layout, caches, group.speculating), model, self.layout, self._stream(), caches,
                    plain_steps=self.plain_steps, on_verify=self._on_verify)

    def _on_verify(self, step: VerifyStep) -> None:
        if self._stats.spec is not None:
            self._stats.spec.on_batch_step(*step)

    # -- joins and leaves ----------------------------------------------------------------------------------------
    def join(self, group: GroupKey, seqs: Sequence[SeqView]) -> tuple[tuple[SeqView, SeqFacts], ...]:
        """These sequences join ``group``'s batch; the new facts of those that drafted and no longer do (a plain
        group's batch: rows that speculated alone, ``SeqFacts.yields``)."""
        rows = [self._row(seq, draft=group.speculating) for seq in seqs]
        first = self._work_of(seqs[0])  # one group, one model: the base's, one adapter's or an on-demand one's
        self._made_of[group] = (first.model, first.slot.facts.caches)
        self.groups.join(group, rows)
        for seq in seqs:
            self._work_of(seq).batched = True
        stopped = [seq for seq in seqs if seq.facts.drafting and not group.speculating]
        if stopped and self._stats.spec is not None:
            self._stats.spec.on_yielded(len(stopped))
        return tuple((seq, self._facts_of(seq, group)) for seq in stopped)

    def go_solo(self, seq: SeqView) -> None:
        work = self._work_of(seq)
        (covered,) = self.groups.remove(_group(seq), [seq], [len(seq.generated)])
        work.batched = False
        work.caches = covered.caches
        self._open_solo(seq, work, covered)

    def leave(self, seqs: Sequence[SeqView]) -> list[Optional[Covered]]:
        """Take these sequences out of wherever they decode (their group's batch: one removal per group); None for
        one that does not decode (its caches, if any, stay its own)."""
        out: dict[int, Optional[Covered]] = {}
        by_group: dict[GroupKey, list[SeqView]] = {}
        for seq in seqs:
            work = self._work_of(seq)
            if work.batched:
                by_group.setdefault(_group(seq), []).append(seq)
            elif work.solo is not None:
                (out[id(seq)],) = work.solo.remove([seq], [len(seq.generated)])
                work.solo = None
            else:
                out[id(seq)] = None
        for group, members in by_group.items():
            kept = [len(s.generated) for s in members]
            for seq, covered in zip(members, self.groups.remove(group, members, kept)):
                self._work_of(seq).batched = False
                out[id(seq)] = covered
        return [out[id(s)] for s in seqs]

    def _row(self, seq: SeqView, draft: bool = True) -> Row:
        """The row a sequence joins a batch as: fresh from prefill, or migrating from solo decoding."""
        work = self._work_of(seq)
        history = list(seq.prompt) + list(seq.generated)
        if work.solo is not None:
            (covered,) = work.solo.hand_over([seq])  # the next input unfed where the solo decoder allows
            work.solo = None
            caches = self._entry(covered, history)
        else:
            assert work.caches is not None, "a sequence joins with its own caches or from its solo batch"
            caches = work.caches
        work.caches = None
        return self._as_row(seq, work, caches, history, self._draft(work) if draft else None)

    @staticmethod
    def _as_row(seq: SeqView, work: SeqWork, caches: list, history: list[int], draft: Optional[RowDraft]) -> Row:
        return Row(seq, caches, history, work.rules, work.row_sampler, draft,
                   max_tokens=seq.params.max_tokens, generated=len(seq.generated))

    @staticmethod
    def _entry(covered: Covered, history: list) -> list:
        """``covered``'s caches trimmed to cover ``history[:-1]`` (the next input is ``history[-1]``): a pipelined
        decoder or a plain batch fed its last token already."""
        extra = len(covered.tokens) - (len(history) - 1)
        if extra > 0:
            trim_prompt_cache(covered.caches, extra)
        return covered.caches

    def _draft(self, work: SeqWork) -> Optional[RowDraft]:
        plan = work.spec
        if plan is None or self._speculation is None:
            return None
        if plan.policy is None:
            plan.policy = self._speculation.policy(plan.num_draft_tokens, work.slot.facts)
        return RowDraft(plan.source, plan.policy, plan.num_draft_tokens, plan.stats)

    def _open_solo(self, seq: SeqView, work: SeqWork, covered: Optional[Covered]) -> None:
        history = list(seq.prompt) + list(seq.generated)
        caches = self._entry(covered, history) if covered is not None else work.caches
        assert caches is not None, "a sequence decodes on its own caches"
        work.caches = None
        solo = make_solo(work.model, self.layout, self._stream(), work.slot.facts.caches)
        solo.add([self._as_row(seq, work, caches, history, self._draft(work))])
        work.solo = solo

    # -- steps ---------------------------------------------------------------------------------------------------
    def step(self, group: GroupKey) -> BatchStep:
        regrouped = self._dissolve_if_not_paying(group)
        if regrouped is not None:  # its rows decode in their plain batch from now on
            return BatchStep((), regrouped)
        if group.speculating:
            return BatchStep(self.groups.step(group))
        n, t0 = self.groups.rows(group), time.perf_counter()
        out = self.groups.step(group)
        self.plain_steps.observe(n, time.perf_counter() - t0)
        return BatchStep(out)

    def step_solo(self, seq: SeqView) -> Optional[Emitted]:
        work = self._work_of(seq)
        if work.solo is None:  # its first step: the caches cover the prompt but its last token
            self._open_solo(seq, work, None)
        assert work.solo is not None
        out = work.solo.step()
        return out[0] if out else None

    def _dissolve_if_not_paying(self, group: GroupKey) -> Optional[tuple[tuple[SeqView, SeqFacts], ...]]:
        """A batch that no longer pays for its kind (``Batch.paying``: a speculating batch whose drafts have not paid
        for its layout lately) hands its rows to their group's plain batch, where they decode without drafts for the
        rest of their reply (requests that arrive later speculate again, in a new speculating batch). Before a step:
        every row in it is live, and kept every token it emitted. Returns the rows' new facts, or None when the batch
        goes on."""
        batch = self.groups.get(group)
        if batch is None or batch.paying:
            return None
        seqs: list[SeqView] = list(batch.sequences)
        plain = group.plain()
        self._made_of[plain] = self._made_of[group]
        rows = []
        for seq, covered in zip(seqs, self.groups.remove(group, seqs, [len(s.generated) for s in seqs])):
            work = self._work_of(seq)
            work.batched = False
            history = list(seq.prompt) + list(seq.generated)
            rows.append(self._as_row(seq, work, self._entry(covered, history), history, None))
        self.groups.join(plain, rows)
        for seq in seqs:
            self._work_of(seq).batched = True
        if self._stats.spec is not None:
            self._stats.spec.on_dissolved(len(seqs))
        log.info("a speculating batch of %d rows made too few tokens per step to pay for drafting; its rows decode "
                 "in the plain batch", len(seqs))
        return tuple((seq, self._facts_of(seq, plain)) for seq in seqs)

    # -- what they hold ------------------------------------------------------------------------------------------
    def rows(self) -> int:
        return self.groups.size()

    def kv_nbytes(self) -> int:
        return self.groups.kv_nbytes()

    def reset(self, group: GroupKey) -> None:
        self.groups.reset(group)

    def describe(self) -> list[dict]:
        """Each group's batch for /stats: its kind, rows and steps."""
        return [{"model": g.model, "adapter": g.adapter[:16] if g.adapter else None,
                 "speculating": g.speculating, "kind": b.kind, "rows": len(b), "steps": b.steps,
                 "row_steps": b.row_steps} for g, b in self.groups.items()]


def _group(seq: SeqView) -> GroupKey:
    group = seq.group
    if group is None:
        raise ValueError(f"sequence {seq.id} decodes in no group: the engine's classify gives every sequence one")
    return group
