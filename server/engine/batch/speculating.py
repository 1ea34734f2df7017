"""The ``speculating`` batch kind: every row drafts on its own, one forward verifies all rows' drafts together.

(About 420 lines, one job: a verify step over rows that each keep their own accepted prefix, and whether such steps
still pay. What has a life of its own lives beside it: the drafters' batched forwards (``drafts``, ``mtp_drafts``),
the verify inputs from read and unread drafts (``verify_inputs``), the KV layout (``ragged_kv``), the acceptance walk
(``spec.accept``) and the drafted token's price (``spec.adaptive.BatchVerifyCost``).)

Each step, row i asks its draft source (n-gram lookup over its own prompt + output, or the draft model: every
two-model row's drafts in the same batched forwards) for up to n_i tokens, n_i from
its own adaptive policy (``spec.adaptive``; a row whose drafts keep failing pauses, one whose drafts hit drafts
more) and capped by what is left of its ``max_tokens``. What "failing" means is measured on this batch
(``spec.adaptive.BatchVerifyCost``: the time a drafted token adds to the step, drafting included, against a row's
share of a plain step, with a plain step now and then to keep measuring), so on a machine where every extra token in the forward
costs (a CPU) rows draft only while their drafts are accepted often enough to pay. One forward over the batch feeds every row its pending
token and its drafts (W = 1 + the longest draft; shorter rows are right-padded, their padding is never kept). Each
row is then verified with its own sampler and logits rules and walked with ``spec.accept``, the walk the solo
verifier (``spec.verify``) uses: the token at every fed position is drawn from the target's (processed)
distribution given the accepted prefix, drafts are kept while they equal those tokens, and the first differing
token (or the one after the last draft) is the row's new pending token. Greedy rows therefore emit what greedy decoding emits; sampled rows follow the
target distribution exactly (for a deterministic draft, "draw and compare" is the standard acceptance rule:
the draft survives with probability p(draft), and a rejection yields a draw from p without it). Rows without
drafts decode one token in the same forward. The KV layout (``server.engine.batch.ragged_kv``) keeps each row's
accepted positions and drops the rest per row, with no copy.

A batch whose drafts stop paying for this layout says so (``paying`` False, from ``not_paying``) and the engine
dissolves it: its rows go on in their plain batch. "Paying" is measured where it can be: over its last
``JUDGE_STEPS`` steps the batch made fewer tokens per second than the plain batch makes with as many rows
(``PlainStepClock``, the plain batches' own steps on the lane's clock, given at ``make``); before any plain step of
that size was seen, fewer than ``PAYS_YIELD`` tokens per row per step. Each verify step is reported to ``on_verify``
(a ``VerifyStep``: /stats speculation.in_batch).

A ``Batch`` (server.engine.batch.protocol): ``step`` may yield several tokens per row (in row order, each row's in
sequence order; each row's drafts capped by what its own ``RowState`` says is left of its ``max_tokens``);
``remove`` hands back the row's caches and exactly the tokens they cover, cut back to what the request kept
(``kept``) when a stop ended it inside a step.

A row whose source reads the target's hidden states (the checkpoint's MTP heads: spec.mtp) hears the positions it
kept of each verify forward, its row of the forward's hidden states (``heard``), and drafts from them on its own.

Rows whose source is a ``spec.source.BatchableDraftSource`` (the draft model's) draft together
(``server.engine.batch.drafts``): while such a row is in the batch its draft caches live in the drafter's own ragged
layout, and a step's k drafted tokens cost k batched forwards of the draft model for all rows, not k per row
(``draft_batch=False``: each row drafts on its own caches, to compare).

Rows drafting with the checkpoint's MTP heads draft together too (``server.engine.batch.mtp_drafts``). Both
drafters' drafts enter the verify forward unread (``server.engine.batch.verify_inputs``): a step waits once, for
drafts and verdict together, so the device runs the drafts while the host builds the verify forward.

Not here: grammars (their processor is stateful and sees each token once: such requests do not speculate in a
batch), pipelining across steps (a step must know what was accepted before it can draft the next one).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Sequence

import mlx.core as mx

from server.engine.batch.drafts import DraftBatch
from server.engine.batch.mtp_drafts import MtpDraftBatch
from server.engine.batch.protocol import Covered, Emitted, Row, RowList, RowState
from server.engine.batch.ragged_kv import RaggedKV, holds_kv
from server.engine.batch.rules import Penalties, penalise, penalty_windows
from server.engine.batch.verify_inputs import UnreadDraft, draft_lengths, read_drafts, unread_arrays, verify_inputs
from server.engine.sampling import PENALTY_CONTEXT
from spec import BatchVerifyCost, SpecStats
from spec import verify as spec_verify
from spec.accept import accept

__all__ = ["SpeculatingBatch", "PlainStepClock", "VerifyStep"]


EXPLORE = 8  # of the steps whose drafts do not look worth it, one in this many drafts anyway (acceptance stays known)
# A speculating step costs more than a plain batch's: on the H200 1.4-2x without drafts and up to ~3x with 4 drafts per
# row at 32 rows (it waits for every step's tokens before it can draft the next, then verifies row by row;
# BENCHMARKS.md), about 1x on a 2-core CPU. So whether drafts pay is judged against the plain batch's measured step
# (``PlainStepClock``); PAYS_YIELD tokens per row per step is the rule only until a plain step of that size is seen.
JUDGE_STEPS = 32
PAYS_YIELD = 1.5


class PlainStepClock:
    """What a plain batch's step takes on the lane's clock, by row count: an exponential average per size (a
    pipelined batch's step is what the lane waits for, not the device's forward). ``seconds(rows)`` answers from
    the nearest size seen within a quarter of ``rows`` (a batched step's cost depends on its rows: on a GPU
    hardly, on a CPU nearly in proportion), else None."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self._by_rows: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        old = self._by_rows.get(rows)
        self._by_rows[rows] = seconds if old is None else old + self.weight * (seconds - old)

    def seconds(self, rows: float) -> Optional[float]:
        near = [n for n in self._by_rows if abs(n - rows) <= max(1.0, rows / 4)]
        if not near:
            return None
        return self._by_rows[min(near, key=lambda n: abs(n - rows))]


