"""The SSD cold tier: an index over KV files that survives restarts.

(About 525 lines on purpose: the index, its start-up scan, its sync with other processes and its deletions are one
contract over one dict and one lock; the lock protocol itself lives in `cache.filelocks`.)

Files are the database: `<root>/<fingerprint>/<ns_hash>/<uuid hex>.safetensors` (format: `cache.kvfile`). Only
hex strings become path components: the fingerprint is validated as hex, the namespace is hashed, file names are
generated. Nothing read from a file ever becomes a path.

Verbs (all thread-safe; the index is read from the lane / event loop and written by the durability writer):
  scan()                          start-up (the constructor runs it): read headers only; delete `*.tmp` and every
                                  unreadable, foreign or misplaced file (counted in `removed_at_scan`); index the rest.
  find(tokens, ns) -> SSDMatch    index only, no I/O. The RAM tier's rule (`cache.prefix.usable`): usable p =
                                  min(common prefix, len(tokens) - 1); an entry longer than p needs a trim, so it
                                  qualifies only if trimmable; an untrimmable entry matches only when wholly a prefix
                                  of the prompt. Longest p wins; ties go to the smaller trim, then the most recent.
  restore(match) -> Restored      read the file, trim to p; the caller owns the caches. None on any error (the
                                  entry leaves the index; a corrupt file is deleted).
  write(tokens, caches, ns)       atomic save + index + supersede (`cache.prefix.supersedes`: exact duplicate
                                  replaced; strict prefix-ancestors removed only when the new entry is trimmable) +
                                  byte cap (least recently used first, by file mtime). True when durable and indexed.
  covers(tokens, ns)              index only (`cache.prefix.covers`): an entry can serve `tokens` in full (same
                                  tokens, or a trimmable extension of them).
  sync()                          learn of files other processes added or removed since the last look (below).

Several processes on one root (replicas sharing a volume; `cache.filelocks` holds the lock protocol):
  * Learning of others' files: `sync()` stats the fingerprint folder and each namespace folder (one `stat` each,
    a few microseconds) and lists a folder only when its mtime moved since its last listing (a rename or unlink
    in it), or when the last listing was less than `_MTIME_SLACK` s after that mtime (coarse timestamps), or
    `resync_s` after the last listing (network volumes cache directory attributes). A listing reads the headers
    of the new names only and drops entries whose files are gone. Racing this process's writer, a listing may
    index the file the writer just renamed (the writer keeps that entry: a file never supersedes itself) but not
    one the writer dropped as superseded and has yet to unlink (dropped paths are remembered). The tiered cache
    calls it before each request's SSD lookup (its prefetch, on the event loop) and the writer calls it before
    enforcing the cap, so the cap is shared: every process counts every file. Nothing watches the directory in
    the background (inotify sees no other host's writes on a network volume).
  * Deleting: a file leaves the disk only through `filelocks.remove_unless_busy` (supersede, byte cap): a file
    that any process is restoring holds a shared lock and is skipped (it stays indexed and counts toward the cap,
    `evict_skipped_busy`), so the folder may exceed the cap by the files being read at that moment; the next
    write evicts again. Two processes evicting at once may both delete a file each, undershooting the cap.
  * Crash safety: the writer holds an exclusive lock on its `*.tmp` until after the rename, so a scan deletes
    only the temp files of dead writers (kill -9 releases the lock); a live writer's temp file is left alone and
    no temp file is ever indexed or loaded by anyone (only complete, renamed `*.safetensors` names are).

Internal updates: a restore touches the file's mtime (the LRU clock survives restarts). Eviction re-reads mtimes
from disk, so an mtime set from outside (tests, tools) counts.

Errors: disk errors (EROFS, ENOSPC, EIO, ...) never raise out of a verb; each kind is logged once, all are counted
in `stats()["failed"]`. MLX work runs on a stream owned by the calling thread (`thread_stream`: MLX work on the
default stream off the main thread can abort the process at exit, mlx 0.32 on Linux).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from cache import filelocks, kvfile
from cache.prefix import best_match, covers, supersedes

__all__ = ["SSDStore", "NullSSDStore", "SSDMatch", "Restored"]

log = logging.getLogger(__name__)

_HEX = re.compile(r"[0-9a-f]{8,128}")
_NS_DIR = re.compile(r"[0-9a-f]{16}")
_FILE = re.compile(r"[0-9a-f]{32}\.safetensors")
_EMA = 0.3  # weight of the newest sample in the restore-rate moving average
_MAX_DROPPED = 4096  # paths remembered as taken out of the index (see SSDStore._dropped)
_MTIME_SLACK = 1.0  # seconds: a folder listed this soon after its mtime is listed again (coarse timestamps)


@dataclass(frozen=True)
class SSDMatch:
    """A candidate found by `find`: restoring it yields caches covering `length` prompt tokens."""

    path: str
    ns: str
    length: int  # usable prefix p (0 < p <= len(prompt) - 1)
    entry_tokens: int  # tokens the file holds; the restore trims entry_tokens - length
    nbytes: int  # file size: what a restore reads
    trimmable: Any  # its reach (cache.prefix): True, False, or the positions it can be cut back to


class Restored(NamedTuple):
    """A restored entry: the caller owns `caches` (fresh objects, already trimmed to the match's length)."""

    caches: list
    nbytes: int
    seconds: float
    tokens: tuple[int, ...] = ()  # the tokens the caches cover (the file's tokens up to the match's length)


@dataclass
class _Entry:
    path: str
    ns: str
    tokens: np.ndarray
    size: int
    mtime: float
    trimmable: Any  # its reach (cache.prefix): True, False, or the positions it can be cut back to


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


_local = threading.local()


def thread_stream() -> Any:
    """This thread's own CPU stream (shared by the SSD store, the tiered cache's I/O threads)."""
    # One CPU stream per calling thread: MLX work on the default stream off the main thread can abort at exit.
    s = getattr(_local, "stream", None)
    if s is None:
        # on the process's default device: `with mx.stream(s)` also sets MLX's (process-wide) default
        # device, so a CPU stream here would move the generation lane onto the CPU of a GPU machine
        s = _local.stream = mx.new_stream(mx.default_device())
    return s


class SSDStore:
    """The cold tier of one model (fingerprint) under `root`, capped at `max_bytes` of files."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, max_bytes: int, *, scan: bool = True,
                 before_rename: Callable[[], None] | None = None, resync_s: float = 10.0) -> None:
        if not isinstance(fingerprint, str) or not _HEX.fullmatch(fingerprint):
            raise ValueError(f"fingerprint must be 8-128 lowercase hex digits, got {fingerprint!r}")
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.root = os.path.abspath(os.fspath(root))
        self.fingerprint = fingerprint
        self.max_bytes = int(max_bytes)
        self.dir = os.path.join(self.root, fingerprint)
        self._before_rename = before_rename  # test seam: runs on the writer between fsync and rename
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}  # path -> entry
        self._bytes = 0
        self._warned: set[str] = set()
        self._c = dict(restores=0, restore_ms_last=0.0, restore_mb_s=0.0, writes=0, write_ms_last=0.0, failed=0,
                       removed_at_scan=0, evictions=0, superseded=0, restore_misses=0)
        self._errors: dict[str, int] = {}
        self._resync_s = float(resync_s)
        self._listed: dict[str, tuple[int, float]] = {}  # folder -> (its mtime_ns, time.time()) at the last listing
        self._ignored: set[str] = set()  # paths a sync found unusable: not re-read (only a start-up scan deletes)
        # paths this process took out of the index (superseded, evicted, gone): their files are deleted or about to
        # be, and names are never reused, so a listing taken before the unlink must not index them again
        self._dropped: OrderedDict[str, None] = OrderedDict()
        self._c.update(syncs=0, synced_added=0, synced_dropped=0, evict_skipped_busy=0, tmp_in_progress=0)
        if scan:
            self.scan()

    # ----------------------------------------------------------------------------------------------- public

    def scan(self) -> int:
        """Rebuild the index from disk (headers only); return the number of files removed."""
        removed = in_progress = 0
        entries: dict[str, _Entry] = {}
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._mark_listed(self.dir)
            ns_dirs = list(os.scandir(self.dir))
        except OSError as e:
            self._disk_error("scan", e)
            ns_dirs = []
        for d in ns_dirs:
            if not d.is_dir(follow_symlinks=False):
                removed += self._remove_file(d.path)  # nothing but namespace folders belongs here
                continue
            if not _NS_DIR.fullmatch(d.name):
                continue  # not ours to delete wholesale; never indexed
            try:
                self._mark_listed(d.path)
                files = list(os.scandir(d.path))
            except OSError as e:
                self._disk_error("scan", e)
                continue
            for f in files:
                if f.name.endswith(".tmp") and not filelocks.abandoned(f.path):
                    in_progress += 1  # another process is writing it right now: its file, not ours to delete
                    continue
                entry = self._scan_one(f, d.name)
                if entry is None:
                    removed += self._remove_file(f.path)
                else:
                    entries[entry.path] = entry
        with self._lock:
            self._entries = entries
            self._bytes = sum(e.size for e in entries.values())
            self._c["removed_at_scan"] += removed
            self._c["tmp_in_progress"] = in_progress
            victims = self._over_cap_locked()
        self._unlink_all(victims)
        return removed

    def find(self, tokens: Sequence[int], ns: str) -> SSDMatch | None:
        """The best usable entry for prompt `tokens` in namespace `ns`, or None. Index only: no I/O."""
        prompt = _ids(tokens)
        cap = len(prompt) - 1  # the last prompt token is always forwarded
        if cap <= 0:
            return None
        with self._lock:  # cache.prefix: the RAM tier's rule too
            found = best_match(prompt, ((e, e.tokens, e.trimmable, e.mtime) for e in self._entries.values()
                                        if e.ns == ns))
            if found is None:
                return None
            e, use = found
            return SSDMatch(e.path, e.ns, use.length, len(e.tokens), e.size, e.trimmable)

    def restore(self, match: SSDMatch) -> Restored | None:
        """Read `match` and trim it to `match.length`. None (never an exception) when it cannot be used."""
        with self._lock:
            entry = self._entries.get(match.path)
        if entry is None or entry.ns != match.ns:
            return None  # evicted or superseded since find; only indexed paths are ever read
        t0 = time.perf_counter()
        try:
            with filelocks.reading(entry.path):  # no process deletes it while we read (cache.filelocks)
                f = kvfile.load(entry.path, expect_fingerprint=self.fingerprint, expect_ns=entry.ns,
                                stream=thread_stream())
            if len(f.tokens) != len(entry.tokens) or not np.array_equal(_ids(f.tokens), entry.tokens):
                raise kvfile.KVFileError("tokens differ from the index")
        except FileNotFoundError:
            self._forget(entry)
            with self._lock:
                self._c["restore_misses"] += 1
            return None
        except kvfile.KVFileError as e:
            log.warning("ssd cache: removing unusable file %s: %s", entry.path, e)
            self._forget(entry)
            self._remove_file(entry.path)
            with self._lock:
                self._c["failed"] += 1
            return None
        except OSError as e:
            self._disk_error("restore", e)
            self._forget(entry)
            return None
        trim = len(entry.tokens) - match.length
        if trim:
            for c in f.caches:
                c.trim(trim)
        seconds = time.perf_counter() - t0
        now = time.time()
        try:
            os.utime(entry.path, (now, now))  # the LRU clock lives in the file system
        except OSError:
            pass
        with self._lock:
            entry.mtime = now
            c = self._c
            c["restores"] += 1
            c["restore_ms_last"] = seconds * 1e3
            rate = entry.size / max(seconds, 1e-9) / 1e6
            c["restore_mb_s"] = rate if c["restores"] == 1 else _EMA * rate + (1 - _EMA) * c["restore_mb_s"]
        return Restored(f.caches, entry.size, seconds, tuple(int(t) for t in f.tokens[: match.length]))

    def write(self, tokens: Sequence[int], caches: Sequence[Any] | kvfile.Encoded, ns: str) -> bool:
        """Persist one entry (caches covering exactly `tokens`). True when durable and indexed; never raises
        for disk errors (counted, logged once per kind). Meant for the durability writer thread."""
        ids = _ids(tokens)
        if len(ids) == 0:
            return False
        t0 = time.perf_counter()
        self.sync()  # other processes' files count toward the shared cap and may be superseded
        folder = os.path.join(self.dir, kvfile.ns_hash(ns))
        path = os.path.join(folder, uuid.uuid4().hex + ".safetensors")
        try:
            os.makedirs(folder, exist_ok=True)
            with mx.stream(thread_stream()):
                enc = caches if isinstance(caches, kvfile.Encoded) else kvfile.encode(caches)
                size = kvfile.save(path, ids.tolist(), enc, fingerprint=self.fingerprint, ns=ns,
                                   before_rename=self._before_rename)
            mtime = os.stat(path).st_mtime
        except OSError as e:
            self._disk_error("write", e)
            return False
        entry = _Entry(path, ns, ids, size, mtime, enc.trimmable)
        with self._lock:
            # not the entry of this very file: a concurrent sync (another thread's flush or prefetch) may have indexed
            # it between the rename and here, and it "supersedes" itself (same tokens): unlinking it lost the write
            victims = [e for p, e in self._entries.items()
                       if p != path and e.ns == ns and supersedes(ids, entry.trimmable, e.tokens, old_trimmable=e.trimmable)]
            for v in victims:
                self._drop_locked(v)
            self._c["superseded"] += len(victims)
            if path not in self._entries:  # a concurrent sync may have indexed the renamed file already
                self._bytes += size
            self._entries[path] = entry
            over = self._bytes > self.max_bytes
        if over:
            self._refresh_mtimes()  # file-system I/O stays outside the lock find() needs
        with self._lock:
            victims += self._over_cap_locked()
            self._c["writes"] += 1
            self._c["write_ms_last"] = (time.perf_counter() - t0) * 1e3
            durable = path in self._entries
        self._unlink_all(victims)
        return durable

    def covers(self, tokens: Sequence[int], ns: str) -> bool:
        """True when an indexed entry can serve all of `tokens`: the same tokens, or a trimmable extension."""
        ids = _ids(tokens)
        with self._lock:
            return any(e.ns == ns and covers(e.tokens, e.trimmable, ids) for e in self._entries.values())

    def sync(self) -> tuple[int, int]:
        """Learn of files other processes sharing the root added or removed; returns (added, dropped).

        Cheap when nothing changed: one stat per folder (see the module docstring for when a folder is listed).
        Never deletes anything: only the start-up scan deletes foreign or broken files."""
        added = dropped = 0
        try:
            folders = [self.dir] if self._stale(self.dir) else []
            if folders:
                self._mark_listed(self.dir)
                ns_dirs = [d.path for d in os.scandir(self.dir)
                           if _NS_DIR.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]
            else:
                ns_dirs = [d for d in list(self._listed) if d != self.dir]  # list(): the writer may add one
        except OSError as e:
            self._disk_error("sync", e)
            return 0, 0
        for folder in ns_dirs:
            if not self._stale(folder):
                continue
            try:
                self._mark_listed(folder)
                names = {f.name: f for f in os.scandir(folder) if _FILE.fullmatch(f.name)}
            except FileNotFoundError:
                names = {}
            except OSError as e:
                self._disk_error("sync", e)
                continue
            a, d = self._merge_listing(folder, names)
            added, dropped = added + a, dropped + d
        if added or dropped:
            with self._lock:
                self._c["synced_added"] += added
                self._c["synced_dropped"] += dropped
        return added, dropped

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"dir": self.dir, "entries": len(self._entries), "bytes": self._bytes,
                    "max_bytes": self.max_bytes, **self._c, "errors": dict(self._errors)}

    # ---------------------------------------------------------------------------------------------- helpers

    def _scan_one(self, f: os.DirEntry, folder: str) -> _Entry | None:
        """An index entry for a valid file, else None (the caller deletes it)."""
        if not f.is_file(follow_symlinks=False) or not _FILE.fullmatch(f.name):
            return None  # *.tmp from a crash, foreign names, links
        try:
            h = kvfile.read_header(f.path, expect_fingerprint=self.fingerprint)
            st = os.stat(f.path)
        except kvfile.KVFileError:
            return None
        except OSError as e:
            self._disk_error("scan", e)
            return None
        if h.ns_hash != folder or not h.tokens:
            return None  # misplaced: its namespace does not hash to its folder
        return _Entry(f.path, h.ns, _ids(h.tokens), st.st_size, st.st_mtime, h.trimmable)

    def _stale(self, folder: str) -> bool:
        """True when `folder` may hold changes the index has not seen (module docstring: when a folder is listed)."""
        seen = self._listed.get(folder)
        if seen is None:
            return True
        try:
            mtime_ns = os.stat(folder).st_mtime_ns
        except FileNotFoundError:
            return True
        mtime_then, listed_at = seen
        return (mtime_ns != mtime_then or listed_at - mtime_ns / 1e9 < _MTIME_SLACK
                or time.time() - listed_at > self._resync_s)

    def _mark_listed(self, folder: str) -> None:
        """Record the folder's mtime before listing it: a change during the listing shows as a newer mtime."""
        self._listed[folder] = (os.stat(folder).st_mtime_ns, time.time())
        with self._lock:
            self._c["syncs"] += 1

    def _merge_listing(self, folder: str, names: dict[str, os.DirEntry]) -> tuple[int, int]:
        """Index the new valid files of one namespace folder's listing, drop entries whose files are gone."""
        prefix = folder + os.sep
        with self._lock:
            known = {os.path.basename(p) for p in self._entries if p.startswith(prefix)}
            known.update(os.path.basename(p) for p in self._dropped if p.startswith(prefix))
        new = [f for name, f in names.items() if name not in known and f.path not in self._ignored]
        entries = []
        for f in new:
            entry = self._scan_one(f, os.path.basename(folder))
            if entry is None:
                self._ignored.add(f.path)  # broken or foreign: left for the start-up scan, never read again
            else:
                entries.append(entry)
        with self._lock:
            missing = [e for p, e in self._entries.items() if p.startswith(prefix) and os.path.basename(p) not in names]
        # a file this process renamed after the listing is missing from it too: only a failed stat means gone
        gone = [e for e in missing if not os.path.exists(e.path)]
        with self._lock:
            for e in gone:
                self._drop_locked(e)
            # not one dropped while this listing was read (a writer superseding it, before its unlink)
            entries = [e for e in entries if e.path not in self._entries and e.path not in self._dropped]
            for e in entries:
                self._entries[e.path] = e
                self._bytes += e.size
        return len(entries), len(gone)

    def _over_cap_locked(self) -> list[_Entry]:
        """Drop least recently used entries until under the cap; return them for unlinking outside the lock."""
        if self._bytes <= self.max_bytes:
            return []
        victims = []
        for e in sorted(self._entries.values(), key=lambda e: e.mtime):
            if self._bytes <= self.max_bytes:
                break
            self._drop_locked(e)
            victims.append(e)
        self._c["evictions"] += len(victims)
        return victims

    def _refresh_mtimes(self) -> None:
        """Re-read mtimes before evicting: touches made from outside this process count as use."""
        with self._lock:
            entries = list(self._entries.values())
        for e in entries:
            try:
                e.mtime = os.stat(e.path).st_mtime
            except OSError:
                pass

    def _drop_locked(self, e: _Entry) -> None:
        if self._entries.pop(e.path, None) is not None:
            self._bytes -= e.size
            self._dropped[e.path] = None
            while len(self._dropped) > _MAX_DROPPED:
                self._dropped.popitem(last=False)

    def _forget(self, e: _Entry) -> None:
        with self._lock:
            self._drop_locked(e)

    def _unlink_all(self, entries: list[_Entry]) -> None:
        """Delete the files of entries already dropped from the index; one that another process is reading stays
        on disk and back in the index (it still counts toward the cap; a later write evicts it)."""
        busy = []
        for e in entries:
            try:
                if filelocks.remove_unless_busy(e.path) is False:
                    busy.append(e)
            except OSError as exc:
                self._disk_error("delete", exc)
        if busy:
            with self._lock:
                self._c["evict_skipped_busy"] += len(busy)
                for e in busy:
                    self._dropped.pop(e.path, None)
                    if e.path not in self._entries:
                        self._entries[e.path] = e
                        self._bytes += e.size

    def _remove_file(self, path: str) -> int:
        try:
            os.unlink(path)
            return 1
        except FileNotFoundError:
            return 0
        except OSError as e:
            self._disk_error("delete", e)
            return 0

    def _disk_error(self, op: str, exc: OSError) -> None:
        kind = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        with self._lock:
            self._c["failed"] += 1
            self._errors[kind] = self._errors.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:  # once per kind: a full disk must not flood the log on every write
            log.warning("ssd cache: %s failed (%s: %s); serving from RAM, further %s errors are only counted",
                        op, kind, exc, kind)


class NullSSDStore:
    """The cold tier switched off: never finds, never stores."""

    dir = None

    def scan(self) -> int:
        return 0

    def find(self, tokens: Sequence[int], ns: str) -> SSDMatch | None:
        return None

    def restore(self, match: SSDMatch) -> Restored | None:
        return None

    def write(self, tokens: Sequence[int], caches: Any, ns: str) -> bool:
        return False

    def covers(self, tokens: Sequence[int], ns: str) -> bool:
        return False

    def sync(self) -> tuple[int, int]:
        return 0, 0

    def stats(self) -> dict[str, Any]:
        return {"dir": None, "entries": 0, "bytes": 0, "max_bytes": 0}
