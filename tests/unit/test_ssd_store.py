"""cache.ssd_store: scan, find rules, supersede, LRU byte cap, restart, disk errors. No model needed."""

from __future__ import annotations

import errno
import logging
import os
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from cache import filelocks, kvfile
from cache.ssd_store import NullSSDStore, SSDStore

FP = "00ff00ff00ff"
NS = "ns-a"


def caches(n, *, trimmable=True, seed=0):
    """Two layers covering n tokens; an ArraysCache layer makes the entry untrimmable."""
    kv = KVCache()
    key = mx.random.key(seed + n)
    kv.update_and_fetch(mx.random.normal((1, 2, n, 8), key=key), mx.random.normal((1, 2, n, 8), key=key + 1))
    if trimmable:
        other = KVCache()
        other.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    else:
        other = ArraysCache(1)
        other[0] = mx.full((1, 4), float(n))
    return [kv, other]


def toks(*spans):
    out = []
    for s in spans:
        out.extend(range(*s) if isinstance(s, tuple) else s)
    return out


@pytest.fixture
def store(tmp_path):
    return SSDStore(tmp_path, FP, max_bytes=1 << 30)


def files(store):
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(store.dir) for f in fs)


def test_write_find_restore_round_trip(store):
    src = caches(10)
    assert store.write(toks((1, 11)), src, NS)
    m = store.find(toks((1, 11), [11, 12]), NS)
    assert (m.length, m.entry_tokens, m.trimmable) == (10, 10, True)
    r = store.restore(m)
    assert r.nbytes == os.path.getsize(m.path) and r.seconds > 0
    assert [c.offset for c in r.caches] == [10, 10]
    assert mx.array_equal(r.caches[0].keys, src[0].keys[..., :10, :]).item()
    s = store.stats()
    assert (s["entries"], s["restores"], s["writes"], s["failed"]) == (1, 1, 1, 0)
    assert s["restore_mb_s"] > 0 and s["bytes"] == r.nbytes


def test_restore_trims_to_usable_prefix(store):
    src = caches(8)
    store.write(toks((1, 9)), src, NS)
    m = store.find(toks((1, 6), [99, 100]), NS)  # common prefix 5
    assert m.length == 5
    r = store.restore(m)
    assert [c.offset for c in r.caches] == [5, 5]
    assert mx.array_equal(r.caches[0].keys[..., :5, :], src[0].keys[..., :5, :]).item()


# (entries as (tokens, trimmable), prompt, expected (entry tokens, p) or None)
FIND_CASES = {
    "len_minus_one_cap": ([(toks((1, 9)), True)], toks((1, 9)), (toks((1, 9)), 7)),
    "untrimmable_needs_trim": ([(toks((1, 9)), False)], toks((1, 9)), None),
    "untrimmable_whole_prefix": ([(toks((1, 9)), False)], toks((1, 10)), (toks((1, 9)), 8)),
    "untrimmable_diverges": ([(toks((1, 9)), False)], toks((1, 6), [99, 98]), None),
    "trimmable_diverges": ([(toks((1, 9)), True)], toks((1, 6), [99, 98]), (toks((1, 9)), 5)),
    "longest_wins": ([(toks((1, 5)), True), (toks((1, 9)), True)], toks((1, 7), [50]), (toks((1, 9)), 6)),
    # mlx-bun's restart-0 defect: the long untrimmable entry would need a trim, so the short one must win
    "untrimmable_never_ranked": ([(toks((1, 11)), False), (toks((1, 4)), True)], toks((1, 7), [99]),
                                 (toks((1, 4)), 3)),
    "tie_prefers_no_trim": ([(toks((1, 9)), True), (toks((1, 7)), True)], toks((1, 7), [42]), (toks((1, 7)), 6)),
    "no_common_prefix": ([(toks((1, 9)), True)], toks((50, 60)), None),
    "one_token_prompt": ([(toks((1, 9)), True)], [1], None),
}


@pytest.mark.parametrize("name", sorted(FIND_CASES))
def test_find_rules(store, name):
    entries, prompt, want = FIND_CASES[name]
    for i, (t, trimmable) in enumerate(entries):
        assert store.write(t, caches(len(t), trimmable=trimmable, seed=i), NS)
    m = store.find(prompt, NS)
    if want is None:
        assert m is None
    else:
        assert (m.entry_tokens, m.length) == (len(want[0]), want[1])
        assert m.trimmable is dict((len(t), tr) for t, tr in entries)[len(want[0])]
        assert store.restore(m) is not None


