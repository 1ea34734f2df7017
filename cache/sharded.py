"""The prefix cache of one rank of a sharded model: this rank's own tiers, with every take agreed by all ranks.

Each rank keeps (RAM) and persists (SSD) only its own shard of each entry: its KV heads (tensor-parallel) or its
layers (pipeline). Every rank puts the same tokens at the same point of the same tick (they run the same lane
steps), so an entry exists once per rank, under that rank's namespace: the rank's shard fingerprint
(``server.engine.distributed.Group.shard_fingerprint``, a digest of the model's fingerprint, the split and the rank);
on SSD, ``<cache_dir>/<shard fingerprint>/...``, and every file's header names it, so a file of one rank can never
seed another rank, another split or a single process.

A cache hit is usable only when EVERY rank holds its shard of that prefix: a ``take`` is a small agreement on the
lane thread (same order on every rank):
  1. rank 0 takes from its own tiers (RAM, or an SSD restore its cost model chose) and broadcasts the length n;
  2. every other rank takes exactly that prefix, ``take(tokens[: n + 1])`` (from RAM, or from its own SSD file of
     the entry: followers restore whenever they must, see ``follower_restore_mode``);
  3. the ranks count who could not: if any rank lacks its shard (evicted at a different moment, a file lost),
     every rank drops its hit and the prompt is prefilled from scratch. Never a mixed, wrong KV.
``peek`` (a retake's "is there more now?") is rank 0's answer broadcast. Every other verb of ``cache.protocol.
PrefixCache`` is this rank's own (its RAM and SSD tiers; the SSD verbs of ``TieredCache`` are reached through that
object itself, as in a single process).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

log = logging.getLogger("mlx_lane.sharded_cache")

# A follower restores a file whenever rank 0 chose a prefix its RAM lacks: rank 0 already weighed the cost
follower_restore_mode = "always"


class ShardedPromptCache:
    """Wraps this rank's prompt cache (``cache.tiered.TieredCache`` or ``cache.prompt_cache.PromptCache``); a complete ``cache.protocol.PrefixCache``."""

    def __init__(self, inner: Any, group: Any) -> None:
        self._inner = inner
        self._group = group
        self._lock = threading.Lock()
        self.disagreed = 0  # takes dropped because some rank lacked its shard
        self.disagreed_tokens = 0

    def take(self, tokens: Sequence[int], ns: str, session: str | None = None):
        g = self._group
        hit = self._inner.take(tokens, ns, session) if g.leader else None
        n = g.share_int(hit.length if hit is not None else 0)
        if not g.leader and n:
            hit = self._inner.take(list(tokens[: n + 1]), ns, session)
        have = n == 0 or (hit is not None and hit.length == n)
        missing = g.count(not have)
        if missing:
            with self._lock:
                self.disagreed += 1
                self.disagreed_tokens += n
            log.info("prefix of %d tokens not used: %d rank(s) lack their shard of it", n, missing)
            return None
        return hit if n else None

    def peek(self, tokens: Sequence[int], ns: str, session: str | None = None, *, local: bool = False) -> int:
        """Rank 0's answer on every rank (a collective: every rank must ask at the same point), or with ``local``
        this rank's own (no collective: an estimate only rank 0's scheduler makes)."""
        if local:
            return self._inner.peek(tokens, ns, session)
        g = self._group
        return g.share_int(self._inner.peek(tokens, ns, session) if g.leader else 0)

    # -- this rank's own tiers ------------------------------------------------------------------------------------
    def put(self, tokens: Sequence[int], caches: list, ns: str, session: str | None = None, *,
            anchor: bool = False) -> bool:
        return self._inner.put(tokens, caches, ns, session, anchor=anchor)

    def ready(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        return self._inner.ready(tokens, ns, session)

    def prefetch(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        return self._inner.prefetch(tokens, ns, session)

    def make_room(self, nbytes: int) -> int:
        return self._inner.make_room(nbytes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self._inner.observe_prefill(tokens, seconds)

    def clear(self) -> int:
        return self._inner.clear()

    def stats(self) -> dict[str, Any]:
        return self._inner.stats()

    def entries_by_namespace(self) -> dict[str, int]:
        return self._inner.entries_by_namespace()

    def shard_stats(self) -> dict:
        with self._lock:
            return {"takes_dropped": self.disagreed, "tokens_dropped": self.disagreed_tokens}
