"""The prefix cache the lane sees: the RAM tier over the SSD cold tier, with write-behind and read-ahead.

(About 490 lines, one job: the composition of the tiers and the rules between them (which tier a take uses, what a
put schedules, what a flush must leave durable). Each tier and the writer are their own modules, listed below; what
stays here is the policy that needs all of them at once.)

Same verbs as `cache.prompt_cache.PromptCache` (`take`, `put`, `clear`, `stats`), plus `prefetch`, `observe_prefill`,
`flush`, `pending`, `ssd_stats`, `demote_idle` and `close`. The parts, each owned by one object:

    PromptCache           RAM tier: entries, matching, LRU (cache.prompt_cache)
    SSDStore              cold tier: files, index, byte cap (cache.ssd_store)
    DurabilityCoordinator write-behind: debounce, writer thread, retries, flush (cache.durability)
    CostModel             restore-or-recompute decision from measured rates (cache.rates)

Rules (DESIGN.md "RAM tier contract", "SSD tier contract", "Durability coordinator"):
  * `take` (lane thread): the SSD tier wins only with a STRICTLY longer usable prefix than RAM, and only when the
    cost model says reading it is cheaper than prefilling the extra tokens (saved = ssd length - RAM length). A
    restored entry is put into RAM whole (all the file's tokens), then served by the RAM tier like any entry, so
    the caller owns its caches exactly as with a RAM hit. A prefetch in flight for the same file is waited for,
    not read twice; a take with no prefetch reads on the lane (the lane would wait for it anyway).
  * `put` (lane thread): RAM put, and `schedule` on the durability coordinator (debounced). The lane only hands
    over array references; serialization and fsync run on the writer thread. An entry the cost model says could
    never be restored faster than recomputed on this machine is not written (`writes_declined`; an H200).
  * RAM eviction of an entry (byte cap, or an entry larger than the whole RAM cap) spills it: `schedule(delay=0,
    sole=True)`. The pending snapshot holds the arrays until the writer has them on disk, so the lane never waits
    for fsync; an entry already on disk costs one index lookup (`covers`). Spills waiting for the disk hold memory
    beyond the RAM cap: the coordinator's `max_sole_bytes` bounds it (the oldest spill is dropped past it).
  * Idle demotion: entries unused for `demote_idle_s` are removed from RAM and spilled the same way (counted in
    `demotions`). A daemon timer checks every `min(demote_idle_s / 4, 30)` seconds; `demote_idle()` runs a check
    now (tests drive it with the RAM tier's injected clock). `demote_idle_s <= 0` turns demotion off.
  * `prefetch` (HTTP event loop, after tokenizing): `store.sync()` (other replicas' files on a shared folder),
    then index-only lookups in both tiers; when the SSD tier has a
    strictly longer prefix and the cost model agrees, the read starts on an I/O thread while the request waits
    for the lane. Reads are keyed by file: a second prefetch of the same file joins the first (`coalesced`).
  * `flush` first schedules every RAM entry no file covers (a write abandoned on a full disk, a dropped snapshot,
    a file a shared folder lost), then is True only when nothing is pending AND every RAM entry is covered by a
    file: "durable" is a fact about the entries, not about the writer's queue (a write that fails again keeps it
    False).
  * `clear` clears RAM only: the SSD tier is what survives; delete its files to drop it.

Threads: the I/O pool and the demotion timer run MLX work (restores, forks, snapshots) on streams they create
themselves (`cache.ssd_store.thread_stream`: MLX work on the default stream off the main thread can abort the
process at exit).

Internal updates: a take touches the RAM entry's LRU time; a restore touches the file's mtime (SSD LRU); both
feed the cost model (restore bytes/seconds here, prefill tokens/seconds from the lane via `observe_prefill`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import mlx.core as mx

from cache import kvfile
from cache.copying import all_trimmable, fork, fork_checkpoints, total_nbytes
from cache.prompt_cache import CacheHit, PromptCache
from cache.ssd_store import thread_stream

__all__ = ["TieredCache"]

log = logging.getLogger(__name__)

_MAX_LANDED = 64  # finished prefetches remembered until their take (bounded: a request may never come)
_MIN_PREFILL_SAMPLE = 16  # shorter prefills are mostly fixed overhead: they say little about the rate
_MAX_DECLINED = 4096  # declined entries remembered for flush (older ones have long left RAM)
_FLUSH_ROUNDS = 3  # a flush tries again this often when a sharing replica removed a file during it


class _Loaded(NamedTuple):
    """A restored file: `caches` cover `tokens`; `in_ram` tells whether the RAM tier kept it."""

    tokens: tuple[int, ...]
    caches: list
    in_ram: bool


class TieredCache:
    """RAM over SSD. Thread-safe: the lane takes and puts, the event loop prefetches and reads stats, the I/O
    pool restores, the writer writes, the timer demotes."""

    def __init__(self, ram: PromptCache, store: Any, durability: Any, cost: Any, *, demote_idle_s: float = 300.0,
                 io_workers: int = 2, start_timer: bool = True) -> None:
        """`ram` must have been built with `on_evict=tiered.spill`: use `TieredCache.build` unless testing."""
        self._ram = ram
        self._store = store
        self._durability = durability
        self._cost = cost
        self._idle_s = float(demote_idle_s)
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}  # file path -> restore in flight
        # file path -> prefetch that finished before its request reached the lane (the batching lane keeps such a
        # request waiting until the read is done): its take still counts as an SSD hit
        self._landed: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._joined: set[Future] = set()  # in-flight reads a take already joined (they never land)
        # entries the cost model declined to write (never durable, on purpose): flush does not wait for them
        self._declined: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._c = dict(prefetches=0, prefetch_coalesced=0, prefetch_skipped=0, ssd_hits=0, ssd_tokens_hit=0,
                       restores_on_lane=0, restores_failed=0, spills=0, spill_failed=0, demotions=0,
                       writes_declined=0, flush_rewrites=0)
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="mlx-lane-ssd-io")
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if start_timer and self._idle_s > 0:
            self._timer = threading.Thread(target=self._demote_loop, name="mlx-lane-demote", daemon=True)
            self._timer.start()

    @classmethod
    def build(cls, ram_bytes: int, store: Any, durability: Any, cost: Any, *,
              clock: Callable[[], float] = time.monotonic, **kw: Any) -> TieredCache:
        """A TieredCache over a new RAM tier of `ram_bytes` (LRU times from `clock`) whose evictions spill."""
        box: list[TieredCache] = []
        ram = PromptCache(ram_bytes, clock=clock,
                          on_evict=lambda ns, tokens, caches: box[0].spill(ns, tokens, caches),
                          on_let_go=lambda ns, tokens: box[0].let_go(ns, tokens))
        box.append(cls(ram, store, durability, cost, **kw))
        return box[0]

    # ----------------------------------------------------------------------------------------------- lane verbs

    def take(self, tokens: Sequence[int], ns: str, session: str | None = None) -> CacheHit | None:
        """The longest usable prefix from either tier (RAM unless SSD is strictly longer and worth reading).

        The caller owns the returned caches (as with `PromptCache.take`); `source` is "ssd" when this take
        brought the prefix up from disk (its own read, or a prefetch it joined).
        """
        match = self._store.find(tokens, ns)
        loaded: _Loaded | None = None
        if match is not None:
            with self._lock:
                fut = self._inflight.get(match.path)
                if fut is not None:
                    self._joined.add(fut)
                else:
                    fut = self._landed.pop(match.path, None)
            if fut is not None:
                loaded = fut.result()  # a prefetch of this file: join it (never raises, see _load)
            ram_len = self._ram.peek(tokens, ns, session)
            if match.length > ram_len and fut is None:
                if self._cost.should_restore(match.nbytes, match.length - ram_len):
                    with self._lock:
                        self._c["restores_on_lane"] += 1
                    loaded = self._load(match)
            if loaded is not None and match.length > ram_len and not loaded.in_ram:
                # Too big for RAM: serve this request from the restored objects themselves (forks of them).
                self._count_ssd_hit(match.length)
                return CacheHit(fork(loaded.caches, trim=len(loaded.tokens) - match.length, unwrap=True),
                                match.length, "ssd", fork_checkpoints(loaded.caches, match.length))
        hit = self._ram.take(tokens, ns, session)
        if hit is not None and loaded is not None and match is not None and hit.length == match.length:
            self._count_ssd_hit(hit.length)
            return dataclasses.replace(hit, source="ssd")
        return hit

    def put(self, tokens: Sequence[int], caches: list, ns: str, session: str | None = None, *,
            anchor: bool = False) -> bool:
        """RAM put (``anchor``: see `PromptCache.put`) plus debounced write-behind. Never writes on the caller's
        thread. True when either tier took it: RAM kept it, or its write to SSD is scheduled.

        A trimmable anchor is not written at once: the entries that extend it are (each such file holds the anchor's
        prefix too, and on SSD a longer trimmable file supersedes its prefixes), so it would be written and deleted
        again; it reaches the disk if RAM evicts it first (a spill, as for any entry). An untrimmable one is written:
        nothing longer can serve its prefix."""
        scheduled = False
        # asked for every entry, anchors too: a declined one is remembered, so that flush does not wait for an
        # anchor whose extending entries will never be written either
        if self._worth_writing(tokens, caches, ns) and (not anchor or not all_trimmable(caches)):
            try:
                scheduled = bool(self._durability.schedule(tokens, caches, ns))
            except Exception:  # durability is best effort: never fail a request for it
                log.exception("ssd cache: scheduling a write failed")
        return bool(self._ram.put(tokens, caches, ns, session, anchor=anchor)) or scheduled

    def ready(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        """False while this prompt's SSD prefix is being read (index-only, never blocks). The lane asks before it
        admits a request and keeps it waiting outside the batch until the read is done, so `take` never reads on
        the lane's clock: when no read is in flight but one is worth it (the handler's prefetch was skipped, or
        RAM lost the entry since), this starts it and answers False."""
        match = self._store.find(tokens, ns)
        if match is None:
            return True
        with self._lock:
            fut = self._inflight.get(match.path)
            landed = match.path in self._landed
        if fut is not None:
            return fut.done()
        return landed or not self.prefetch(tokens, ns, session)

    def peek(self, tokens: Sequence[int], ns: str, session: str | None = None, *, local: bool = False) -> int:
        """The prefix length a RAM take would return now (index-only; no counter, no LRU time)."""
        return self._ram.peek(tokens, ns, session)

    def make_room(self, nbytes: int) -> int:
        """The RAM tier yields `nbytes` for the running requests (admission by memory). LRU entries leave as on any
        eviction, but the memory is wanted now: as many bytes of pending spills as the eviction made are dropped
        (oldest first), since a spill's snapshot would go on holding its arrays until the disk takes it (with
        --ssd-write-when idle, not while anything runs). When RAM alone cannot give `nbytes`, the oldest pending
        spills give the rest (``held_bytes`` counts them, so admission may ask for them). Returns bytes freed."""
        before = self._durability.sole_pending_bytes()
        freed = self._ram.make_room(nbytes)
        spilled = self._durability.sole_pending_bytes() - before
        if spilled > 0:
            self._durability.drop_spills(spilled)
        if freed < nbytes:
            freed += self._durability.drop_spills(nbytes - freed)
        return freed

    def held_bytes(self) -> int:
        """Memory this cache holds: the RAM tier's entries and the pending spills (what admission counts)."""
        return int(self._ram.stats().get("bytes", 0) or 0) + self._durability.sole_pending_bytes()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The lane prefilled `tokens` in `seconds`: feeds the cost model's prefill rate."""
        if tokens >= _MIN_PREFILL_SAMPLE:
            self._cost.observe_prefill(tokens, seconds)

    # ---------------------------------------------------------------------------------------- event-loop verbs

    def prefetch(self, tokens: Sequence[int], ns: str, session: str | None = None) -> bool:
        """Start reading the SSD prefix of `tokens` if it beats RAM and is worth it. Index-only on the caller's
        thread; True when a read for it is in flight (started now or joined).

        First the store learns of files other processes sharing its folder wrote or removed (`SSDStore.sync`: a
        stat per folder when nothing changed), so a conversation that moved here from another replica finds the
        KV that replica wrote."""
        self._store.sync()
        match = self._store.find(tokens, ns)
        if match is None:
            return False
        with self._lock:
            if match.path in self._inflight:
                self._c["prefetch_coalesced"] += 1
                return True
        ram_len = self._ram.peek(tokens, ns, session)
        if match.length <= ram_len:
            return False
        if not self._cost.should_restore(match.nbytes, match.length - ram_len):
            with self._lock:
                self._c["prefetch_skipped"] += 1
            return False
        with self._lock:
            if match.path in self._inflight:  # another prefetch got here between the two locks
                self._c["prefetch_coalesced"] += 1
                return True
            fut = self._pool.submit(self._load_io, match)
            self._inflight[match.path] = fut
            self._c["prefetches"] += 1
        fut.add_done_callback(lambda f, path=match.path: self._settled(path, f))
        return True

    def clear(self) -> int:
        """Clear the RAM tier only (the SSD tier is what survives restarts). Returns RAM entries dropped."""
        return self._ram.clear()

    def stats(self) -> dict[str, Any]:
        """The RAM tier's counters (the `prompt_cache` block of /stats)."""
        return self._ram.stats()

    def entries_by_namespace(self) -> dict[str, int]:
        return self._ram.entries_by_namespace()

    def set_write_gate(self, may_write) -> None:
        """Writes to disk only while ``may_write()`` is True (None: whenever due): ``DurabilityCoordinator.set_gate``."""
        self._durability.set_gate(may_write)

    def ssd_stats(self) -> dict[str, Any]:
        """The SSD tier, write-behind, prefetch and cost-model counters (the `ssd_cache` block of /stats)."""
        store = self._store.stats()
        dur = self._durability.stats()
        with self._lock:
            own = dict(self._c)
        return {
            "enabled": True,
            "dir": store.get("dir"),
            "entries": store.get("entries", 0),
            "bytes": store.get("bytes", 0),
            "max_bytes": store.get("max_bytes", 0),
            "restores": store.get("restores", 0),
            "restore_ms_last": round(store.get("restore_ms_last", 0.0), 3),
            "restore_mb_s": round(store.get("restore_mb_s", 0.0), 1),
            "writes": store.get("writes", 0),
            "write_ms_last": round(store.get("write_ms_last", 0.0), 3),
            "pending": dur.get("pending", 0),
            "pending_bytes": dur.get("pending_bytes", 0),
            "dropped": dur.get("dropped", 0),
            "spilled_pending_bytes": dur.get("sole_pending_bytes", 0),  # held only by the writer's queue
            "spills_dropped": dur.get("spills_dropped", 0),
            "write_gate_waits": dur.get("gate_waits", 0),  # --ssd-write-when idle: polls that found the lane busy
            "failed": store.get("failed", 0),
            "writes_abandoned": dur.get("failed", 0),
            "write_retries": dur.get("retries", 0),
            "errors": store.get("errors", {}),
            "removed_at_scan": store.get("removed_at_scan", 0),
            "evictions": store.get("evictions", 0),
            "superseded": store.get("superseded", 0),
            "shared": {k: store.get(k, 0) for k in ("syncs", "synced_added", "synced_dropped", "evict_skipped_busy",
                                                     "tmp_in_progress")},
            **own,
            "cost_model": self._cost.stats(),
        }

    def pending(self) -> list[dict[str, Any]]:
        """What is not durable: snapshots waiting for (or in) the writer, then RAM entries no file covers
        (a write that failed or was dropped), for the flush endpoint's 503 body."""
        waiting = self._durability.pending()
        for p in waiting:
            p["state"] = "in_flight" if p.get("in_flight") else "pending"
        return waiting + [{"ns_hash": kvfile.ns_hash(ns), "tokens": len(tokens), "state": "not_written"}
                          for ns, tokens in self._not_durable() if not self._durability.is_pending(tokens, ns)]

    def flush(self, timeout: float | None = None) -> bool:
        """Write everything pending now, and every RAM entry no file covers. True when, within `timeout` seconds,
        nothing is pending and every entry in RAM is covered by a file.

        Re-scheduling the uncovered entries is what makes a flush after a full disk (or a dropped snapshot, or a
        file another replica's supersede or eviction removed from a shared folder) end durable: their writes were
        abandoned and nothing else would try again until the same entry is put again, which a conversation that
        moved on never does. A write that fails again keeps this False."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for _ in range(_FLUSH_ROUNDS):
            self._store.sync()  # a file another replica wrote may cover an entry; one it removed no longer does
            # entries nothing will write: those uncovered now whose snapshot is not pending (a pending one that
            # fails in this flush is not tried twice in it)
            orphans = {key for key in self._not_durable() if not self._durability.is_pending(key[1], key[0])}
            flushed = bool(self._durability.flush(remaining()))
            # after the pending writes, so that an entry a pending longer snapshot covers (an anchor) is not written
            if orphans and self._reschedule(orphans):
                flushed = bool(self._durability.flush(remaining()))
            if not flushed:
                return False  # a failed write ends the flush at once
            self._store.sync()
            if not self._not_durable():
                return True
            # a file covering an entry went away during this round (a sharing replica's write superseded or evicted
            # it): another round writes it again, while time is left
            if remaining() == 0.0:
                break
        return False

    # ------------------------------------------------------------------------------------------ tier movements

    def spill(self, ns: str, tokens: tuple[int, ...], caches: list) -> None:
        """The RAM tier is dropping this entry: make sure it reaches disk (writer thread, no debounce).

        Called by the RAM tier's on_evict hook (outside its lock) and by demotion. Cheap when already durable. An
        entry that could never be restored faster than recomputed here is dropped instead (`_worth_writing`), and so
        is a write of it still pending from before the cost model knew better: that snapshot would be the only
        holder of the entry's arrays, uncounted, until the disk took it.
        """
        if not self._worth_writing(tokens, caches, ns):
            self._durability.forget(tokens, ns)
            return
        try:
            ok = self._durability.schedule(tokens, caches, ns, delay=0.0, sole=True)
        except Exception:
            log.exception("ssd cache: spilling an entry failed")
            ok = False
        with self._lock:
            self._c["spills" if ok else "spill_failed"] += 1

    def let_go(self, ns: str, tokens: tuple[int, ...]) -> None:
        """The RAM tier superseded this entry (its on_let_go hook): a write of it still pending is now the only holder
        of its arrays and counts as a spill (``DurabilityCoordinator.disown``)."""
        self._durability.disown(tokens, ns)

    def demote_idle(self) -> int:
        """Move entries idle longer than `demote_idle_s` from RAM to SSD now; return how many."""
        if self._idle_s <= 0:
            return 0
        idle = self._ram.pop_idle(self._idle_s)
        with mx.stream(thread_stream()):
            for ns, tokens, caches in idle:
                self.spill(ns, tokens, caches)
        with self._lock:
            self._c["demotions"] += len(idle)
        return len(idle)

    @property
    def cost_model(self) -> Any:
        return self._cost

    def close(self, timeout: float | None = None) -> bool:
        """Stop the timer and the I/O pool, flush and stop the writer (bounded by `timeout`). Returns flush's
        result: True when everything pending became durable."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join(1.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        start = time.monotonic()
        durable = self.flush(timeout)  # a graceful stop also writes what an abandoned write left behind
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        self._durability.close(remaining)
        return durable

    # ---------------------------------------------------------------------------------------------- helpers

    def _load_io(self, match: Any) -> _Loaded | None:
        with mx.stream(thread_stream()):
            return self._load(match)

    def _load(self, match: Any) -> _Loaded | None:
        """Read the whole file of `match` and put it into RAM. None (never an exception) when unusable."""
        try:
            whole = dataclasses.replace(match, length=match.entry_tokens)
            restored = self._store.restore(whole)
            if restored is None:
                with self._lock:
                    self._c["restores_failed"] += 1
                return None
            self._cost.observe_restore(restored.nbytes, restored.seconds)
            tokens = tuple(restored.tokens)
            in_ram = self._ram.put(tokens, restored.caches, match.ns)
            return _Loaded(tokens, restored.caches, bool(in_ram))
        except Exception:
            log.exception("ssd cache: restore failed")
            with self._lock:
                self._c["restores_failed"] += 1
            return None

    def _worth_writing(self, tokens: Sequence[int], caches: list, ns: str) -> bool:
        """The cost model's say on writing this entry at all (cache.rates.CostModel.worth_writing); a declined one
        is remembered, so that `flush` does not wait for it."""
        if self._cost.worth_writing(total_nbytes(caches), len(tokens)):
            return True
        with self._lock:
            self._declined[(ns, tuple(tokens))] = None
            while len(self._declined) > _MAX_DECLINED:
                self._declined.popitem(last=False)
            self._c["writes_declined"] += 1
        return False

    def _reschedule(self, keys: set[tuple[str, tuple[int, ...]]]) -> int:
        """Schedule (no debounce) those of `keys` that are still in RAM and not durable; returns how many."""
        again = 0
        with mx.stream(thread_stream()):  # the snapshot makes MLX arrays: on this thread's own stream
            for ns, tokens in self._not_durable():
                caches = self._ram.entry_caches(ns, tokens) if (ns, tokens) in keys else None
                if caches is None:
                    continue
                try:
                    again += bool(self._durability.schedule(tokens, caches, ns, delay=0.0))
                except Exception:
                    log.exception("ssd cache: re-scheduling an entry for flush failed")
        if again:
            with self._lock:
                self._c["flush_rewrites"] += again
        return again

    def _not_durable(self) -> list[tuple[str, tuple[int, ...]]]:
        with self._lock:
            declined = set(self._declined)
        return [(ns, tokens) for ns, tokens in self._ram.keys()
                if (ns, tokens) not in declined and not self._durability.is_durable(tokens, ns)]

    def _settled(self, path: str, fut: Future) -> None:
        with self._lock:
            if self._inflight.get(path) is fut:
                del self._inflight[path]
                if fut in self._joined:
                    self._joined.discard(fut)
                    return
                self._landed[path] = fut
                while len(self._landed) > _MAX_LANDED:
                    self._landed.popitem(last=False)

    def _count_ssd_hit(self, length: int) -> None:
        with self._lock:
            self._c["ssd_hits"] += 1
            self._c["ssd_tokens_hit"] += length

    def _demote_loop(self) -> None:
        interval = min(max(self._idle_s / 4, 0.05), 30.0)
        while not self._stop.wait(interval):
            try:
                self.demote_idle()
            except Exception:  # the timer must outlive a bad entry
                log.exception("ssd cache: idle demotion failed")
