"""The draft model's forwards batched over a speculating batch's rows: k forwards per step for all rows, not k per row.

A speculating row whose source is a ``spec.source.BatchableDraftSource`` (the draft model's
``spec.two_model.TwoModelSource``) used to run that model on
its own caches, one row after another. While the row is in the batch its draft caches live here instead, in one
``RaggedKV`` (each row left-aligned, writing at its own end, rewound per row with no copy), and ``draft`` computes
every drafting row's next tokens together:

    forward 1   every row feeds what its draft caches have not seen yet (its pending token, and after a fully
                accepted round the last draft too: 1 or 2 tokens, right-padded); each row's first draft is the
                argmax at its last real position
    forward j   every row still drafting feeds its draft j-1 (width 1); draft j is its argmax

so a row drafting n tokens has fed ``unfed + d1..d(n-1)``, exactly as ``TwoModelSource.draft`` does, and
``commit([(source, drafted, accepted), ...])`` keeps the same bookkeeping (the ``n-1-a`` fed-but-rejected positions are dropped:
the row's length goes back; after a full accept ``d_n`` is remembered as unfed). Rows that draft less than the
longest draft this step stop feeding (their positions past what they keep are overwritten later). The whole chain
is one lazy MLX graph evaluated once: forward j's input is forward j-1's argmax, with no round trip to Python.
``draft_lazy`` hands it over unread (``OpenDrafts``): the speculating batch reads it with its verdict.

``join`` takes a source's caches in (the source keeps its token bookkeeping; its caches are the batch's until
``leave`` hands them back as plain ``KVCache`` layers, so the source can go on alone or be stored). Greedy drafts,
as the solo source's: what is accepted is decided by the target's verify walk, whatever the request's sampler.
Only the lane thread touches a DraftBatch.
"""

from __future__ import annotations

import mlx.core as mx

from server.engine.batch.draft_rows import DraftRows, OpenDrafts

__all__ = ["DraftBatch"]


class DraftBatch(DraftRows):
    def __init__(self, model):
        super().__init__(model)

    @property
    def model(self):
        return self._key

    def join(self, sources: list) -> None:
        """These sources' caches move in (each source must have no draft open: ``draft`` then ``commit`` pairs)."""
        if any(s.model is not self.model for s in sources):
            raise ValueError("a DraftBatch drafts with one model: this source has another")
        self._lend(sources)

    def leave(self, sources: list) -> None:
        """These sources get their caches back (covering exactly their ``tokens``) and leave the batch."""
        self._give_back(sources)

    def draft(self, wanted: list) -> list[list[int]]:
        """``[(source, feed, n), ...]`` (every row of the batch, any order): each source hears ``feed`` (the tokens
        its sequence took since its last draft) and drafts up to ``n`` tokens; returns the drafts in the order
        given. A source with nothing unfed or ``n`` <= 0 drafts nothing (but keeps the feed for later)."""
        return self.draft_lazy(wanted).read()

    def draft_lazy(self, wanted: list) -> OpenDrafts:
        """``draft``'s chain, asked for and not read (``OpenDrafts``; its lengths are known now)."""
        index = {id(s): i for i, s in enumerate(self._sources)}
        rows = len(self._sources)
        n_of = [0] * rows
        unfed: list[list[int]] = [[] for _ in range(rows)]  # per batch row: tokens to draft, tokens to feed first
        for source, feed, n in wanted:
            heard, i = source.queue_feed(feed), index[id(source)]
            if heard and n > 0:
                n_of[i], unfed[i] = int(n), heard
        top = max(n_of, default=0)
        if top <= 0:
            return self._opened(wanted, n_of, None)
        width = max(len(u) for u in unfed)
        first = mx.array([u + [u[-1] if u else 0] * (width - len(u)) for u in unfed], dtype=mx.uint32)
        last = mx.array([max(0, len(u) - 1) for u in unfed], dtype=mx.int32)
        ys = []
        inputs = first
        for j in range(top):
            w = inputs.shape[1]
            self._kv.reserve(w)
            logits = self.model(inputs, cache=self._kv.layers)  # (rows, w, V)
            pick = logits[mx.arange(rows), last] if j == 0 else logits[:, 0, :]  # (rows, V): each row's last fed
            y = mx.argmax(pick, axis=-1).astype(mx.uint32)
            ys.append(y)
            # what each row keeps of what it just fed: its unfed tokens, then one draft per forward while it drafts
            self._kv.commit([len(unfed[i]) if j == 0 else int(j < n_of[i]) for i in range(rows)])
            inputs = y[:, None]
            if j + 1 < top:
                mx.async_eval(inputs)
            self.forwards += 1
        chain = mx.stack(ys, axis=1)  # (rows, top): read once, by whoever reads it first
        return self._opened(wanted, n_of, chain)

    def commit(self, done: list) -> None:
        """``[(source, drafted, accepted), ...]`` after the target's verify: each row drops its fed-but-rejected
        draft positions (``n-1-a``), or after a full accept remembers ``d_n`` as not yet fed (TwoModelSource's
        rule: ``record_verdict``)."""
        index = {id(s): i for i, s in enumerate(self._sources)}
        back = [0] * len(self._sources)
        for source, drafted, accepted in done:
            back[index[id(source)]] = source.record_verdict(drafted, accepted)
        if any(back):
            self._kv.rewind(back)
