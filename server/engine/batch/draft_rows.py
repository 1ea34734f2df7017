"""The rows of a batched drafter (``DraftBatch``: a draft model; ``MtpDraftBatch``: the checkpoint's MTP heads):
each row's draft caches lent into one ``RaggedKV`` while the row is in the speculating batch, handed back when it
leaves; and the drafts both hand over unread (``OpenDrafts``: the speculating batch reads them with its verdict).
Only the bookkeeping both share; each drafter's forwards are its own. Only the lane thread touches one.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from server.engine.batch.ragged_kv import RaggedKV

__all__ = ["DraftRows", "OpenDrafts"]


class OpenDrafts:
    """A batched draft asked for but not read: ``array`` (the drafter's rows, its longest draft) uint32, None when no
    row drafts; ``lengths``: each wanted row's draft length (known before the read); ``rows``: its row in ``array``.
    ``read()`` reads the drafts once, tells each drafting source what it drafted (``record_draft``) and returns them
    in the wanted order. Until then the sources' drafts are open: read before their ``commit``."""

    def __init__(self, array: Any, rows: list[int], lengths: list[int], sources: list):
        self.array, self.rows, self.lengths, self._sources = array, rows, lengths, sources
        self._read: Any = None

    def read(self) -> list[list[int]]:
        if self._read is None:
            got: Any = self.array.tolist() if self.array is not None else []
            self._read = [[int(t) for t in got[r][:n]] if n else [] for r, n in zip(self.rows, self.lengths)]
            for source, d in zip(self._sources, self._read):
                if d:
                    source.record_draft(d)
        return self._read


class DraftRows:
    def __init__(self, key: Any):
        self._key = key
        self._sources: list = []  # per live row of the RaggedKV, in its row order
        self._kv: Optional[RaggedKV] = None
        self.forwards = 0  # batched draft forwards run (tests and bench/draft_batch.py read it)

    @property
    def key(self) -> Any:
        """What it drafts with (a speculating batch keeps one drafter per key)."""
        return self._key

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, source) -> bool:
        return any(s is source for s in self._sources)

    @property
    def kv_nbytes(self) -> int:
        return self._kv.nbytes if self._kv is not None else 0

    def _opened(self, wanted: list, n_of: list[int], chain: Any) -> OpenDrafts:
        """The drafts of ``wanted`` (``[(source, feed, n), ...]``), row i drafting ``n_of[i]`` tokens of ``chain``
        (rows x longest draft; None when no row drafts), asked for and handed over unread."""
        index = {id(s): i for i, s in enumerate(self._sources)}
        rows = [index[id(source)] for source, _, _ in wanted]
        if chain is not None:
            mx.async_eval(chain)
        return OpenDrafts(chain, rows, [n_of[i] for i in rows], [source for source, _, _ in wanted])

    def _lend(self, sources: list) -> None:
        """These sources' caches move in (``lend_caches``: the batch's until ``_give_back``)."""
        if not sources:
            return
        rows = [s.lend_caches() for s in sources]
        if self._kv is None:
            self._kv = RaggedKV.from_rows(rows)
        else:
            self._kv.extend(rows)
        self._sources.extend(sources)

    def _give_back(self, sources: list) -> None:
        """These sources take their caches back (``take_back``) and leave; the last rows fill the holes."""
        index = {id(s): i for i, s in enumerate(self._sources)}
        rows = [index[id(s)] for s in sources]
        assert self._kv is not None
        for s, i in zip(sources, rows):
            s.take_back(self._kv.extract(i))
        order = self._kv.release(rows)
        self._sources = [self._sources[i] for i in order]
        if not self._sources:
            self._kv = None
