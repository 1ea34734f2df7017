"""Prompt lookup: propose what followed the latest earlier occurrence of the last k tokens.

Agents repeat code, file contents and tool output, so the continuation of an earlier match
of the sequence's tail is often exactly what the target will write. No second model, no KV.

The index maps every k-gram (k = min_ngram..max_ngram) to the end of its latest occurrence
that is followed by at least one token, and is updated incrementally as tokens arrive, so a
lookup costs O(max_ngram) whatever the length of the sequence. The tail k-gram itself is
never in the index (nothing follows it yet), so a hit is always an *earlier* occurrence.
The longest k with a hit wins. A continuation that runs into the tail is extended
periodically (the match at distance d predicts a repetition with period d).
"""

from __future__ import annotations

from typing import Optional, Sequence

from spec.source import DraftProvider

__all__ = ["NgramProvider", "NgramSource"]


class NgramSource:
    drafts_in_batch = False  # a lookup: nothing to batch

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tokens: Sequence[int] = ()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._seq: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self._open: Optional[list[int]] = None
        self._extend(tokens)

    @property
    def caches(self) -> None:
        return None

    @property
    def tokens(self) -> list[int]:
        return list(self._seq)

    def prefill(self, ids: Sequence[int]) -> None:
        ids = list(ids)
        if ids[: len(self._seq)] != self._seq:  # not an extension: rebuild the index
            self._seq, self._index = [], {}
        self._extend(ids[len(self._seq) :])
        self._open = None

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        if self._open is not None:
            raise RuntimeError("draft() called twice without commit()")
        self._extend(feed)
        out = self.lookup(n)
        if out:
            self._open = out
        return out

    def commit(self, drafted: Sequence[int], accepted: int) -> None:
        if list(drafted) != (self._open or []):
            raise RuntimeError("commit() of tokens this source did not draft")
        if not 0 <= accepted <= len(drafted):
            raise ValueError(f"accepted={accepted} outside 0..{len(drafted)}")
        self._open = None
        self._extend(drafted[:accepted])

    def lookup(self, n: int) -> list[int]:
        """Up to ``n`` tokens continuing the latest earlier match of the tail (no side effects)."""
        seq = self._seq
        if n <= 0:
            return []
        for k in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            end = self._index.get(tuple(seq[len(seq) - k :]))
            if end is None:
                continue
            out: list[int] = []
            for j in range(n):
                i = end + j
                out.append(seq[i] if i < len(seq) else out[i - len(seq)])
            return out
        return []

    def _extend(self, tokens: Sequence[int]) -> None:
        seq, index = self._seq, self._index
        for t in tokens:
            i = len(seq)  # the new token's position: every k-gram ending here gains a follower
            for k in range(self.min_ngram, self.max_ngram + 1):
                if k > i:
                    break
                index[tuple(seq[i - k : i])] = i
            seq.append(int(t))


class NgramProvider(DraftProvider):
    """Prompt-lookup drafts. Stateless: no identity in the cache namespace, no caches."""

    kind = "ngram"
    identity = None
    cost_ratio = 0.0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        NgramSource(max_ngram, min_ngram)  # validate once, at start-up
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def policy(self, max_len: int):
        """Adaptive length that pauses (not stops) when lookups stop paying: copying comes and goes."""
        from spec.adaptive import AdaptiveDraftLength, break_even_rate

        return AdaptiveDraftLength(max_len, stop_below=break_even_rate(0.0), pause=16)

    def open(self, caches: Optional[list] = None, tokens: Sequence[int] = ()) -> NgramSource:
        return NgramSource(self.max_ngram, self.min_ngram, tokens)