def test_namespaces_are_isolated(store):
    store.write(toks((1, 9)), caches(8), "ns-a")
    assert store.find(toks((1, 12)), "ns-b") is None
    assert store.find(toks((1, 12)), "ns-a").length == 8


SUPERSEDE_CASES = {
    # (first tokens, first trimmable, second tokens, second trimmable, first survives)
    "trimmable_child_drops_ancestor": ((1, 5), True, (1, 9), True, False),
    "trimmable_child_drops_untrimmable_ancestor": ((1, 5), False, (1, 9), True, False),
    "untrimmable_child_keeps_ancestor": ((1, 5), True, (1, 9), False, True),
    "exact_duplicate_replaced": ((1, 9), False, (1, 9), False, False),
    "sibling_kept": ((1, 5), True, (2, 9), True, True),
    "descendant_kept": ((1, 9), True, (1, 5), True, True),
}


@pytest.mark.parametrize("name", sorted(SUPERSEDE_CASES))
def test_supersede_rules(store, name):
    a, a_trim, b, b_trim, survives = SUPERSEDE_CASES[name]
    store.write(toks(a), caches(a[1] - a[0], trimmable=a_trim), NS)
    (first,) = files(store)
    store.write(toks(b), caches(b[1] - b[0], trimmable=b_trim, seed=1), NS)
    assert os.path.exists(first) is survives
    assert store.stats()["entries"] == (2 if survives else 1)
    assert len(files(store)) == store.stats()["entries"]


def test_other_namespace_is_never_superseded(store):
    store.write(toks((1, 5)), caches(4), "ns-a")
    store.write(toks((1, 9)), caches(8), "ns-b")
    assert store.stats()["entries"] == 2


def test_byte_cap_evicts_least_recently_used_by_mtime(tmp_path):
    store = SSDStore(tmp_path, FP, max_bytes=1 << 30)
    for i in range(3):
        store.write(toks([100 + i], (1, 8)), caches(8, seed=i), NS)
    size = store.stats()["bytes"] // 3
    by_i = {i: store.find(toks([100 + i], (1, 9)), NS).path for i in range(3)}
    for i, t in ((0, 3000), (1, 1000), (2, 2000)):  # entry 1 is the least recently used
        os.utime(by_i[i], (t, t))
    store.max_bytes = 3 * size + size // 2
    store.write(toks([103], (1, 8)), caches(8, seed=3), NS)
    assert not os.path.exists(by_i[1]) and os.path.exists(by_i[0]) and os.path.exists(by_i[2])
    s = store.stats()
    assert (s["entries"], s["evictions"]) == (3, 1) and s["bytes"] <= s["max_bytes"]
    assert store.find(toks([101], (1, 9)), NS) is None


def test_restore_touches_mtime(store):
    store.write(toks((1, 9)), caches(8), NS)
    m = store.find(toks((1, 12)), NS)
    os.utime(m.path, (1000, 1000))
    assert store.restore(m) is not None
    assert os.path.getmtime(m.path) > 1000


def test_entry_larger_than_cap_is_not_kept(tmp_path):
    store = SSDStore(tmp_path, FP, max_bytes=100)
    assert store.write(toks((1, 9)), caches(8), NS) is False
    assert store.stats()["entries"] == 0 and files(store) == []


def test_restart_finds_entries(tmp_path):
    a = SSDStore(tmp_path, FP, max_bytes=1 << 30)
    a.write(toks((1, 9)), caches(8), NS)
    a.write(toks((1, 9)), caches(8, trimmable=False), "ns-b")
    b = SSDStore(tmp_path, FP, max_bytes=1 << 30)
    s = b.stats()
    assert (s["entries"], s["bytes"], s["removed_at_scan"]) == (2, a.stats()["bytes"], 0)
    m = b.find(toks((1, 12)), "ns-b")
    assert (m.length, m.trimmable) == (8, False)
    assert b.restore(m) is not None
    assert SSDStore(tmp_path, "ffffffff", max_bytes=1 << 30).stats()["entries"] == 0  # another model sees none


