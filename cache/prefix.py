"""The one prefix rule of every cache tier: which entry may serve a prompt, and which entry makes another redundant.

An entry is KV that covers exactly its tokens, under one namespace (the identity of what computed it: see
``namespace``). Its ``trimmable`` (a *reach*) says to which fewer tokens it can be cut back: ``True``, any (every
layer's cache is trimmable: mlx-lm's ``is_trimmable()``); ``False``, none (a sliding-window cache that wrapped, or a
recurrent layer's state); or a tuple of positions, exactly those (an untrimmable entry that carries checkpoints of
its untrimmable layers' state at those positions: cache.checkpoints). The RAM tier
(cache.prompt_cache), the SSD store (cache.ssd_store) and the write-behind (cache.durability) decide with these
functions only, so the tiers can never disagree about what a file or an entry is good for.

``usable(entry, trimmable, prompt) -> Usable | None``
    p = min(common prefix, len(prompt) - 1): at least one prompt token is always forwarded (it yields the first
    output token). An entry longer than p must be trimmed back to p, so it qualifies only when it is trimmable; an
    untrimmable entry matches only when all its tokens are a prefix of the prompt and at most len(prompt) - 1 long;
    an entry with checkpoints serves the greatest of its positions up to p (the longest reuse before the prompt
    parts from it: a turn whose template re-renders the previous reply still reuses the history before it).
    p == 0 is no match. Ranking (``Usable.rank``, larger is better): the longest p, then the smaller trim, then the
    more recently used (the caller's clock: the RAM tier's LRU time, a file's mtime).

``supersedes(new, new_trimmable, old, old_anchor=False, old_trimmable=True) -> bool``
    Within one namespace, ``old`` is redundant once ``new`` is stored: the same tokens, or a strict prefix of them
    when ``new`` can be cut back to ``old``'s length (trimmable, or a checkpoint there: it can then serve every
    prompt ``old`` could), and to each of ``old``'s own checkpoints (else a prompt that parted from ``old`` at one
    of them would lose its reuse). An untrimmable entry without that checkpoint never supersedes its ancestors: a
    prompt-boundary snapshot of a sliding-window model must survive the longer entry.
    Nor is an anchor ever superseded by a longer entry: an anchor is a prefix kept on purpose (a client's cache
    breakpoint, a shared system prompt), so that it outlives the per-conversation entries that extend it.
    ``covers(entry, trimmable, tokens)`` is the same question asked the other way round: can ``entry`` serve all of
    ``tokens``?

Token sequences are numpy int64 arrays (one vectorized pass per comparison); ``ids()`` makes one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

Reach = Union[bool, tuple]  # True: any position; False: none below its end; a tuple: exactly those positions

__all__ = ["Reach", "Usable", "ids", "common_prefix", "is_prefix", "usable", "best_match", "supersedes",
           "covers", "namespace"]


def ids(tokens: Sequence[int]) -> np.ndarray:
    """``tokens`` as a read-only int64 vector (a copy: a caller's array must not alias an entry's tokens)."""
    out = np.array(tokens, dtype=np.int64).reshape(-1)
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class Usable:
    """How an entry serves a prompt: ``length`` prompt tokens, after trimming ``trim`` of the entry's own."""

    length: int
    trim: int

    def rank(self, recency: float = 0.0) -> tuple[int, int, float]:
        """Sort key, larger is better: the longest prefix, then the smaller trim, then the more recent entry."""
        return (self.length, -self.trim, recency)


def common_prefix(a: Sequence[int], b: Sequence[int], cap: Optional[int] = None) -> int:
    """Length of the longest common prefix of two token sequences, at most ``cap``: numpy vectors are compared in one
    vector operation, lists by a binary search over C-speed slice compares (prompts are thousands of tokens and the
    lane's scheduler asks every tick)."""
    n = min(len(a), len(b))
    if cap is not None:
        n = min(n, max(0, cap))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
        return int(diff[0]) if diff.size else n
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = list(a[:n]), list(b[:n])
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
    """``short`` is a prefix of ``long`` (equal counts)."""
    return len(short) <= len(long) and bool(np.array_equal(long[: len(short)], short))


