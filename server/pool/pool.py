"""The models a server answers to beyond its base model, loaded on first request and unloaded under a budget.

``ModelPool`` is the mechanism (entries, leases, one loader per model, the idle sweeper); what to evict and when to
wait is ``server.pool.policy.ResidencyPolicy``. The contract:

- ``lease = await pool.acquire(name)`` (or ``acquire_sync``): the model is loaded, or loads now, and stays resident
  while the lease is held (a request holds it from before it renders its prompt to its last byte). Requests for a
  model that is loading wait for that one load: a burst of N requests for an unloaded model loads it once.
  ``lease.release()`` (idempotent) when the request ends.
- Loading runs on a thread of its own, never on the lane: the lane keeps decoding the loaded models meanwhile, and
  the new model's sequences join once its weights are in (``loader(name, spec)`` returns a
  ``server.engine.slot.ModelSlot``).
- Room: before a load, the policy's plan evicts idle least-recently-used models; when the models in the way are in
  use, the load waits for a release; a model that can never fit is a ``ModelWontFit`` (400). A failed load is a
  ``ModelLoadFailed`` for every request that waited on it; the next request tries again.
- ``unload(name)`` (admin, the idle sweeper, an eviction): refused while the model is in use. The prefix cache is
  not touched: the model's RAM entries age out under the shared byte cap, its SSD files stay (namespaced by its
  fingerprint), so a reload hits what it had.

Thread-safe: HTTP handlers (event loop and thread pool), the loader threads, the sweeper and the lane (counters).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from server.catalog import AdapterCounters
from server.pool.policy import Resident, ResidencyPolicy

__all__ = ["ModelPool", "Lease", "ModelWontFit", "ModelLoadFailed", "ModelInUse", "PoolEntry", "discover_models"]

log = logging.getLogger("mlx_lane.pool")

LOAD_HOLD_S = 5.0  # how long a model just loaded stays held for the requests that waited on its load


class ModelWontFit(Exception):
    """The model can never be loaded under the pool's limits (the message says why)."""


class ModelLoadFailed(Exception):
    """Loading the model raised (the message says what)."""


class ModelInUse(Exception):
    """An unload asked for a model that requests hold."""


@dataclass
class PoolEntry:
    name: str
    spec: str  # what models.loading.load.load_model resolves: a directory, a .gguf file, a packaged name, a repo id
    pinned: bool = False
    slot: Any = None  # server.engine.slot.ModelSlot while loaded
    loading: Optional[concurrent.futures.Future] = None  # the one load in flight
    nbytes: int = 0  # weights: measured once loaded, estimated from the files before
    in_use: int = 0
    last_used: float = 0.0
    loads: int = 0
    unloads: int = 0
    load_s: float = 0.0  # seconds of the last load
    error: Optional[str] = None  # the last load's failure
    held_until: float = 0.0  # just loaded: kept for the requests that waited on the load until one takes it
    namespace: Optional[str] = None  # its cache namespace, known from its first load on (kept after an unload)
    counters: AdapterCounters = field(default_factory=AdapterCounters)

    @property
    def state(self) -> str:
        return "loaded" if self.slot is not None else "loading" if self.loading is not None else "not_loaded"


class Lease:
    """A request's hold on a loaded model (``slot``); ``release()`` once the request ends."""

    def __init__(self, pool: "ModelPool", entry: PoolEntry):
        self.pool, self.entry, self.slot = pool, entry, entry.slot
        self._released = False

    @property
    def name(self) -> str:
        return self.entry.name

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool._release(self.entry)

    def __del__(self):  # a safety net: a response whose stream never started still gives the model back
        try:
            self.release()
        except Exception:
            pass


def _shared_future() -> concurrent.futures.Future:
    """A future many requests wait on: marked running, so that one waiter's cancellation (its client left; asyncio's
    wrap_future cancels the source) cannot cancel it for the others."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


def estimate_nbytes(spec: str) -> int:
    """Weights' bytes before a first load: the size of the model's weight files (a GGUF file's own size)."""
    p = Path(spec).expanduser()
    try:
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.glob("*.safetensors"))
    except OSError:
        pass
    return 0


def discover_models(folder: str) -> dict[str, str]:
    """``--models-dir``: name -> spec for every mlx-lm model directory (has config.json) and ``.gguf`` file in it."""
    root = Path(folder).expanduser()
    found: dict[str, str] = {}
    try:
        children = sorted(root.iterdir())
    except OSError:
        return found
    for child in children:
        if child.name.startswith("."):
            continue
        if child.is_dir() and (child / "config.json").is_file():
            found[child.name] = str(child)
        elif child.is_file() and child.suffix.lower() == ".gguf":
            found[child.stem] = str(child)
    return found