def test_restart_with_smaller_cap_evicts(tmp_path):
    a = SSDStore(tmp_path, FP, max_bytes=1 << 30)
    a.write(toks((1, 9)), caches(8), NS)
    a.write(toks((2, 10)), caches(8), NS)
    b = SSDStore(tmp_path, FP, max_bytes=a.stats()["bytes"] // 2 + 1)
    assert b.stats()["entries"] == 1


def test_scan_removes_bad_files_and_counts_them(tmp_path):
    good = SSDStore(tmp_path, FP, max_bytes=1 << 30)
    good.write(toks((1, 9)), caches(8), NS)
    (keep,) = files(good)
    folder = os.path.dirname(keep)
    other = SSDStore(tmp_path, "abcdef01", max_bytes=1 << 30)
    other.write(toks((1, 9)), caches(8), NS)
    (other_file,) = files(other)
    bad = {
        "crash.safetensors.tmp": b"partial",
        "0" * 32 + ".safetensors": os.urandom(256),  # random bytes under a valid name
        "notes.txt": b"hello",
    }
    for name, data in bad.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    foreign = os.path.join(folder, "1" * 32 + ".safetensors")
    mx.save_safetensors(foreign, {"w": mx.ones((2,))})
    with open(other_file, "rb") as src, open(os.path.join(folder, "2" * 32 + ".safetensors"), "wb") as dst:
        dst.write(src.read())  # wrong fingerprint
    misplaced_dir = os.path.join(good.dir, "0123456789abcdef")
    os.makedirs(misplaced_dir)
    with open(keep, "rb") as src, open(os.path.join(misplaced_dir, "3" * 32 + ".safetensors"), "wb") as dst:
        dst.write(src.read())  # its namespace does not hash to this folder
    with open(os.path.join(good.dir, "stray"), "wb") as f:
        f.write(b"x")
    s = SSDStore(tmp_path, FP, max_bytes=1 << 30)
    assert s.stats()["removed_at_scan"] == 7
    assert files(s) == [keep]
    assert s.stats()["entries"] == 1
    assert os.path.exists(other_file)  # another model's files are not ours to judge


def test_corrupt_file_after_indexing_is_removed_on_restore(store):
    store.write(toks((1, 9)), caches(8), NS)
    m = store.find(toks((1, 12)), NS)
    with open(m.path, "r+b") as f:
        f.truncate(os.path.getsize(m.path) - 10)
    assert store.restore(m) is None
    assert not os.path.exists(m.path)
    assert store.find(toks((1, 12)), NS) is None
    assert store.stats()["failed"] == 1


def test_restore_after_eviction_is_a_miss(store):
    store.write(toks((1, 9)), caches(8), NS)
    m = store.find(toks((1, 12)), NS)
    store.write(toks((1, 11)), caches(10), NS)  # supersedes the entry m points at
    assert store.restore(m) is None


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_write_disk_errors_are_counted_not_raised(store, monkeypatch, caplog, code):
    def fail(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "replace", fail)
    with caplog.at_level(logging.WARNING, logger="cache.ssd_store"):
        assert store.write(toks((1, 9)), caches(8), NS) is False
        assert store.write(toks((1, 5)), caches(4), NS) is False
    s = store.stats()
    assert (s["failed"], s["entries"], s["errors"]) == (2, 0, {errno.errorcode[code]: 2})
    assert len([r for r in caplog.records if r.name == "cache.ssd_store"]) == 1  # warned once per kind
    assert files(store) == []  # no temp files left


def test_restore_io_error_is_counted_not_raised(store, monkeypatch):
    store.write(toks((1, 9)), caches(8), NS)
    m = store.find(toks((1, 12)), NS)

    def eio(*a, **k):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(kvfile, "read_header", eio)
    assert store.restore(m) is None
    assert store.stats()["errors"] == {"EIO": 1}
    assert os.path.exists(m.path)  # an I/O error is not proof of corruption: keep the file


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    store = SSDStore(tmp_path, FP, max_bytes=1 << 30)
    os.chmod(store.dir, 0o500)
    try:
        assert store.write(toks((1, 9)), caches(8), NS) is False
        assert store.stats()["failed"] == 1
    finally:
        os.chmod(store.dir, 0o700)


def test_unwritable_root_does_not_raise(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    store = SSDStore(blocker, FP, max_bytes=1 << 30)  # root is a file: makedirs fails
    assert store.stats()["failed"] == 1
    assert store.write(toks((1, 9)), caches(8), NS) is False
    assert store.find(toks((1, 9)), NS) is None


@pytest.mark.parametrize("fp", ["../etc", "ABCDEF01", "", "abc", "0011/../22"])
def test_fingerprint_must_be_hex(tmp_path, fp):
    with pytest.raises(ValueError):
        SSDStore(tmp_path, fp, max_bytes=1)


def test_path_traversal_namespace_stays_inside(tmp_path):
    root = tmp_path / "root"
    store = SSDStore(root, FP, max_bytes=1 << 30)
    ns = "../../../escape"
    assert store.write(toks((1, 9)), caches(8), ns)
    (path,) = files(store)
    assert os.path.dirname(path) == os.path.join(store.dir, kvfile.ns_hash(ns))
    assert sorted(os.listdir(tmp_path)) == ["root"]
    assert store.find(toks((1, 12)), ns).length == 8


def test_concurrent_find_and_write(store):
    errors = []

    def reader():
        try:
            for _ in range(200):
                store.find(toks((1, 30)), NS)
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    for n in range(2, 12):
        store.write(toks((1, n + 1)), caches(n), NS)
    t.join()
    assert errors == []
    assert store.stats()["entries"] == 1  # each write superseded its ancestor


def test_null_store():
    s = NullSSDStore()
    assert s.find([1, 2, 3], NS) is None and s.write([1], [], NS) is False and s.covers([1], NS) is False


def test_covers(store):
    store.write(toks((1, 9)), caches(8), NS)
    store.write(toks((20, 25)), caches(5, trimmable=False), NS)
    assert store.covers(toks((1, 9)), NS) and store.covers(toks((1, 5)), NS)
    assert store.covers(toks((20, 25)), NS) and not store.covers(toks((20, 24)), NS)
    assert not store.covers(toks((1, 10)), NS) and not store.covers(toks((1, 9)), "other")


def test_a_sync_that_indexes_the_file_being_written_does_not_delete_it(store, monkeypatch):
    """Another thread's sync (the flush endpoint's, a prefetch's) may list the folder between the writer's rename and
    its own indexing, and index the new file first. The writer must not then take that entry, its own file, for an
    ancestor it supersedes: it used to unlink the file it had just written (seen in CI as one answer written three
    times: each flush found the entry gone and wrote it again)."""
    save = kvfile.save

    def save_then_a_concurrent_sync(*args, **kwargs):
        size = save(*args, **kwargs)
        os.utime(os.path.dirname(args[0]), ns=(0, 0))  # the folder looks changed to the other thread
        assert store.sync() == (1, 0)  # it indexes the renamed file before the writer does
        return size

    monkeypatch.setattr(kvfile, "save", save_then_a_concurrent_sync)
    assert store.write(toks((1, 9)), caches(8), NS)
    (path,) = files(store)
    assert store.covers(toks((1, 9)), NS) and store.stats()["superseded"] == 0
    os.utime(os.path.dirname(path), ns=(0, 0))
    store.sync()  # a later listing still finds the file the index holds
    assert files(store) == [path] and store.covers(toks((1, 9)), NS)
    assert store.stats()["entries"] == 1 and store.stats()["bytes"] == os.path.getsize(path)


def test_a_sync_between_a_supersede_and_its_unlink_does_not_index_the_file_again(store, monkeypatch):
    """A writer drops the ancestors its file supersedes from the index, then unlinks them. A sync in between lists the
    folder with an ancestor's file still in it: it must not index that file again (it would outlive its file as an
    entry that `covers` and `find` trust until some later sync or restore finds it gone)."""
    assert store.write(toks((1, 9)), caches(8), NS)
    (ancestor,) = files(store)
    remove = filelocks.remove_unless_busy

    def a_sync_then_remove(path):
        os.utime(os.path.dirname(path), ns=(0, 0))  # the folder looks changed to the other thread
        assert os.path.exists(path) and store.sync()[0] == 0  # the ancestor's file is listed, and not indexed
        return remove(path)

    monkeypatch.setattr(filelocks, "remove_unless_busy", a_sync_then_remove)
    assert store.write(toks((1, 13)), caches(12), NS)
    (path,) = files(store)
    assert path != ancestor and store.stats()["superseded"] == 1
    assert store.stats()["entries"] == 1 and store.stats()["bytes"] == os.path.getsize(path)
    assert store.find(toks((1, 9), [99]), NS).path == path
