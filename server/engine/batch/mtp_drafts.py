"""The MTP heads' forwards batched over a speculating batch's rows: k forwards per step for all rows, not k per row.

A speculating row whose source is the checkpoint's MTP heads (spec.mtp.MtpSource) drafts from entries the heads keep
in a KV cache of their own. Drafting on its own, each row runs one forward for the entries its last verify step
brought (1 + what was accepted) and then one per further draft, and waits for its tokens: with 16 rows, 16 chains
and 16 waits a step. While the row is in the batch its heads' KV caches live here instead, in one ``RaggedKV`` (each
row left-aligned, writing at its own end, rewound per row with no copy), and ``draft`` computes every row's drafts
together:

    forward 1   every drafting row feeds the entries it has to compute (its tokens since its last draft, with the
                target's hidden states before them: right-padded); its first draft is the argmax at its last one
    forward j   every row still drafting feeds its draft j-1, with the heads' own output as the hidden state

so a row's drafts are the ones its own caches would give (spec.mtp: ``draft``), and the source keeps the bookkeeping
(``plan``, ``entries_input``, ``record_draft``, ``commit``): what it takes back is dropped from its row
(``take_drop``) before the next forward. The hidden states stay with each source (it hears its row of every verify
forward). The whole chain is one lazy MLX graph evaluated once. A source whose heads hold no entry yet drafts on its
own. Only the lane thread touches an MtpDraftBatch.

``draft_lazy`` hands the chain over unread (``OpenDrafts``: asked for with ``mx.async_eval``): the speculating batch
builds its verify forward over it and reads drafts and verdict in one wait (spec.verify.READ_DRAFTS_WITH_VERDICT),
so the device runs the heads while the host builds the verify graph; ``draft`` reads at once.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from server.engine.batch.draft_rows import DraftRows, OpenDrafts

__all__ = ["MtpDraftBatch"]


class MtpDraftBatch(DraftRows):
    def __init__(self, head):
        super().__init__(head)

    @property
    def head(self):
        return self._key

    @staticmethod
    def takes(source) -> bool:
        """Can its heads' caches join (they hold entries: a ragged layout starts from a row with KV)?"""
        kv = source.caches[:-1]
        return bool(kv) and kv[0].keys is not None and int(kv[0].offset) > 0

    def join(self, sources: list) -> None:
        """These sources' heads' KV caches move in (each source must have no draft open)."""
        self._lend([s for s in sources if s.head is self.head and self.takes(s)])

    def leave(self, sources: list) -> None:
        """These sources get their heads' caches back (covering exactly their entries) and leave the batch."""
        self._apply_drops()
        self._give_back(sources)

    def draft(self, wanted: list) -> list[list[int]]:
        """``[(source, feed, n), ...]`` (every row of the batch, any order): each source takes ``feed`` and drafts up
        to ``n`` tokens (none while it is behind); returns the drafts in the order given."""
        return self.draft_lazy(wanted).read()

    def draft_lazy(self, wanted: list) -> OpenDrafts:
        """``draft``'s chain, asked for and not read (``OpenDrafts``; its lengths are known now)."""
        index = {id(s): i for i, s in enumerate(self._sources)}
        rows = len(self._sources)
        n_of = [0] * rows
        inputs: list = [None] * rows
        for source, feed, n in wanted:
            i = index[id(source)]
            if source.plan(feed, n):
                n_of[i] = int(n)
        self._apply_drops()  # plan() may take back the last entry, to compute it again
        for i, s in enumerate(self._sources):
            if n_of[i]:
                inputs[i] = s.entries_input()
        top = max(n_of, default=0)
        if top <= 0:
            return self._opened(wanted, n_of, None)
        kv = self._kv
        assert kv is not None
        width = max(len(x[0]) for x in inputs if x is not None)
        dim = next(x[1] for x in inputs if x is not None).shape[-1]
        tokens, hidden, last, kept = [], [], [], []
        for x in inputs:
            ids, prev = x if x is not None else ([0], mx.zeros((1, dim)))
            pad = width - len(ids)
            tokens.append(list(ids) + [ids[-1]] * pad)
            hidden.append(mx.concatenate([prev, mx.zeros((pad, dim), prev.dtype)]) if pad else prev)
            last.append(len(ids) - 1)
            kept.append(len(ids) if x is not None else 0)
        dtype = next(x[1] for x in inputs if x is not None).dtype
        h = mx.stack([x.astype(dtype) for x in hidden])  # (rows, width, H)
        ys = []
        inputs_j = mx.array(tokens, dtype=mx.uint32)
        for j in range(top):
            w = inputs_j.shape[1]
            kv.reserve(w)
            out = self.head.forward(inputs_j, h, kv.layers, self._mask(w))  # (rows, w, H)
            g = out[mx.arange(rows), mx.array(last)][:, None, :] if j == 0 else out
            y = mx.argmax(self.head.logits(g), axis=-1).astype(mx.uint32)  # (rows, 1)
            ys.append(y)
            kv.commit(kept if j == 0 else [int(j < n) for n in n_of])
            inputs_j, h = y, g
            if j + 1 < top:
                mx.async_eval(inputs_j, h)
            self.forwards += 1
        chain = mx.concatenate(ys, axis=1)  # (rows, top): read once, by whoever reads it first
        return self._opened(wanted, n_of, chain)

    def commit(self, done: list) -> None:
        """``[(source, drafted, accepted), ...]`` after the target's verify: each row drops the entries past what was
        accepted (the source's ``commit``)."""
        for source, drafted, accepted in done:
            source.commit(drafted, accepted)
        self._apply_drops()

    def _apply_drops(self) -> None:
        drops = [s.take_drop() for s in self._sources]
        if self._kv is not None and any(drops):
            self._kv.rewind(drops)

    def _mask(self, width: int) -> mx.array:
        """The ragged layout's mask (each row its own columns, causal) without column 0 for every query but one at
        column 0: the entry at a source's origin has no hidden state before it (spec.mtp.entry_mask)."""
        kv = self._kv
        assert kv is not None
        base = kv.mask(width)  # (rows, 1, width, end)
        end = base.shape[-1]
        q = mx.array(kv.lengths, dtype=mx.int32)[:, None] + mx.arange(width)[None, :]  # (rows, width)
        first = (mx.arange(end)[None, None, :] > 0) | (q[:, :, None] == 0)
        return base & first[:, None]
