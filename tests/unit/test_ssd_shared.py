"""Several processes on one SSD cache folder (replicas on a shared volume): the index learns of others' files, the
shared byte cap never deletes a file being read, and a writer killed mid-write leaves nothing anyone loads.

Two SSDStore objects on one root stand for two replicas (flock locks conflict between open files of one process
exactly as between processes); the kill -9 case uses a real second process. No model needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from cache import filelocks
from cache.ssd_store import SSDStore
from tests.unit.test_ssd_store import FP, NS, caches, toks

ROOT = Path(__file__).resolve().parents[2]


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


def age_folders(store: SSDStore, seconds: float = 60.0) -> None:
    """Set every folder's mtime into the past, as if nothing had changed for a while."""
    past = time.time() - seconds
    for d in [Path(store.dir), *Path(store.dir).iterdir()]:
        os.utime(d, (past, past))


def test_a_replica_learns_of_files_another_wrote_and_restores_them(tmp_path):
    a, b = SSDStore(tmp_path, FP, 1 << 30), SSDStore(tmp_path, FP, 1 << 30)
    prompt = toks((1, 21), [99])
    assert a.write(toks((1, 21)), caches(20), NS)
    assert b.find(prompt, NS) is None  # find is index-only: b has not looked yet
    assert b.sync() == (1, 0)
    m = b.find(prompt, NS)
    assert (m.length, m.entry_tokens) == (20, 20)
    r = b.restore(m)
    assert r is not None and [c.offset for c in r.caches] == [20, 20]
    assert b.stats()["synced_added"] == 1


def test_a_replica_forgets_files_another_removed(tmp_path):
    a, b = SSDStore(tmp_path, FP, 1 << 30), SSDStore(tmp_path, FP, 1 << 30)
    a.write(toks((1, 11)), caches(10), NS)
    b.sync()
    assert a.write(toks((1, 16)), caches(15), NS)  # trimmable extension: a supersedes (deletes) the first file
    assert len(files(tmp_path)) == 1
    assert b.sync() == (1, 1)
    assert b.stats()["entries"] == 1 and b.find(toks((1, 11)), NS).entry_tokens == 15


def test_sync_lists_nothing_while_no_folder_changed(tmp_path):
    a, b = SSDStore(tmp_path, FP, 1 << 30), SSDStore(tmp_path, FP, 1 << 30, resync_s=3600)
    a.write(toks((1, 11)), caches(10), NS)
    b.sync()
    age_folders(b)
    b.sync()  # the aged mtimes differ from the recorded ones: one more listing of each folder
    listings = b.stats()["syncs"]
    assert b.sync() == (0, 0) and b.sync() == (0, 0)
    assert b.stats()["syncs"] == listings  # only stats, no listing
    a.write(toks((50, 60)), caches(10, seed=3), NS)  # a rename into the folder moves its mtime
    assert b.sync() == (1, 0) and b.stats()["syncs"] > listings


def test_the_shared_cap_counts_every_replicas_files(tmp_path):
    a = SSDStore(tmp_path, FP, 1 << 30)
    a.write(toks((100, 110)), caches(10, seed=1), NS)
    size = a.stats()["bytes"]
    cap = int(2.5 * size)
    a, b = SSDStore(tmp_path, FP, cap), SSDStore(tmp_path, FP, cap)
    a.write(toks((200, 210)), caches(10, seed=2), NS)
    first = min(files(tmp_path), key=lambda p: p.stat().st_mtime_ns)  # the least recently used file
    assert b.write(toks((300, 310)), caches(10, seed=3), NS)  # b's own index alone would hold 1 file: under cap
    assert len(files(tmp_path)) == 2 and not first.exists()  # b counted a's two files and evicted the oldest
    assert b.stats()["evictions"] == 1 and b.stats()["bytes"] <= cap