class VerifyStep(NamedTuple):
    """One verify step of a speculating batch (/stats speculation.in_batch)."""

    rows: int
    drafted: int
    accepted: int
    emitted: int


@dataclass
class _Row:
    state: RowState  # its key, limit and tokens generated (the batch's own account)
    tokens: list  # what the row's KV covers
    pending: int  # the next input (sampled, not yet fed)
    source: Any  # spec.ngram.NgramSource or spec.two_model.TwoModelSource
    policy: Any  # spec.adaptive.AdaptiveDraftLength
    max_draft: int
    sampler: Any = None  # None: greedy
    penalties: Optional[Penalties] = None  # bias and penalties (server.engine.batch.rules)
    stats: Optional[SpecStats] = None
    feed: list = field(default_factory=list)  # tokens the source has not heard of yet
    base_stop: Optional[float] = None  # the policy's own break-even (raised to the batch's measured one)

    @property
    def seq(self) -> Any:
        return self.state.key


class SpeculatingBatch(RowList):
    kind: ClassVar[str] = "speculating"

    def __init__(self, model, draft_batch: bool = True, plain_steps: Optional[PlainStepClock] = None,
                 on_verify: Optional[Callable[[VerifyStep], None]] = None):
        self.model = model
        self.plain_steps = plain_steps  # what the plain batch's steps take: what this one must beat (``paying``)
        self._on_verify = on_verify
        self._rows: list[_Row] = []
        self._kv: Optional[RaggedKV] = None
        self.steps = 0
        self.row_steps = 0
        self.drafted = 0
        self.accepted = 0
        self.last_step = VerifyStep(0, 0, 0, 0)  # the latest step (for /stats)
        self.cost = BatchVerifyCost()  # what a drafted token costs this batch: the rows' break-even acceptance
        self._skipped = 0  # steps whose drafts were not worth their positions
        self._recent: deque = deque(maxlen=JUDGE_STEPS)  # (rows, tokens emitted, seconds) of the latest steps
        # the draft model's or the MTP heads' caches and forwards, batched (one drafter per draft model or heads, made
        # when such a row joins; draft_batch False: each row drafts on its own caches, to compare)
        self._drafters: list[Any] = []
        self._batch_drafts = draft_batch

    @property
    def paying(self) -> bool:
        """Do its drafts still pay for this layout (against ``plain_steps``: see ``not_paying``)?"""
        return not self.not_paying(self.plain_steps)

    def not_paying(self, plain: Optional[PlainStepClock] = None) -> bool:
        """Over its last JUDGE_STEPS steps the batch made fewer tokens per second than ``plain`` says the plain batch
        makes with as many rows (a step per row per plain step); without such a measurement, fewer than PAYS_YIELD
        tokens per row per step. Either way its drafts do not pay for the speculating layout."""
        if len(self._recent) < JUDGE_STEPS:
            return False
        rows = sum(r for r, _, _ in self._recent)
        emitted = sum(e for _, e, _ in self._recent)
        plain_step = plain.seconds(rows / len(self._recent)) if plain is not None else None
        if plain_step is None:
            return emitted < PAYS_YIELD * rows
        seconds = sum(s for _, _, s in self._recent)
        steps = len(self._recent)
        return emitted * plain_step * steps < rows * seconds  # emitted / seconds < (rows / steps) / plain_step

    def kv_nbytes(self) -> int:
        """Bytes of the batch's KV buffers (the draft model's too), free slots and unused positions included."""
        return (self._kv.nbytes if self._kv is not None else 0) + sum(d.kv_nbytes for d in self._drafters)

    def accepts(self, row: Row) -> bool:
        """Rows that speculate, whose every layer is a plain KVCache and that have no grammar (its processor is
        stateful and sees each token once: a verify step samples several positions)."""
        return row.draft is not None and row.rules.grammar is None and holds_kv(row.caches)

    def add(self, rows: Sequence[Row]) -> None:
        """These rows join: their KV goes into free slots; each row's source hears its history."""
        if not rows:
            return
        for row in rows:
            if not self.accepts(row):
                raise ValueError("a speculating batch holds speculating rows of plain KVCache layers, no grammar")
        new = []
        for r in rows:
            d = r.draft
            d.source.prefill(list(r.history[:-1]))  # n-gram lookup over everything the row has seen
            new.append(_Row(r.state(), list(r.history[:-1]), int(r.history[-1]), d.source, d.policy, int(d.max_draft),
                            r.sampler, r.rules.penalties, d.stats, [int(r.history[-1])],
                            d.policy.stop_below))
        caches = [r.caches for r in rows]
        if self._kv is None:
            self._kv = RaggedKV.from_rows(caches)
        else:
            self._kv.extend(caches)
        self._rows.extend(new)
        self._join_drafter([r.source for r in new])

    def _join_drafter(self, sources: list) -> None:
        """Batchable sources draft together, one drafter per draft model (server.engine.batch.drafts) or per MTP heads
        (server.engine.batch.mtp_drafts): their caches move into it."""
        groups: dict[int, tuple[Any, Any, list]] = {}
        for s in sources if self._batch_drafts else ():
            if s.drafts_in_batch or (getattr(s, "hears_hidden", False) and MtpDraftBatch.takes(s)):
                kind, key = (DraftBatch, s.model) if s.drafts_in_batch else (MtpDraftBatch, s.head)
                groups.setdefault(id(key), (kind, key, []))[2].append(s)
        for kind, key, members in groups.values():
            drafter = next((d for d in self._drafters if d.key is key), None)
            if drafter is None:
                drafter = kind(key)
                self._drafters.append(drafter)
            drafter.join(members)

    def _drafter_of(self, source) -> Any:
        return next((d for d in self._drafters if source in d), None)

    def step(self) -> list[Emitted]:
        """One verify forward for every row: a row's tokens in order."""
        if not self._rows:
            return []
        t0 = time.perf_counter()
        if self.cost.probe():  # a plain step now and then: what a drafted token costs is measured against it
            drafts = self._drafts([0] * len(self._rows))  # (sources that hear the target are told their tokens)
        else:
            pays = self.cost.break_even()
            for r in self._rows:  # a row whose recent acceptance is below what a drafted token costs pauses
                if r.base_stop is not None:
                    r.policy.stop_below = max(r.base_stop, pays)
            wanted = [self._wanted(r) for r in self._rows]
            if any(wanted) and not self._worth_drafting(wanted, pays):
                wanted = [0] * len(wanted)
            top = max(wanted)  # every row computes this many positions anyway: a drafting row may fill them
            drafts = self._drafts([min(top, self._left(r)) if n else 0 for r, n in zip(self._rows, wanted)])
        lengths = draft_lengths(drafts)
        width = 1 + max(lengths)
        inputs = verify_inputs([r.pending for r in self._rows], drafts, width)
        self._kv.reserve(width)
        logits = self.model(inputs, cache=self._kv.layers)  # (B, W, V)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token_rows, lp_rows = self._sample(logits, logprobs, drafts, lengths)
        mx.eval(token_rows, lp_rows, unread_arrays(drafts))  # the step's one wait: verdict and unread drafts
        drafts = read_drafts(drafts)
        picked = [t.tolist() for t in token_rows]
        self.cost.observe(len(self._rows), len(self._rows) * (width - 1), time.perf_counter() - t0)
        rows_out: list[Emitted] = []
        kept: list[int] = []
        batched_commits: dict[int, tuple[Any, list]] = {}  # id(drafter) -> (drafter, [(source, drafts, accepted)])
        heard: list[tuple[Any, int, list[int], int]] = []  # sources that read the target's hidden states (spec.mtp)
        for i, (row, d) in enumerate(zip(self._rows, drafts)):
            tokens = picked[i]
            a = accept(d, tokens)
            emitted = d[:a] + [tokens[a]]
            kept.append(1 + a)  # the pending token and the accepted drafts are now in the KV
            if getattr(row.source, "hears_hidden", False):
                heard.append((row.source, len(row.tokens), [row.pending] + d[:a], i))
            row.tokens.append(row.pending)
            row.tokens.extend(d[:a])
            row.pending = tokens[a]
            if d:
                drafter = self._drafter_of(row.source)
                if drafter is not None:
                    batched_commits.setdefault(id(drafter), (drafter, []))[1].append((row.source, d, a))
                else:
                    row.source.commit(d, a)
                row.policy.update(len(d), a)
                self.drafted += len(d)
                self.accepted += a
                if row.stats is not None:
                    row.stats.rounds += 1
                    row.stats.drafted += len(d)
                    row.stats.accepted += a
            if row.stats is not None:
                row.stats.emitted += len(emitted)
            row.state.generated += len(emitted)
            row.feed.append(row.pending)
            rows_out.extend(Emitted(row.seq, t, lp_rows[i][j]) for j, t in enumerate(emitted))
        for drafter, done in batched_commits.values():
            drafter.commit(done)
        for source, start, fed, i in heard:  # after their commits; the forward above is still the tap's latest
            source.heard(start, fed, row=i)
        self._kv.commit(kept)
        self.steps += 1
        self.row_steps += len(self._rows)
        self.last_step = VerifyStep(len(self._rows), sum(len(d) for d in drafts), sum(k - 1 for k in kept),
                                    len(rows_out))
        self._recent.append((len(self._rows), len(rows_out), time.perf_counter() - t0))
        if self._on_verify is not None:
            self._on_verify(self.last_step)
        return rows_out

    def remove(self, seqs: Sequence, kept: Optional[Sequence[int]] = None) -> list[Covered]:
        """Take these rows out, in the order given. The caches cover exactly the tokens: what the row fed, cut back
        to its prompt and the tokens its request kept (``kept``) when a stop ended it inside a step."""
        if not seqs:
            return []
        kv = self._kv
        if kv is None:
            raise KeyError("not rows of this batch: it is empty")
        index = {id(r.seq): i for i, r in enumerate(self._rows)}
        for drafter in self._drafters:  # draft caches back to their sources first: prefill() below uses them
            drafter.leave([s for s in (self._rows[index[id(q)]].source for q in seqs) if s in drafter])
        out = []
        for n, seq in enumerate(seqs):
            i = index[id(seq)]
            row = self._rows[i]
            caches = kv.extract(i)
            keep = min(len(row.tokens), row.state.covered(None if kept is None else kept[n]))
            cut = len(row.tokens) - keep
            if cut:
                for c in caches:
                    c.trim(cut)
            row.source.prefill(row.tokens[:keep])  # the source hears what it has not yet (a solo decoder goes on)
            out.append(Covered(row.tokens[:keep], caches))
        order = kv.release([index[id(s)] for s in seqs])  # the last rows fill the holes; no other row moves
        self._rows = [self._rows[i] for i in order]
        if not self._rows:
            self._kv = None
            self._drafters = []
        return out

    # -- parts of a step ---------------------------------------------------------------------------
    def _worth_drafting(self, wanted: list, pays: float) -> bool:
        """Every row computes the longest draft's positions, so drafting pays for the batch only when the rows' recent
        acceptance, averaged over all rows (a row not drafting counts 0), beats the measured break-even. Every
        ``EXPLORE``-th step that is not drafts anyway, so the rows' acceptance stays measured."""
        expected = sum(r.policy.recent_rate for r, n in zip(self._rows, wanted) if n) / len(wanted)
        if expected >= pays:
            return True
        self._skipped += 1
        return self._skipped % EXPLORE == 0

    @staticmethod
    def _left(row: _Row) -> int:
        return row.state.left() - 1  # a step emits one token beyond its drafts

    def _wanted(self, row: _Row) -> int:
        """The row's draft length this step by its policy (asked once per step: a pause counts down there)."""
        return max(0, min(row.policy.next_length(), row.max_draft, self._left(row)))

    def _drafts(self, ns: list) -> list:
        """Each row's draft of up to ns[i] tokens: the two-model rows' in batched forwards of the draft model (every
        such row hears its feed, drafting or not), the MTP rows' in batched forwards of the heads, the others from
        their own source. Batched drafts come unread (an ``UnreadDraft``: read with the verdict) unless a row's
        penalties need the drafted tokens to build the verify step, or READ_DRAFTS_WITH_VERDICT is off."""
        drafts: list = [[] for _ in self._rows]
        batched: set[int] = set()
        lazy = spec_verify.READ_DRAFTS_WITH_VERDICT and all(r.penalties is None for r in self._rows)
        for drafter in self._drafters:
            together = [i for i, r in enumerate(self._rows) if r.source in drafter]
            if together:
                asked = [(self._rows[i].source, self._rows[i].feed, ns[i]) for i in together]
                if lazy:
                    open_ = drafter.draft_lazy(asked)
                    for j, i in enumerate(together):
                        drafts[i] = UnreadDraft(open_, j)
                else:
                    for i, d in zip(together, drafter.draft(asked)):
                        drafts[i] = d
                for i in together:
                    self._rows[i].feed = []
                batched.update(together)
        for i, (row, n) in enumerate(zip(self._rows, ns)):
            if i not in batched:
                drafts[i] = self._draft(row, n)
        return drafts

    @staticmethod
    def _draft(row: _Row, n: int) -> list:
        """Up to ``n`` drafts of the row's own source; a source that hears the target's hidden states is told the row's
        tokens every step, drafting or not (spec.source.HearingDraftSource)."""
        if n <= 0 and not getattr(row.source, "hears_hidden", False):
            return []
        drafts = [int(t) for t in row.source.draft(row.feed, max(0, n))][:max(0, n)]
        row.feed = []
        return drafts

    def _sample(self, logits: mx.array, logprobs: mx.array, drafts: list, lengths: list):
        """(tokens, logprobs) per row at each fed position: its sampler over its ruled logprobs. The rules of every
        (row, position) with any go in one ``penalise`` call, each position seeing the row's history, its pending
        token and the drafts before it."""
        B, W, _ = logits.shape
        greedy_plain = [i for i, r in enumerate(self._rows) if r.sampler is None and r.penalties is None]
        per_row: list = [None] * B
        lp_rows: list = [logprobs[i] for i in range(B)]
        if greedy_plain:
            best = mx.argmax(logprobs, axis=-1)  # (B, W): one op for every greedy row
            for i in greedy_plain:
                per_row[i] = best[i]
        ruled = [i for i, r in enumerate(self._rows) if r.penalties is not None]
        if ruled:
            at, rules, seen = [], [], []
            for i in ruled:  # (their drafts are read: _drafts opens none beside penalties)
                row = self._rows[i]
                head = row.tokens[-PENALTY_CONTEXT:] + [row.pending]
                for q in range(len(drafts[i]) + 1):
                    at.append((i, q))
                    rules.append(row.penalties)
                    seen.append(head + drafts[i][:q])
            windows = penalty_windows(seen) if any(r.needs_history for r in rules) else None
            x = penalise(logits[mx.array([i for i, _ in at]), mx.array([q for _, q in at])], rules, windows)
            x = x - mx.logsumexp(x, axis=-1, keepdims=True)
            start = 0
            for i in ruled:
                n = len(drafts[i]) + 1
                lp_rows[i] = x[start: start + n]
                start += n
        for i, row in enumerate(self._rows):
            if per_row[i] is None:
                lp = lp_rows[i] if row.penalties is not None else logprobs[i, : lengths[i] + 1]
                per_row[i] = row.sampler(lp) if row.sampler is not None else mx.argmax(lp, axis=-1)
        return per_row, lp_rows
