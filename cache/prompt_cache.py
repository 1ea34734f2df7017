"""RAM tier of the prefix cache: per-namespace entries of (token ids -> per-layer KV caches), reused by prefix.

(About 405 lines, one job: the RAM tier's index and its rules (take, put, supersede, evict, sessions, anchors). The
eviction order is cache.policy's, the copying cache.copying's, the prefix arithmetic cache.prefix's; what is left is
the contract below, and splitting the index from its verbs would only pass the lock between two modules.)

Public verbs (what the lane and the HTTP layer call):
  * `take(tokens, ns, session=None) -> CacheHit | None` (lane thread). Non-consuming: the donor entry stays in the
    cache untouched; the caller OWNS `hit.caches` (new objects, zero-copy views of the donor's arrays, trimmed to
    `hit.length`) and may extend or trim them freely. At least one prompt token is always left to forward.
  * `put(tokens, caches, ns, session=None)` (lane thread). Stores NEW cache objects over the caller's arrays, so the
    caller may keep generating with its own objects afterwards. `caches` must cover exactly `tokens`.
  * `clear() -> int`, `stats() -> dict` (HTTP event loop thread). One lock guards the index; the array work of
    take/put (forking handles) runs outside it, on the caller's thread.
  * The rest of `cache.protocol.PrefixCache`: `peek(tokens, ns, session) -> int` (the usable length take would
    give, touching nothing), `make_room(nbytes)`; `ready`, `prefetch` and `observe_prefill` are no-ops here (RAM
    only). Hooks for a tier below (cache.tiered): `pop_idle(idle_s)` (remove and return entries unused for `idle_s`), and `on_evict`, called
    OUTSIDE the lock with (ns, tokens, caches) for every entry the byte cap pushes out (LRU eviction, or a new
    entry larger than the whole cap). Supersede, replace and clear do not call it: what they drop is either
    served by a newer entry or dropped on purpose. `on_let_go`, also outside the lock, gets (ns, tokens) of each
    entry a longer one superseded: a write of it still pending below is then the only holder of its arrays.

Matching rules (DESIGN.md "RAM tier contract"; the rule itself is `cache.prefix.usable`, shared with the SSD tier):
  * usable prefix p = min(common prefix, len(prompt) - 1); the longest usable p wins (ties: the smaller trim, then
    the most recently used). An entry longer than p needs a trim, so it qualifies only if all its caches are
    trimmable; an untrimmable entry matches only when all its tokens are a prefix of the prompt. p == 0 is a miss.
  * a session id maps (per namespace) to the entry last put with it; when the prompt extends that entry the hit is
    O(1) in the number of entries (source "session"); otherwise the normal longest-prefix scan runs.
  * namespaces never mix: the scan only sees entries of the request's namespace.

Storage rules:
  * `cache.prefix.supersedes`: same namespace and tokens -> the old entry is replaced (its sessions move to the new
    one); strict prefix-ancestors are superseded (dropped) only when the new entry is trimmable: an untrimmable
    entry cannot serve its ancestors' shorter matches, so e.g. a prompt-boundary snapshot must survive;
  * over `max_bytes`, evict in `LruSessionLast` order (least recently used first, session-bound entries last; the
    new entry is a candidate like any other); an entry larger than the whole cap is not kept (`rejected_too_big`).
  * bytes are the caches' `nbytes` as the caller hands them over: the views keep the whole buffers alive,
    allocation padding included, so that is what RAM really holds.

Internal updates: `take` touches the donor's LRU time and the hit counters (queries, tokens_queried, hits,
tokens_hit, session_hits; vLLM style: tokens counted up to len(prompt) - 1).

Why a linear scan and not a radix tree: entries number in the hundreds; each comparison is one vectorized numpy
pass over the shorter sequence, skipped entirely when the entry cannot beat the best match so far.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache.checkpoints import reach_of
from cache.copying import fork, fork_checkpoints, iter_offsets, total_nbytes
from cache.policy import LruSessionLast
from cache.prefix import ids as _as_ids
from cache.prefix import best_match, is_prefix, supersedes

__all__ = ["CacheHit", "NullPromptCache", "PromptCache", "make_prompt_cache"]


@dataclass(frozen=True)
class CacheHit:
    """A reusable prefix. `caches` are OWNED by the caller (new objects; extend them freely)."""

    caches: list
    length: int  # prompt tokens the caches cover: 0 < length <= len(prompt) - 1
    source: str  # "ram" | "session" (later "ssd")
    # the entry's checkpoints below `length` (cache.copying.fork_checkpoints): {position: {layer: cache}}
    checkpoints: dict = field(default_factory=dict)


@dataclass(eq=False)
class _Entry:
    ns: str
    tokens: tuple[int, ...]
    ids: np.ndarray  # the same tokens, for vectorized prefix comparison
    caches: list  # never handed out, never mutated: takers get forks
    nbytes: int
    trimmable: Any  # its reach (cache.prefix): True, False, or the positions its checkpoints cut it back to
    last_use: float
    sessions: set[str] = field(default_factory=set)
    anchor: bool = False  # kept on purpose: never superseded, evicted last (see put)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.ns, self.tokens)


class PromptCache:
    """The RAM tier. See the module docstring for the contract; thread-safe as described there."""

    def __init__(self, max_bytes: int, *, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[str, tuple[int, ...], list], None] | None = None,
                 on_let_go: Callable[[str, tuple[int, ...]], None] | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes} (use NullPromptCache to disable caching)")
        self._max_bytes = int(max_bytes)
        self._clock = clock
        self._on_evict = on_evict
        self._on_let_go = on_let_go  # an entry dropped without eviction: a longer one superseded it
        self._lock = threading.Lock()
        self._by_ns: dict[str, dict[tuple[int, ...], _Entry]] = {}
        self._sessions: dict[tuple[str, str], _Entry] = {}
        self._policy = LruSessionLast()
        self._bytes = 0
        self._queries = self._hits = self._tokens_queried = self._tokens_hit = 0
        self._evictions = self._session_hits = self._rejected_too_big = self._superseded = 0
        self._checkpoint_hits = self._checkpoint_tokens = 0  # hits cut back to a checkpoint inside an entry
        self._demoted = 0

    # ----------------------------------------------------------------------------------------------- public verbs

    def take(self, tokens: Sequence[int], ns: str, session: str | None = None) -> CacheHit | None:
        """The longest usable cached prefix of `tokens` in namespace `ns`, or None.

        The caller owns the returned caches; the donor entry is left untouched (only its LRU time moves).
        """
        prompt = _as_ids(tokens)
        with self._lock:
            self._queries += 1
            self._tokens_queried += len(prompt)
            found = self._find(prompt, ns, session)
            if found is None:
                return None
            entry, length, source = found
            entry.last_use = self._clock()
            self._policy.touch(entry.key)
            self._hits += 1
            self._tokens_hit += length
            if source == "session":
                self._session_hits += 1
            if length < len(entry.tokens) and isinstance(entry.trimmable, tuple):  # cut back to a checkpoint
                self._checkpoint_hits += 1
                self._checkpoint_tokens += length
        # Outside the lock: the entry's caches are never mutated, and a concurrent clear() only unlinks them.
        caches = fork(entry.caches, trim=len(entry.tokens) - length, unwrap=True)
        return CacheHit(caches=caches, length=length, source=source,
                        checkpoints=fork_checkpoints(entry.caches, length))

    def put(self, tokens: Sequence[int], caches: list, ns: str, session: str | None = None, *,
            anchor: bool = False) -> bool:
        """Store `caches` (covering exactly `tokens`) under `ns`, optionally as `session`'s latest entry. An `anchor`
        (a prefix kept on purpose: a cache breakpoint, a shared system prompt) is never superseded by the longer
        entries that extend it, and is evicted only after every plain entry, with the session-bound ones.

        The cache keeps its own objects (views of the same arrays); the caller keeps ownership of `caches` and may
        go on mutating them. ValueError if a cache's offset disagrees with len(tokens): such an entry would
        serve wrong KV and change the generated text. Returns True when the entry is in the cache afterwards.
        """
        ids = _as_ids(tokens)
        if len(ids) == 0:
            return False
        for offset in iter_offsets(caches):
            # 0 is allowed: some models carry caches for layers that never see a token (KV sharing).
            if offset not in (0, len(ids)):
                raise ValueError(f"cache offset {offset} does not match {len(ids)} tokens")
        nbytes = total_nbytes(caches)
        if nbytes > self._max_bytes:
            with self._lock:
                self._rejected_too_big += 1
            if self._on_evict is not None:
                self._on_evict(ns, tuple(ids.tolist()), caches)  # too big for RAM: the tier below may keep it
            return False
        stored = fork(caches)
        entry = _Entry(
            ns=ns,
            tokens=tuple(ids.tolist()),
            ids=ids,
            caches=stored,
            nbytes=nbytes,
            trimmable=reach_of(stored),
            last_use=self._clock(),
            anchor=anchor,
        )
        with self._lock:
            evicted, let_go = self._insert(entry, session)
        if self._on_let_go is not None:
            for gone in let_go:
                self._on_let_go(gone.ns, gone.tokens)
        if self._on_evict is not None:
            for victim in evicted:
                self._on_evict(victim.ns, victim.tokens, victim.caches)
        return entry not in evicted

    def make_room(self, nbytes: int) -> int:
        """Evict least-recently-used entries (session-bound last, as the byte cap does) until `nbytes` are freed
        or the tier is empty; evicted entries go to `on_evict` (the SSD tier spills them). Returns bytes freed.
        The lane's memory-budget admission calls this: the RAM tier yields before a sequence is kept waiting."""
        freed = 0
        evicted = []
        with self._lock:
            while freed < nbytes and self._bytes > 0:
                victim = self._policy.victim()
                if victim is None:
                    break
                ns, tokens = victim
                gone = self._by_ns[ns][tokens]
                self._drop(gone)
                evicted.append(gone)
                freed += gone.nbytes
                self._evictions += 1
        if self._on_evict is not None:
            for victim in evicted:
                self._on_evict(victim.ns, victim.tokens, victim.caches)
        return freed

    def peek(self, tokens: Sequence[int], ns: str, session: str | None = None, *, local: bool = False) -> int:
        """The prefix length `take` would return now (0 for a miss). Touches no counter and no LRU time."""
        prompt = _as_ids(tokens)
        with self._lock:
            found = self._find(prompt, ns, session)
        return found[1] if found is not None else 0

    def pop_idle(self, idle_s: float) -> list[tuple[str, tuple[int, ...], list]]:
        """Remove every entry unused for more than `idle_s` seconds; return them as (ns, tokens, caches).

        The caller owns what is returned (the entries are gone from the cache); counted in `demoted`.
        """
        cutoff = self._clock() - idle_s
        with self._lock:
            idle = [e for entries in self._by_ns.values() for e in entries.values() if e.last_use < cutoff]
            for entry in idle:
                self._drop(entry)
            self._demoted += len(idle)
        return [(e.ns, e.tokens, e.caches) for e in idle]

    def entries_by_namespace(self) -> dict[str, int]:
        """How many entries each namespace holds now (per model in /stats)."""
        with self._lock:
            return {ns: len(entries) for ns, entries in self._by_ns.items() if entries}

    def entry_caches(self, ns: str, tokens: Sequence[int]) -> list | None:
        """The caches of the entry keyed exactly (ns, tokens), or None. Not a take: no fork, no counter, no LRU
        time; the caller must only read them (the tier below snapshots them for a write)."""
        with self._lock:
            entry = self._by_ns.get(ns, {}).get(tuple(int(t) for t in tokens))
            return entry.caches if entry is not None else None

    def keys(self) -> list[tuple[str, tuple[int, ...]]]:
        """(ns, tokens) of every entry, in eviction order (for the tier below and for tests)."""
        with self._lock:
            return list(self._policy.order())

    def prefetch(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        """RAM only: nothing to read ahead (see cache.tiered)."""
        return False

    def ready(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        """RAM only: every prefix is ready (see cache.tiered)."""
        return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """RAM only: prefill rates feed no decision here (see cache.tiered)."""

    def clear(self) -> int:
        """Drop every entry (counters are kept). Returns how many entries were dropped."""
        with self._lock:
            dropped = len(self._policy)
            self._by_ns.clear()
            self._sessions.clear()
            self._policy.clear()
            self._bytes = 0
            return dropped

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "enabled": True,
                "checkpoint_hits": self._checkpoint_hits,  # hits an entry served from a checkpoint inside it
                "checkpoint_tokens": self._checkpoint_tokens,  # the prompt tokens those hits saved computing
                "entries": len(self._policy),
                "bytes": self._bytes,
                "max_bytes": self._max_bytes,
                "queries": self._queries,
                "hits": self._hits,
                "tokens_queried": self._tokens_queried,
                "tokens_hit": self._tokens_hit,
                "request_hit_rate": self._hits / self._queries if self._queries else 0.0,
                "token_hit_rate": self._tokens_hit / self._tokens_queried if self._tokens_queried else 0.0,
                "evictions": self._evictions,
                "session_hits": self._session_hits,
                "rejected_too_big": self._rejected_too_big,
                "superseded": self._superseded,
                "demoted": self._demoted,
                "sessions": len(self._sessions),
            }

    # ----------------------------------------------------------------------------- helpers (caller holds the lock)

    def _find(self, prompt: np.ndarray, ns: str, session: str | None) -> tuple[_Entry, int, str] | None:
        cap = len(prompt) - 1  # the last prompt token is always forwarded
        entries = self._by_ns.get(ns)
        if cap <= 0 or not entries:
            return None
        if session is not None:
            entry = self._sessions.get((ns, session))
            if entry is not None and len(entry.tokens) <= cap and is_prefix(entry.ids, prompt):
                return entry, len(entry.tokens), "session"
        found = best_match(prompt, ((e, e.ids, e.trimmable, e.last_use) for e in entries.values()))
        if found is None:
            return None
        return found[0], found[1].length, "ram"

    def _insert(self, entry: _Entry, session: str | None) -> tuple[list[_Entry], list[_Entry]]:
        """Index `entry`; return the entries the byte cap evicted (possibly `entry` itself) and those let go without
        an eviction (the ancestors it supersedes)."""
        # Drop first, index after: _drop removes a namespace's dict once it empties.
        existing = self._by_ns.get(entry.ns, {})
        names: set[str] = set()
        let_go = []
        old = existing.get(entry.tokens)
        if old is not None:
            names |= old.sessions  # same tokens: the new entry serves those sessions exactly as the old one did
            self._drop(old)  # not let go: the new entry holds these tokens
        if old is not None and old.anchor:
            entry.anchor = True  # the same prefix, stored again: it stays an anchor
        for other in list(existing.values()):
            if supersedes(entry.ids, entry.trimmable, other.ids, other.anchor, other.trimmable):  # strict ancestors, when trimmable
                self._drop(other)
                let_go.append(other)
                self._superseded += 1
        self._by_ns.setdefault(entry.ns, {})[entry.tokens] = entry
        self._bytes += entry.nbytes
        self._policy.add(entry.key, session_bound=entry.anchor)
        if session is not None:
            names.add(session)
        for name in sorted(names):
            self._bind(entry, name)
        evicted = []
        while self._bytes > self._max_bytes:
            victim = self._policy.victim()
            if victim is None:  # unreachable while bytes > 0; guards against an accounting bug looping forever
                break
            ns, tokens = victim
            gone = self._by_ns[ns][tokens]
            self._drop(gone)
            evicted.append(gone)
            self._evictions += 1
        return evicted, let_go

    def _bind(self, entry: _Entry, session: str) -> None:
        """Point `session` at `entry` (already indexed), moving it off its previous entry."""
        slot = (entry.ns, session)
        previous = self._sessions.get(slot)
        if previous is not None and previous is not entry:
            previous.sessions.discard(session)
            if not previous.sessions and not previous.anchor:
                self._policy.set_session_bound(previous.key, False)
        entry.sessions.add(session)
        self._sessions[slot] = entry
        self._policy.set_session_bound(entry.key, True)

    def _drop(self, entry: _Entry) -> None:
        entries = self._by_ns[entry.ns]
        del entries[entry.tokens]
        if not entries:
            del self._by_ns[entry.ns]
        self._bytes -= entry.nbytes
        self._policy.remove(entry.key)
        for name in entry.sessions:
            if self._sessions.get((entry.ns, name)) is entry:
                del self._sessions[(entry.ns, name)]


class NullPromptCache:
    """The disabled cache (`--cache-bytes 0`): never hits, stores nothing, same interface."""

    def entries_by_namespace(self) -> dict[str, int]:
        return {}

    def take(self, tokens: Sequence[int], ns: str, session: str | None = None) -> CacheHit | None:
        return None

    def peek(self, tokens: Sequence[int], ns: str, session: str | None = None, *, local: bool = False) -> int:
        return 0

    def ready(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        return True

    def put(self, tokens: Sequence[int], caches: list, ns: str, session: str | None = None, *,
            anchor: bool = False) -> bool:
        return False

    def prefetch(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        return False

    def make_room(self, nbytes: int) -> int:
        return 0

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        return None

    def clear(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"enabled": False, "entries": 0, "bytes": 0, "max_bytes": 0}


def make_prompt_cache(max_bytes: int) -> PromptCache | NullPromptCache:
    """A PromptCache of `max_bytes`, or the NullPromptCache when `max_bytes` is 0."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return PromptCache(max_bytes) if max_bytes else NullPromptCache()
