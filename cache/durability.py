"""Write-behind to the SSD tier: debounced, on one writer thread, never on the caller's clock.

    coordinator = DurabilityCoordinator(store, debounce_s=1.0)
    coordinator.schedule(tokens, caches, ns)   # lane, after prompt_cache.put: returns at once
    coordinator.flush(timeout=10)              # SIGTERM / POST /admin/cache/flush: True when all durable
    coordinator.close(timeout=10)              # flush, then stop the writer

Snapshots. `schedule` captures the caches with `kvfile.encode` on the caller's thread: new, evaluated arrays
(views of the live part of each buffer, no copy of KV data) plus the integer state. MLX arrays never change
after evaluation, but the lane keeps mutating its cache OBJECTS (`update_and_fetch` rebinds and assigns into
`cache.keys`), so holding the objects themselves would write tokens that were never scheduled. The snapshot keeps
the arrays alive: `max_pending_bytes` bounds that memory. Most pending snapshots share their arrays with the RAM
tier's entries; a SPILL's (`schedule(..., sole=True)`: the RAM tier is dropping the entry) is the only thing keeping
its arrays, memory outside the RAM tier's cap, so `max_sole_bytes` bounds those apart: over it the oldest sole
snapshot is dropped (`spills_dropped`). A snapshot of an entry the RAM tier superseded without an eviction
(`disown`) counts as a spill from then on. On a GPU that memory is the device's: a disk slower than the entries come
(an H100 writing ~0.25 GB/s while 16 Qwen3.5-9B agents stored ~0.6 GB entries) otherwise held up to another RAM
tier's worth of evicted entries in device memory (2026-12-06: 30.8 GB pending beside a full 31 GB RAM tier).

Debounce. Pending snapshots are keyed by (ns, tuple(tokens)); re-scheduling a key re-arms its timer (a
conversation that pauses is written once per pause). A snapshot supersedes the pending ones the tiers' rule says it
makes redundant (`cache.prefix.supersedes`: a trimmable one its strict prefix-ancestors in its namespace, whose
prompts its file serves too; an untrimmable one none, so the prompt-boundary snapshot survives). Different
conversations never cancel each other.

Gate. `set_gate(may_write)` (None: always) lets the owner hold due snapshots back while `may_write()` is False:
the writer then re-asks every `gate_poll_s` (a flush or close writes regardless). The server passes "the lane is
idle" (--ssd-write-when idle, its default), so a GPU's copies and page migrations for the disk never run beside its
forwards;
while they are held the byte budgets still apply (the oldest snapshots are dropped), and `gate_waits` counts the
polls that found the lane busy.

Writer. One thread takes the oldest due snapshot, calls `store.write(tokens, snapshot, ns)` (which serializes and
fsyncs), and on failure (False or an exception) retries after `retry_backoff[i]`; when the backoff list is spent
the snapshot counts as failed. Over the byte budget, the OLDEST pending snapshot is dropped and counted. The
writer runs MLX work on its own stream (MLX work on the default stream off the main thread can abort the process at
exit: mlx 0.32, Linux).

The store needs two methods: `write(tokens, encoded, ns) -> bool` and `covers(tokens, ns) -> bool`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from cache import kvfile
from cache.prefix import ids, supersedes

__all__ = ["DurabilityCoordinator"]

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    ns: str
    tokens: tuple[int, ...]
    snap: Any  # kvfile.Encoded (or whatever `capture` returns)
    nbytes: int
    trimmable: Any  # its reach (cache.prefix): True, False, or the positions it can be cut back to
    created: float  # first schedule of this key: age, and "oldest" for the budget
    due: float  # debounce deadline
    not_before: float = 0.0  # retry backoff deadline (flush does not skip it)
    attempts: int = 0
    sole: bool = False  # a spill: nothing but this snapshot holds its arrays (the RAM tier dropped the entry)
    _ids: Any = None  # the tokens as a vector, made on the first comparison

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.ns, self.tokens

    def supersedes(self, other: _Pending) -> bool:
        """`other` is redundant once this snapshot is written (`cache.prefix.supersedes`, same namespace)."""
        if other.ns != self.ns:
            return False
        if self._ids is None:
            self._ids = ids(self.tokens)
        if other._ids is None:
            other._ids = ids(other.tokens)
        return supersedes(self._ids, self.trimmable, other._ids, old_trimmable=other.trimmable)


def _key(tokens: Sequence[int], ns: str) -> tuple[str, tuple[int, ...]]:
    """A pending snapshot's key; the RAM tier's own token tuples are taken as they are (no 32k-int copy)."""
    return ns, tokens if isinstance(tokens, tuple) else tuple(int(t) for t in tokens)


class DurabilityCoordinator:
    """Debounced write-behind of prefix-cache entries to `store`. All public methods are thread-safe."""

    def __init__(self, store: Any, *, debounce_s: float = 1.0, max_pending_bytes: int = 2 << 30,
                 max_sole_bytes: int | None = None, retry_backoff: Sequence[float] = (0.1, 0.5, 2.0),
                 clock: Callable[[], float] = time.monotonic,
                 capture: Callable[[Sequence[Any]], Any] = kvfile.encode, gate_poll_s: float = 0.05) -> None:
        self._store = store
        self._debounce = float(debounce_s)
        self._max_bytes = int(max_pending_bytes)
        self._max_sole = self._max_bytes if max_sole_bytes is None else int(max_sole_bytes)
        self._backoff = tuple(float(b) for b in retry_backoff)
        self._clock = clock
        self._capture = capture
        self._cond = threading.Condition()
        self._pending: dict[tuple[str, tuple[int, ...]], _Pending] = {}
        self._inflight: _Pending | None = None
        self._bytes = 0  # pending + in flight
        self._sole_bytes = 0  # of those, spills' (see the module docstring)
        self._flushing = 0
        self._closed = False
        self._c = dict(written=0, dropped=0, failed=0, retries=0, superseded=0, coalesced=0, already_durable=0,
                       spills_dropped=0, gate_waits=0)
        self._may_write: Callable[[], bool] | None = None
        self._gate_poll = float(gate_poll_s)
        self._warned: set[str] = set()
        # Daemon: a forgotten close() must not hang interpreter exit; close() is what makes writes durable.
        self._thread = threading.Thread(target=self._run, name="mlx-lane-durability", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------------- public

    def schedule(self, tokens: Sequence[int], caches: Sequence[Any], ns: str, *, delay: float | None = None,
                 sole: bool = False) -> bool:
        """Mark the entry (caches covering exactly `tokens`) dirty and (re)arm its debounce. Never blocks on I/O.

        `delay` overrides the debounce for this call (0: write as soon as the writer is free; used to spill an
        entry the RAM tier is dropping). `sole`: the caller keeps no reference to the caches (a spill), so the
        snapshot's bytes count against `max_sole_bytes` too. Returns False when nothing was scheduled (closed,
        unsupported cache class, or over the budget by itself); True also when the store already covers the entry.
        """
        key = (ns, tuple(int(t) for t in tokens))
        if self._closed or not key[1]:
            return False
        with self._cond:
            known = key in self._pending or (self._inflight is not None and self._inflight.key == key)
        if not known and self._store.covers(key[1], ns):
            with self._cond:
                self._c["already_durable"] += 1
            return True  # e.g. an entry the RAM tier got from the SSD tier
        try:
            snap = self._capture(caches)
        except TypeError as e:  # an unsupported cache class: a programming error, but never fail the request
            self._warn_once("capture", f"durability: cannot snapshot caches: {e}")
            with self._cond:
                self._c["failed"] += 1
            return False
        now = self._clock()
        wait = self._debounce if delay is None else max(0.0, float(delay))
        item = _Pending(ns, key[1], snap, int(snap.nbytes), snap.trimmable, now, now + wait, sole=sole)
        with self._cond:
            old = self._pending.pop(key, None)
            if old is not None:
                self._release_locked(old)
                item.created = old.created  # the key keeps its age; only the timer re-arms
                self._c["coalesced"] += 1
            for anc in [p for p in self._pending.values() if item.supersedes(p)]:  # strict ancestors, trimmable
                self._remove_locked(anc)
                self._c["superseded"] += 1
            self._pending[key] = item
            self._bytes += item.nbytes
            self._sole_bytes += item.nbytes if sole else 0
            # drop the oldest, but never the snapshot just scheduled: an entry bigger than the whole
            # budget is still written (its arrays are held by the RAM tier anyway)
            while self._bytes > self._max_bytes and len(self._pending) > 1:
                oldest = min(self._pending.values(), key=lambda p: p.created)
                self._remove_locked(oldest)
                self._c["dropped"] += 1
            self._bound_spills_locked(keep=item)
            scheduled = key in self._pending
            self._cond.notify_all()
        return scheduled

    def disown(self, tokens: Sequence[int], ns: str) -> bool:
        """The RAM tier let go of this entry without spilling it (a longer entry superseded it, and that one's write
        was declined, so it did not supersede this snapshot here): its pending snapshot, if any, is now the only holder of its arrays and counts as a
        spill from here on (``max_sole_bytes``, ``sole_pending_bytes``, ``drop_spills``). Without this, snapshots of
        entries the RAM tier had superseded, waiting for an idle lane, held ~16 GB of an H100 uncounted while 16
        Llama-3-8B agents ran (2026-12-06, fourth session). True when a snapshot was disowned."""
        with self._cond:
            if not self._pending:  # the usual case on the lane's put: nothing to look up
                return False
            item = self._pending.get(_key(tokens, ns))
            if item is None or item.sole:
                return False
            item.sole = True
            self._sole_bytes += item.nbytes
            self._bound_spills_locked(keep=item)
            self._cond.notify_all()
            return True

    def forget(self, tokens: Sequence[int], ns: str) -> bool:
        """Drop this entry's pending snapshot (not one in flight): its owner decided it is not worth writing after
        all. Counted as dropped. True when one was pending."""
        with self._cond:
            if not self._pending:
                return False
            item = self._pending.get(_key(tokens, ns))
            if item is None:
                return False
            self._remove_locked(item)
            self._c["dropped"] += 1
            self._cond.notify_all()
            return True

    def sole_pending_bytes(self) -> int:
        """Bytes of the pending spills (snapshots whose arrays nothing else holds), the one in flight included."""
        with self._cond:
            return self._sole_bytes

    def drop_spills(self, nbytes: int) -> int:
        """Drop pending spills, oldest first, until at least `nbytes` are given back (never the one in flight);
        returns the bytes dropped. For memory wanted now: a spill's snapshot is the only holder of its arrays."""
        dropped = 0
        with self._cond:
            while dropped < nbytes:
                spills = [p for p in self._pending.values() if p.sole]
                if not spills:
                    break
                oldest = min(spills, key=lambda p: p.created)
                self._remove_locked(oldest)
                dropped += oldest.nbytes
                self._c["dropped"] += 1
                self._c["spills_dropped"] += 1
            self._cond.notify_all()
        return dropped

    def set_gate(self, may_write: Callable[[], bool] | None) -> None:
        """Hold due snapshots back while ``may_write()`` is False (None: write whenever one is due). It is called on
        the writer thread: it must be cheap and thread-safe; one that raises counts as True."""
        with self._cond:
            self._may_write = may_write
            self._cond.notify_all()

    def is_durable(self, tokens: Sequence[int], ns: str) -> bool:
        """True when nothing is pending for these tokens and the store can serve all of them."""
        key = (ns, tuple(int(t) for t in tokens))
        with self._cond:
            if key in self._pending or (self._inflight is not None and self._inflight.key == key):
                return False
        return bool(self._store.covers(key[1], ns))

    def is_pending(self, tokens: Sequence[int], ns: str) -> bool:
        """True while a snapshot of exactly these tokens waits for (or is in) the writer."""
        key = (ns, tuple(int(t) for t in tokens))
        with self._cond:
            return key in self._pending or (self._inflight is not None and self._inflight.key == key)

    def pending(self) -> list[dict[str, Any]]:
        """What is not yet durable (in flight first), for /stats and the flush endpoint's 503 body."""
        now = self._clock()
        with self._cond:
            items = ([self._inflight] if self._inflight else []) + list(self._pending.values())
            return [{"ns_hash": kvfile.ns_hash(p.ns), "tokens": len(p.tokens), "age_s": round(now - p.created, 3),
                     "bytes": p.nbytes, "attempts": p.attempts, "in_flight": p is self._inflight} for p in items]

    def flush(self, timeout: float | None = None) -> bool:
        """Write everything pending now, ignoring the debounce (not the retry backoff), waiting up to `timeout`
        seconds. True when nothing is pending and no snapshot failed or was dropped during the flush."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            failed0, dropped0 = self._c["failed"], self._c["dropped"]
            self._cond.notify_all()
            try:
                while (self._pending or self._inflight) and self._thread.is_alive():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
                return (not self._pending and self._inflight is None and self._c["failed"] == failed0
                        and self._c["dropped"] == dropped0)
            finally:
                self._flushing -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to `timeout`), then stop the writer; later schedules are refused. Returns flush's result.
        Snapshots still pending after the timeout are abandoned (the store's next scan removes any temp file)."""
        start = time.monotonic()
        ok = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        self._thread.join(remaining)
        return ok

    def stats(self) -> dict[str, Any]:
        with self._cond:
            n = len(self._pending) + (self._inflight is not None)
            return {"pending": n, "pending_bytes": self._bytes, "sole_pending_bytes": self._sole_bytes, **self._c}

    # ---------------------------------------------------------------------------------------------- writer

    def _run(self) -> None:
        # created inside this thread (see the module docstring), on the default device: entering a stream
        # context sets MLX's process-wide default device, and a CPU stream would move the lane off the GPU
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            while True:
                item = self._next()
                if item is None:
                    return
                self._write(item)

    def _next(self) -> _Pending | None:
        """Block until a snapshot is due (or flushing), take it as in flight; None once closed."""
        with self._cond:
            while not self._closed:
                now = self._clock()
                urgent = self._flushing > 0
                ready = [p for p in self._pending.values() if p.not_before <= now and (urgent or p.due <= now)]
                if ready and not urgent and not self._gate_open():
                    self._c["gate_waits"] += 1
                    self._cond.wait(self._gate_poll)
                    continue
                if ready:
                    item = min(ready, key=lambda p: p.created)
                    del self._pending[item.key]
                    self._inflight = item
                    return item
                wakes = [max(p.not_before, 0.0 if urgent else p.due) for p in self._pending.values()]
                self._cond.wait(max(0.0, min(wakes) - now) if wakes else None)
            return None

    def _gate_open(self) -> bool:
        gate = self._may_write
        if gate is None:
            return True
        try:
            return bool(gate())
        except Exception:  # a broken gate must not stop the writes
            return True

    def _write(self, item: _Pending) -> None:
        try:
            ok = bool(self._store.write(item.tokens, item.snap, item.ns))
        except Exception as e:  # a store bug must not kill the writer thread
            self._warn_once(type(e).__name__, f"durability: store.write raised {e!r}")
            ok = False
        with self._cond:
            self._inflight = None
            item.attempts += 1
            if ok:
                self._release_locked(item)
                self._c["written"] += 1
            elif self._redundant_locked(item):
                self._release_locked(item)  # a newer snapshot of the same or a longer entry will be written
            elif item.attempts <= len(self._backoff):
                self._c["retries"] += 1
                item.not_before = self._clock() + self._backoff[item.attempts - 1]
                self._pending[item.key] = item
            else:
                self._release_locked(item)
                self._c["failed"] += 1
                log.warning("durability: giving up on %d tokens after %d attempts", len(item.tokens), item.attempts)
            self._cond.notify_all()

    def _bound_spills_locked(self, keep: _Pending) -> None:
        """Spills beyond their own bound: the oldest other than `keep` goes, until they fit or only it is left."""
        while self._sole_bytes > self._max_sole:
            spills = [p for p in self._pending.values() if p.sole and p is not keep]
            if not spills:
                break
            oldest = min(spills, key=lambda p: p.created)
            self._remove_locked(oldest)
            self._c["dropped"] += 1
            self._c["spills_dropped"] += 1

    def _redundant_locked(self, item: _Pending) -> bool:
        return any(p.supersedes(item) for p in self._pending.values())

    def _remove_locked(self, item: _Pending) -> None:
        if self._pending.pop(item.key, None) is not None:
            self._release_locked(item)

    def _release_locked(self, item: _Pending) -> None:
        """The snapshot no longer counts: written, dropped, replaced, given up on."""
        self._bytes -= item.nbytes
        if item.sole:
            self._sole_bytes -= item.nbytes

    def _warn_once(self, kind: str, message: str) -> None:
        with self._cond:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            log.warning(message)