def test_eviction_never_deletes_a_file_another_replica_is_reading(tmp_path):
    a = SSDStore(tmp_path, FP, 1 << 30)
    a.write(toks((100, 110)), caches(10, seed=1), NS)
    size = a.stats()["bytes"]
    writer = SSDStore(tmp_path, FP, int(2.5 * size))
    writer.write(toks((200, 210)), caches(10, seed=2), NS)
    lru = files(tmp_path)
    past = time.time() - 100
    victim = lru[0]
    os.utime(victim, (past, past))  # the least recently used file: the cap's first victim
    with filelocks.reading(str(victim)):  # "another replica" is restoring it right now
        assert writer.write(toks((300, 310)), caches(10, seed=3), NS)
        assert victim.exists(), "evicted while being read"
        assert writer.stats()["evict_skipped_busy"] == 1
    # once the read is over, the next write evicts it
    assert writer.write(toks((400, 410)), caches(10, seed=4), NS)
    assert not victim.exists() and len(files(tmp_path)) == 2


def test_a_restore_of_a_file_another_replica_deleted_is_a_clean_miss(tmp_path):
    a, b = SSDStore(tmp_path, FP, 1 << 30), SSDStore(tmp_path, FP, 1 << 30)
    a.write(toks((1, 11)), caches(10), NS)
    b.sync()
    m = b.find(toks((1, 11), [5]), NS)
    assert filelocks.remove_unless_busy(m.path) is True  # a's eviction, between b's find and b's restore
    assert b.restore(m) is None and b.stats()["restore_misses"] == 1 and b.stats()["failed"] == 0
    assert b.find(toks((1, 11), [5]), NS) is None


def test_a_scan_leaves_a_live_writers_temp_file_alone_and_never_indexes_it(tmp_path):
    held, release = threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(30)

    a = SSDStore(tmp_path, FP, 1 << 30, before_rename=hold)
    result = []
    t = threading.Thread(target=lambda: result.append(a.write(toks((1, 11)), caches(10), NS)))
    t.start()
    try:
        assert held.wait(30)
        tmp = list(tmp_path.rglob("*.tmp"))
        assert len(tmp) == 1
        b = SSDStore(tmp_path, FP, 1 << 30)  # a replica starting now: its scan sees a temp file in progress
        assert tmp[0].exists() and b.stats()["removed_at_scan"] == 0 and b.stats()["tmp_in_progress"] == 1
        b.sync()
        assert b.find(toks((1, 11), [5]), NS) is None and b.stats()["entries"] == 0
    finally:
        release.set()
        t.join(30)
    assert result == [True]
    b.sync()
    assert b.find(toks((1, 11), [5]), NS).length == 10


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from cache.ssd_store import SSDStore
    from tests.unit.test_ssd_store import FP, NS, caches, toks
    s = SSDStore(sys.argv[2], FP, 1 << 30, before_rename=lambda: time.sleep(600))
    s.write(toks((1, 11)), caches(10), NS)
""")


def test_kill_9_of_one_writer_leaves_no_file_that_any_replica_loads(tmp_path):
    survivor = SSDStore(tmp_path, FP, 1 << 30)
    survivor.write(toks((500, 510)), caches(10, seed=5), NS)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(ROOT), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.rglob("*.tmp")):
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never started its write"
            time.sleep(0.01)
        tmp = list(tmp_path.rglob("*.tmp"))[0]
        # alive: its lock is held (taken just after the file is created: the file can show before the lock does)
        while filelocks.abandoned(str(tmp)):
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never locked its temp file"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert filelocks.abandoned(str(tmp))  # kill -9 released it
    survivor.sync()
    assert survivor.find(toks((1, 11), [5]), NS) is None  # the torn write is invisible to the running replica
    restarted = SSDStore(tmp_path, FP, 1 << 30)  # a replica (re)starting now cleans it up
    assert not tmp.exists() and restarted.stats()["removed_at_scan"] == 1
    assert restarted.stats()["entries"] == 1 and restarted.find(toks((1, 11), [5]), NS) is None
    assert survivor.restore(survivor.find(toks((500, 510), [5]), NS)) is not None
