"""Eviction order of the RAM tier: least recently used first, session-bound entries last.

The policy knows keys only, never caches or bytes: the prompt cache asks it for a victim while it is over its byte
cap, and tells it about every use. Keeping it apart makes the order testable without any cache and swappable.

Order of eviction (what `victim()` returns):
  1. the least recently used entry that no session points at;
  2. only when there is none, the least recently used session-bound entry.
Why two queues and not one ordered by a score: both orders are plain recency, so two `OrderedDict`s give O(1)
add/touch/remove/victim with no sorting, and "session-bound goes last" holds by construction.

Not thread-safe: the owner (PromptCache) calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

__all__ = ["LruSessionLast"]


class LruSessionLast:
    """Recency order over keys, with session-bound keys evicted only after every other key."""

    def __init__(self) -> None:
        # Oldest first in each queue; values are unused (OrderedDict as an ordered set).
        self._plain: OrderedDict[Hashable, None] = OrderedDict()
        self._bound: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plain) + len(self._bound)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plain or key in self._bound

    def add(self, key: Hashable, *, session_bound: bool) -> None:
        """Insert `key` as the most recently used of its queue (re-adding moves it)."""
        self.remove(key)
        (self._bound if session_bound else self._plain)[key] = None

    def touch(self, key: Hashable) -> None:
        """Mark `key` as just used. KeyError if unknown: a touch of a dropped entry is a bug in the caller."""
        if key in self._plain:
            self._plain.move_to_end(key)
        elif key in self._bound:
            self._bound.move_to_end(key)
        else:
            raise KeyError(key)

    def set_session_bound(self, key: Hashable, bound: bool) -> None:
        """Move `key` between the queues, keeping its recency rank relative to its new neighbours as 'now'.

        A key whose binding does not change keeps its place.
        """
        if bound and key in self._plain:
            del self._plain[key]
            self._bound[key] = None
        elif not bound and key in self._bound:
            del self._bound[key]
            self._plain[key] = None
        elif key not in self:
            raise KeyError(key)

    def remove(self, key: Hashable) -> None:
        """Forget `key`; unknown keys are ignored (drop paths may race with supersede)."""
        self._plain.pop(key, None)
        self._bound.pop(key, None)

    def victim(self) -> Hashable | None:
        """The key to evict next (not removed), or None when empty."""
        for queue in (self._plain, self._bound):
            if queue:
                return next(iter(queue))
        return None

    def order(self) -> Iterator[Hashable]:
        """All keys in eviction order (for stats and tests)."""
        yield from self._plain
        yield from self._bound

    def clear(self) -> None:
        self._plain.clear()
        self._bound.clear()