def usable(entry: np.ndarray, trimmable: Reach, prompt: np.ndarray) -> Optional[Usable]:
    """How ``entry`` can serve ``prompt`` (see the module docstring), or None."""
    cap = len(prompt) - 1
    n = len(entry)
    if cap <= 0 or n == 0:
        return None
    common = common_prefix(entry, prompt)
    if n <= cap and common == n:
        return Usable(n, 0)
    if not trimmable:
        return None  # it would need a trim it cannot take
    p = min(common, cap)
    if trimmable is not True:  # checkpoints: the greatest position it can be cut back to, within p
        p = max((q for q in trimmable if q <= p), default=0)
    return Usable(p, n - p) if p > 0 else None


def best_match(prompt: np.ndarray, candidates: Iterable[tuple[Any, np.ndarray, Reach, float]]
               ) -> Optional[tuple[Any, Usable]]:
    """The candidate that serves ``prompt`` best, by ``Usable.rank``: ``candidates`` are (entry, tokens, trimmable,
    recency) of one namespace. Entries that cannot beat the best so far (shorter than its length) are not
    compared at all."""
    best, best_use, best_rank = None, None, None
    cap = len(prompt) - 1
    for entry, tokens, trimmable, recency in candidates:
        if best_use is not None and min(len(tokens), cap) < best_use.length:
            continue
        use = usable(tokens, trimmable, prompt)
        if use is None:
            continue
        rank = use.rank(recency)
        if best_rank is None or rank > best_rank:
            best, best_use, best_rank = entry, use, rank
    return (best, best_use) if best is not None else None


def supersedes(new: np.ndarray, new_trimmable: Reach, old: np.ndarray, old_anchor: bool = False,
               old_trimmable: Reach = True) -> bool:
    """Is ``old`` redundant once ``new`` is stored (same namespace)? See the module docstring."""
    if len(old) > len(new) or (len(old) < len(new) and (not reaches(new_trimmable, len(old)) or old_anchor)):
        return False
    if isinstance(old_trimmable, tuple) and not all(reaches(new_trimmable, p) for p in old_trimmable):
        return False
    return bool(np.array_equal(new[: len(old)], old))


def reaches(trimmable: Reach, position: int) -> bool:
    """Can an entry of this reach be cut back to exactly ``position`` tokens?"""
    return trimmable is True or (isinstance(trimmable, tuple) and position in trimmable)


def covers(entry: np.ndarray, trimmable: Reach, tokens: np.ndarray) -> bool:
    """Can ``entry`` serve all of ``tokens``: the same tokens, or a trimmable extension of them?"""
    return supersedes(entry, trimmable, tokens)


def namespace(fingerprint: str, *, kv_scheme: Optional[str] = None, adapter: Optional[str] = None,
              draft: Optional[str] = None) -> str:
    """The cache namespace of KV computed by a model, composed in one place (KV of one namespace never seeds another).

    ``fingerprint``: the model's weights, config and dtype (models.loading.fingerprint; a shard's own when the model is split
    over processes). ``kv_scheme``: a quantized KV layout (e.g. "q8g64"; None or "float" for the model's dtype).
    ``adapter``: a LoRA adapter's identity (its weights' hash). ``draft``: the speculative draft's identity when the
    entry also holds the draft's layers. The digests are the ones files on SSD were written under: changing them
    orphans every cached file.
    """
    ns = fingerprint
    if kv_scheme not in (None, "float"):
        ns = hashlib.sha256(f"{ns}\0kv\0{kv_scheme}".encode()).hexdigest()
    if adapter:
        ns = hashlib.sha256(f"{ns}\0adapter\0{adapter}".encode()).hexdigest()
    if draft:
        ns = f"{ns}|{draft}"
    return ns