class ModelPool:
    def __init__(self, specs: dict[str, str], loader: Callable[[str, str], Any], policy: ResidencyPolicy, *,
                 pinned: tuple[str, ...] = (), models_dir: Optional[str] = None, reserved: frozenset = frozenset(),
                 clock: Callable[[], float] = time.monotonic, on_unload: Callable[[], None] = lambda: None):
        self.policy = policy
        self.models_dir = models_dir
        self._reserved = frozenset(reserved)  # names the base model answers to: never an on-demand entry
        self._loader = loader
        self._clock = clock
        self._on_unload = on_unload  # give freed memory back (mx.clear_cache)
        self._lock = threading.Lock()
        self._entries: dict[str, PoolEntry] = {}
        self._changed = _shared_future()  # resolved (and replaced) on every release and unload
        self._stop = threading.Event()
        self._sweeper: Optional[threading.Thread] = None
        self._refreshed = float("-inf")  # monotonic time of the last --models-dir scan
        for name, spec in specs.items():
            if name not in self._reserved:
                self._entries[name] = PoolEntry(name, spec, nbytes=estimate_nbytes(spec))
        self.refresh()
        for name in pinned:
            if name not in self._entries:
                raise ValueError(f"--pin {name!r}: no such model (served: {', '.join(self.names()) or 'none'})")
            self._entries[name].pinned = True

    # -- names ------------------------------------------------------------------------------------------------
    def refresh(self, max_age_s: float = 1.0) -> None:
        """Pick up models added to ``--models-dir`` since start, at most once per ``max_age_s`` (unknown names
        arrive with every request of a client that a ``--model-alias`` answers). A model removed from the folder
        stays listed until restart; loading it then fails with what is missing."""
        if not self.models_dir:
            return
        now = time.monotonic()
        if now - self._refreshed < max_age_s:
            return
        self._refreshed = now
        for name, spec in discover_models(self.models_dir).items():
            with self._lock:
                if name not in self._entries and name not in self._reserved:
                    self._entries[name] = PoolEntry(name, spec, nbytes=estimate_nbytes(spec))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def knows(self, name: Optional[str]) -> bool:
        if not name:
            return False
        with self._lock:
            if name in self._entries:
                return True
        self.refresh()
        with self._lock:
            return name in self._entries

    def entries(self) -> list[PoolEntry]:
        with self._lock:
            return [self._entries[n] for n in sorted(self._entries)]

    def entry(self, name: str) -> Optional[PoolEntry]:
        with self._lock:
            return self._entries.get(name)

    def loaded_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.slot is not None)

    # -- leases -----------------------------------------------------------------------------------------------
    async def acquire(self, name: str) -> Lease:
        """The model ``name`` loaded and held (see the module docstring); awaits its load or the room for it."""
        while True:
            got = self._step(name)
            if isinstance(got, Lease):
                return got
            await asyncio.wrap_future(got)  # a failed load raises its ModelLoadFailed in every waiter

    def acquire_sync(self, name: str, timeout: Optional[float] = None) -> Lease:
        while True:
            got = self._step(name)
            if isinstance(got, Lease):
                return got
            got.result(timeout)

    def _step(self, name: str):
        """A lease, or a future to wait on (a load in flight, or the next release); starts the load when planned."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise KeyError(name)
            if entry.slot is not None:
                entry.in_use += 1
                entry.last_used = self._clock()
                entry.held_until = 0.0  # the load's hold passes to this lease
                return Lease(self, entry)
            if entry.loading is not None:
                return entry.loading
            plan = self.policy.plan_load(name, entry.nbytes, self._resident_locked())
            if plan.refuse:
                raise ModelWontFit(plan.refuse)
            if plan.wait:
                log.info("model %s waits for room: the models in the way are in use", name)
                return self._changed
            for victim in plan.evict:
                self._unload_locked(self._entries[victim], why=f"to make room for {name}")
            loading = entry.loading = _shared_future()
        if plan.evict:
            self._collect()
        threading.Thread(target=self._load, args=(entry,), name=f"load-{name}", daemon=True).start()
        return loading

    def _load(self, entry: PoolEntry) -> None:
        t0 = time.monotonic()
        log.info("loading model %s (%s) ...", entry.name, entry.spec)
        try:
            from server.engine.engine import weights_nbytes

            slot = self._loader(entry.name, entry.spec)
            slot.counters = entry.counters
            nbytes = weights_nbytes(slot.model)
        except BaseException as exc:  # every waiter of this load gets it; the next request tries again
            with self._lock:
                entry.error = f"{type(exc).__name__}: {exc}"
                future, entry.loading = entry.loading, None
                self._notify_locked()  # loads that waited for this one's room plan again
            log.error("loading model %s failed: %s", entry.name, entry.error)
            assert future is not None, "a load in progress has its future"
            future.set_exception(ModelLoadFailed(f"model '{entry.name}' could not be loaded: {exc}"))
            return
        with self._lock:
            entry.slot, entry.nbytes, entry.error = slot, nbytes, None
            entry.namespace = getattr(slot, "namespace", None)
            entry.loads += 1
            entry.load_s = time.monotonic() - t0
            entry.last_used = self._clock()
            entry.held_until = entry.last_used + LOAD_HOLD_S
            future, entry.loading = entry.loading, None
            self._notify_locked()
        log.info("model %s loaded in %.1f s (%.2f GiB)", entry.name, entry.load_s, nbytes / (1 << 30))
        assert future is not None, "a load in progress has its future"
        future.set_result(None)

    def _release(self, entry: PoolEntry) -> None:
        with self._lock:
            entry.in_use = max(0, entry.in_use - 1)
            entry.last_used = self._clock()
            self._notify_locked()

    def _notify_locked(self) -> None:
        changed, self._changed = self._changed, _shared_future()
        changed.set_result(None)

    def _resident_locked(self) -> list[Resident]:
        """What the policy plans over: the loaded models and those loading (which count, and cannot be evicted);
        a model just loaded counts as in use until a request that waited for it takes it (or LOAD_HOLD_S pass),
        so that a load waiting for room cannot evict it first."""
        now = self._clock()
        return [Resident(e.name, e.nbytes, e.last_used, e.in_use + (1 if e.loading is not None or now < e.held_until
                                                                      else 0), e.pinned)
                for e in self._entries.values() if e.slot is not None or e.loading is not None]

    # -- unloading --------------------------------------------------------------------------------------------
    def unload(self, name: str) -> bool:
        """Unload ``name`` now; False when it was not loaded. Raises ``ModelInUse`` while requests hold it."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise KeyError(name)
            if entry.slot is None:
                return False
            if entry.in_use:
                raise ModelInUse(f"model '{name}' is in use by {entry.in_use} request(s); it can be unloaded once "
                                 "they end")
            self._unload_locked(entry, why="on request")
        self._collect()
        return True

    def _unload_locked(self, entry: PoolEntry, why: str) -> None:
        entry.slot.release()
        entry.slot = None
        entry.unloads += 1
        log.info("model %s unloaded (%s)", entry.name, why)
        self._notify_locked()

    def _collect(self) -> None:
        gc.collect()
        try:
            self._on_unload()
        except Exception:
            log.exception("freeing memory after an unload failed")

    def sweep(self) -> list[str]:
        """Unload the models idle past the TTL; returns their names."""
        with self._lock:
            names = self.policy.expired(self._resident_locked(), self._clock())
            for name in names:
                self._unload_locked(self._entries[name], why=f"idle for {self.policy.ttl_s:g} s")
        if names:
            self._collect()
        return names

    def start(self) -> None:
        """Load the pinned models now, and start the idle sweeper when a TTL is set."""
        for e in self.entries():
            if e.pinned:
                self.acquire_sync(e.name).release()
        if self.policy.ttl_s and self._sweeper is None:
            period = max(0.05, min(5.0, self.policy.ttl_s / 4))
            self._sweeper = threading.Thread(target=self._sweep_loop, args=(period,), name="model-ttl", daemon=True)
            self._sweeper.start()

    def _sweep_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.sweep()
            except Exception:
                log.exception("model TTL sweep failed")

    def stop(self) -> None:
        self._stop.set()

    # -- observability ----------------------------------------------------------------------------------------
    def stats_block(self, cache_entries: Optional[dict] = None) -> dict:
        """The ``models`` block of /stats: each on-demand model, loaded or not. ``cache_entries``: the prefix
        cache's entries per namespace (``entries_by_namespace``), counted for each model's namespace."""
        now, wall = self._clock(), time.time()
        counts = cache_entries or {}
        out = {}
        for e in self.entries():
            ns = e.namespace
            out[e.name] = {
                "state": e.state, "loaded": e.slot is not None, "path": e.spec, "pinned": e.pinned,
                "in_use": e.in_use, "bytes": e.nbytes, "loads": e.loads, "unloads": e.unloads,
                "last_load_s": round(e.load_s, 3), "idle_s": round(now - e.last_used, 1) if e.last_used else None,
                "last_used_unix": round(wall - (now - e.last_used), 3) if e.last_used else None, "error": e.error,
                "fingerprint": ns[:16] if ns else None,
                "cache_entries": sum(n for k, n in counts.items() if ns and (k == ns or k.startswith(ns + "|"))),
                **e.counters.as_dict(),
            }
        return out
