"""The prefix cache as the generation lane and the HTTP layer see it: one declared set of verbs.

Four implementations, each complete (no caller probes with ``getattr``):

    NullPromptCache     caching off (``--cache-bytes 0``): never hits, stores nothing  (cache.prompt_cache)
    PromptCache         the RAM tier                                                   (cache.prompt_cache)
    TieredCache         the RAM tier over the SSD tier, write-behind, read-ahead        (cache.tiered)
    ShardedPromptCache  one rank's tiers of a model split over processes, every take agreed by all ranks
                                                                                        (cache.sharded)

Threads: ``take``, ``put``, ``peek``, ``ready``, ``make_room`` and ``observe_prefill`` are called by the lane
thread; ``prefetch`` by the event loop after tokenizing; ``clear`` and ``stats`` by either. Each implementation
says how it is thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol, runtime_checkable

__all__ = ["PrefixCache"]


@runtime_checkable
class PrefixCache(Protocol):
    def take(self, tokens: Sequence[int], ns: str, session: Optional[str] = None) -> Any:
        """The longest usable cached prefix (``cache.prompt_cache.CacheHit``: the caller owns its caches), or None."""

    def put(self, tokens: Sequence[int], caches: list, ns: str, session: Optional[str] = None, *,
            anchor: bool = False) -> bool:
        """Store ``caches`` (covering exactly ``tokens``); the caller keeps its own objects. ``anchor``: a prefix kept
        on purpose (never superseded by longer entries, evicted last). True when the cache took it."""

    def peek(self, tokens: Sequence[int], ns: str, session: Optional[str] = None, *, local: bool = False) -> int:
        """The prefix length ``take`` would give from RAM now (0: none); touches no counter and no LRU time.
        ``local``: this process's own answer, never agreed with other ranks of a sharded model (an estimate)."""

    def ready(self, tokens: Sequence[int], ns: str, session: Optional[str] = None) -> bool:
        """False while this prompt's prefix is still being read from a slower tier (index-only, never blocks)."""

    def prefetch(self, tokens: Sequence[int], ns: str, session: Optional[str] = None) -> bool:
        """Start reading a longer prefix from a slower tier now; True when a read for it is in flight."""

    def make_room(self, nbytes: int) -> int:
        """Shrink the RAM tier by ``nbytes`` (evicted entries spill to a lower tier); returns the bytes freed."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The lane computed ``tokens`` prompt tokens in ``seconds`` (feeds the restore-or-recompute decision)."""

    def clear(self) -> int:
        """Drop the RAM tier's entries (a lower tier keeps its files); returns how many were dropped."""

    def stats(self) -> dict[str, Any]:
        """The RAM tier's counters (the ``prompt_cache`` block of /stats)."""
