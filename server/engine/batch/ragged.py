"""The ``ragged`` batch kind: the plain decode batch on the ragged layout: a row joins without a forward of its own and leaves without moving
the others.

mlx-lm's ``GenerationBatch`` (``server.engine.batch.mlx.MlxBatch``) admits rows through a batch of their own, whose
constructor runs a forward, then ``extend`` concatenates every layer's KV of the running rows with the new ones'
(and ``BatchKVCache`` left-pads everyone to the longest row); a leave ``filter``s, copying every row that stays.
With agents' long conversations that is the KV of the whole batch copied on every join and every leave, and one
extra forward per join on the lane's clock (issue 22's profile: a join cost 1.7-2.4x a step on the H200, 2x on the
CPU).

Here the rows live in a ``server.engine.batch.ragged_store.RaggedStore`` (``RaggedKV``; a hybrid's recurrent states
beside it in ``HybridRagged``): each row left-aligned in a slot of preallocated
buffers (slots grown by half again, positions by a quarter again), writing at its own end, so rows of different
lengths need no padding. A join writes the row's KV into a free slot; its next input (the last prompt token, or the
last generated token of a row that migrates from solo decoding) rides the batch's next forward, which returns its
first token. A leave copies the leaving row out (the prefix cache keeps it) and moves the last row into the hole.

A step is what ``GenerationBatch._step`` computes, in its order (so the tokens are the same for the same logits):
one forward, the rows' logits rules (bias, penalties over each row's own token history, grammar masks: in a few
operations for all rows that have them, ``server.engine.batch.rules``), log-softmax, one sampler call for the batch
when every row shares one (greedy, or requests with the same unseeded settings), otherwise one per sampler
(``server.engine.sampling.sample_rows``).

``pipelined`` (the GPU's choice, off on the CPU): a step launches its forward and returns the tokens the previous
forward sampled, so the lane's Python (building the next graph, streaming, scheduling) runs while the device
computes, as ``GenerationBatch`` does. A step in which rows joined waits for its own forward and returns the joiners'
first tokens at once (a pipelined joiner would otherwise get its first token a whole tick later, after another
prompt's prefill chunk: on the CPU that cost 3 s of mean TTFT under 8 agents); their second token then comes one step
later than the others', and from there they are pipelined like every row. Not pipelined, every step returns the
tokens its own forward sampled; on the CPU the Python a pipeline would hide is a few ms of a ~150 ms step. Either
way ``remove`` hands back caches that cover exactly the tokens it says (a row's history and every token fed so far:
all it returned, or all but the last).

A ``Batch`` (server.engine.batch.protocol). Only plain ``KVCache`` layers (``RaggedKV``; a hit's
``SharedPrefixKVCache`` layers are read where they lie); other models get the ``mlx`` kind
(server.engine.batch.choose). Only the lane thread touches a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from server.engine.batch.protocol import Covered, Emitted, Row, RowList
from server.engine.batch.ragged_kv import holds_kv
from server.engine.batch.ragged_states import is_state
from server.engine.batch.ragged_store import RaggedStore, store_for
from server.engine.batch.rules import LogitsRules, apply_rules
from server.engine.sampling import sample_rows

__all__ = ["RaggedBatch"]


_FRESH, _SENT, _OWED = "fresh", "sent", "owed"  # a row's next input: its history's last token / a token already
# returned / a token sampled but not yet returned (pipelined: returned by the next step, with ``_Row.logprobs``)


@dataclass
class _Row:
    seq: Any
    tokens: list  # what the row's KV covers once the forward in flight (if any) is done
    sampler: Any = None  # None: greedy
    rules: LogitsRules = LogitsRules()
    state: str = _FRESH
    logprobs: Any = field(default=None, repr=False)  # of the owed token


_greedy = greedy_sampler  # mlx-lm's, the very object a temperature-0 request's sampler is: such rows share one call


class RaggedBatch(RowList):
    kind: ClassVar[str] = "ragged"

    def __init__(self, model, pipelined: bool = False):
        self.model = model
        self.pipelined = pipelined
        self._rows: list[_Row] = []
        self._kv: Optional[RaggedStore] = None
        self._hybrid = False  # its store holds recurrent states beside the KV (every row has the same layers)
        self._next: Optional[mx.array] = None  # (rows,) each row's next input; lazy while a forward is in flight
        self.steps = 0
        self.row_steps = 0

    def kv_nbytes(self) -> int:
        """Bytes of the batch's KV buffers, free slots and unused positions included."""
        return self._kv.nbytes if self._kv is not None else 0

    @property
    def paying(self) -> bool:
        return True

    def accepts(self, row: Row) -> bool:
        """Rows that do not speculate, whose layers are plain KVCache layers (``RaggedKV``) and, for a hybrid model,
        recurrent-state layers (``HybridRagged``); all rows of one batch have the same layers."""
        if row.draft is not None or not row.caches:
            return False
        kv = [c for c in row.caches if not is_state(c)]
        if not kv or not holds_kv(kv):
            return False
        hybrid = len(kv) < len(row.caches)
        return self._kv is None or self._hybrid == hybrid

    def add(self, rows: Sequence[Row]) -> None:
        """These rows join: their KV goes into free slots (no forward, no copy of the running rows); their last
        history token is their next input."""
        if not rows:
            return
        for row in rows:
            if not self.accepts(row):
                raise ValueError("a ragged batch holds rows of plain KVCache layers that do not speculate")
        caches = [r.caches for r in rows]
        if self._kv is None:
            self._kv = store_for(caches)
            self._hybrid = any(is_state(c) for c in caches[0])
        else:
            self._kv.extend(caches)
        for r in rows:
            self._rows.append(_Row(r.seq, list(r.history[:-1]), r.sampler, r.rules))
        fresh = mx.array([int(r.history[-1]) for r in rows], dtype=mx.uint32)
        self._next = fresh if self._next is None else mx.concatenate([self._next, fresh])

    def step(self) -> list[Emitted]:
        """One decode step for every row, in row order, at most one token per row
        (pipelined, a row that returned its first token in the step it joined returns none in the next)."""
        kv, inputs = self._kv, self._next
        if not self._rows or kv is None or inputs is None:
            return []
        kv.reserve(1)
        logits = self.model(inputs[:, None], cache=kv.layers)[:, -1, :]
        kv.commit([1] * len(self._rows))
        ruled = [e for e, r in enumerate(self._rows) if not r.rules.empty]
        if ruled:  # each row's history so far is its tokens; its newest token is this step's input
            rows = [self._rows[e] for e in ruled]
            logits = apply_rules(logits, ruled, [r.rules.penalties for r in rows], [r.rules.grammar for r in rows],
                                 [r.tokens for r in rows], inputs, inputs.tolist)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = sample_rows(logprobs, [r.sampler or _greedy for r in self._rows])
        self._next = sampled.astype(mx.uint32)
        per_row = list(logprobs)
        wait = not self.pipelined or any(r.state == _FRESH for r in self._rows)
        if wait:
            mx.eval(self._next, per_row)
        else:
            mx.async_eval(self._next, per_row)  # the device computes while the lane goes on
        fed = inputs.tolist()  # computed by the previous step's forward (or given at the join)
        new = self._next.tolist() if wait else None
        out = []
        for e, (row, token) in enumerate(zip(self._rows, fed)):
            row.tokens.append(token)
            if row.state == _OWED:
                out.append(Emitted(row.seq, token, row.logprobs))
            if wait and row.state != _OWED:
                out.append(Emitted(row.seq, new[e], per_row[e]))
                row.state, row.logprobs = _SENT, None
            else:
                row.state, row.logprobs = _OWED, per_row[e]
        self.steps += 1
        self.row_steps += len(self._rows)
        return out

    def remove(self, seqs: Sequence, kept: Optional[Sequence[int]] = None) -> list[Covered]:
        """Take these rows out, in the order given: each row's own caches and exactly the tokens they cover: its
        history and every token fed so far (not pipelined: all it returned but the last, its next input; pipelined:
        all it returned, or all but the last if it returned that one early). ``kept`` changes nothing: a row makes
        one token per step, and a stop ends it before the next."""
        kv, nxt = self._kv, self._next
        if not seqs:
            return []
        if kv is None or nxt is None:
            raise KeyError("not rows of this batch: it is empty")
        index = {id(r.seq): i for i, r in enumerate(self._rows)}
        idx = [index[id(seq)] for seq in seqs]
        mx.eval(nxt)  # a forward in flight writes every row's KV: let it finish before copying
        out = [Covered(list(self._rows[i].tokens), kv.extract(i)) for i in idx]
        order = kv.release(idx)  # the last rows fill the holes; no other row moves
        self._rows = [self._rows[i] for i in order]
        if self._rows:
            self._next = nxt[mx.array(order, dtype=mx.int32)]
        else:
            self._kv, self._next = None, None
        return out
