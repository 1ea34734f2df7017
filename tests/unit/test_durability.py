"""cache.durability: debounce, supersede, budget, retries, flush/close, and a clean process exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from cache import kvfile
from cache.durability import DurabilityCoordinator
from cache.ssd_store import SSDStore

NS = "ns"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def caches(n, *, trimmable=True):
    kv = KVCache()
    kv.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    if trimmable:
        return [kv]
    arr = ArraysCache(1)
    arr[0] = mx.zeros((1, 4))
    return [kv, arr]


class StubStore:
    """Records writes; fails the first `fail` attempts (returning False, or raising when `exc` is given)."""

    def __init__(self, fail=0, exc=None):
        self.fail, self.exc = fail, exc
        self.attempts = 0
        self.writes: list[tuple[str, tuple[int, ...]]] = []
        self.snaps = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def write(self, tokens, snap, ns):
        self.entered.set()
        self.gate.wait()
        self.attempts += 1
        if self.attempts <= self.fail:
            if self.exc:
                raise self.exc
            return False
        self.writes.append((ns, tuple(tokens)))
        self.snaps.append(snap)
        return True

    def covers(self, tokens, ns):
        t = tuple(tokens)
        return any(n == ns and w[: len(t)] == t for n, w in self.writes)


@pytest.fixture
def make():
    made = []

    def factory(store, **kw):
        kw.setdefault("debounce_s", 1000.0)  # tests flush explicitly; the debounce never fires by itself
        kw.setdefault("retry_backoff", (0.0, 0.0))
        d = DurabilityCoordinator(store, **kw)
        made.append(d)
        return d

    yield factory
    for d in made:
        d.close(timeout=5)


def test_growing_conversation_is_written_once(make):
    store = StubStore()
    d = make(store)
    t = list(range(1, 11))
    for n in (4, 6, 8, 8):
        assert d.schedule(t[:n], caches(n), NS)
    s = d.stats()
    assert (s["pending"], s["superseded"], s["coalesced"]) == (1, 2, 1)
    assert d.flush(timeout=10) is True
    assert store.writes == [(NS, tuple(t[:8]))]
    assert d.stats()["written"] == 1 and d.stats()["pending_bytes"] == 0


def test_untrimmable_growth_keeps_the_ancestor(make):
    store = StubStore()
    d = make(store)
    d.schedule([1, 2, 3], caches(3, trimmable=False), NS)
    d.schedule([1, 2, 3, 4, 5], caches(5, trimmable=False), NS)
    assert d.flush(timeout=10)
    assert sorted(store.writes) == [(NS, (1, 2, 3)), (NS, (1, 2, 3, 4, 5))]


def test_two_conversations_do_not_cancel(make):
    store = StubStore()
    d = make(store)
    d.schedule([1, 2, 3], caches(3), "a")
    d.schedule([7, 8, 9], caches(3), "a")
    d.schedule([1, 2, 3], caches(3), "b")
    d.schedule([1, 2, 3, 4], caches(4), "b")  # supersedes only b's own ancestor
    assert d.stats()["pending"] == 3
    assert d.flush(timeout=10)
    assert sorted(store.writes) == [("a", (1, 2, 3)), ("a", (7, 8, 9)), ("b", (1, 2, 3, 4))]


def test_debounce_holds_then_fires(make):
    store = StubStore()
    held = make(store)
    held.schedule([1, 2], caches(2), NS)
    assert not store.entered.wait(0.3)  # debounce 1000 s: nothing may be written yet
    assert held.is_durable([1, 2], NS) is False

    store2 = StubStore()
    quick = make(store2, debounce_s=0.01)
    quick.schedule([1, 2], caches(2), NS)
    assert store2.entered.wait(10)
    assert quick.flush(timeout=10)
    assert quick.is_durable([1, 2], NS) is True


def test_budget_drops_oldest(make):
    store = StubStore()
    size = kvfile.encode(caches(4)).nbytes
    d = make(store, max_pending_bytes=int(2.5 * size))
    for first in (10, 20, 30):
        assert d.schedule([first, 1, 2, 3], caches(4), NS)
    s = d.stats()
    assert (s["dropped"], s["pending"], s["pending_bytes"]) == (1, 2, 2 * size)
    assert d.flush(timeout=10)
    assert sorted(store.writes) == [(NS, (20, 1, 2, 3)), (NS, (30, 1, 2, 3))]


def test_spills_have_a_bound_of_their_own_and_shared_snapshots_do_not_count_against_it(make):
    """A spill (the RAM tier dropped the entry) is the only holder of its arrays: past max_sole_bytes the oldest
    spill goes, while snapshots the RAM tier still holds stay within the larger pending budget."""
    store = StubStore()
    size = kvfile.encode(caches(4)).nbytes
    # a long debounce: nothing is written before the flush, everything stays pending
    d = make(store, debounce_s=60.0, max_pending_bytes=100 * size, max_sole_bytes=int(2.5 * size))
    for first in (10, 20, 30, 40):  # shared with RAM: none dropped
        assert d.schedule([first, 1, 2, 3], caches(4), NS)
    assert d.stats()["sole_pending_bytes"] == 0 and d.stats()["dropped"] == 0
    for first in (50, 60, 70):  # spills: the third pushes the oldest spill out
        assert d.schedule([first, 1, 2, 3], caches(4), NS, delay=60.0, sole=True)
    s = d.stats()
    assert (s["spills_dropped"], s["dropped"], s["sole_pending_bytes"]) == (1, 1, 2 * size)
    assert not d.is_pending([50, 1, 2, 3], NS) and d.is_pending([60, 1, 2, 3], NS)
    # the RAM tier takes an entry back (a put of the same tokens): no longer a spill
    assert d.schedule([60, 1, 2, 3], caches(4), NS, delay=60.0)
    assert d.stats()["sole_pending_bytes"] == size
    assert d.flush(timeout=10)  # the drop came before the flush: what it found pending is all written
    assert d.stats()["sole_pending_bytes"] == 0 and d.stats()["pending_bytes"] == 0
    assert (NS, (70, 1, 2, 3)) in store.writes and (NS, (50, 1, 2, 3)) not in store.writes


def test_snapshot_larger_than_budget_is_still_written_and_evicts_older(make):
    store = StubStore()
    d = make(store, max_pending_bytes=10)
    assert d.schedule([1, 2, 3], caches(3), NS) is True
    assert d.schedule([9, 8, 7, 6], caches(4), NS) is True  # the older pending one is dropped for it
    assert d.stats()["dropped"] == 1 and d.stats()["pending"] == 1
    assert d.flush(timeout=10)
    assert store.writes == [(NS, (9, 8, 7, 6))]


@pytest.mark.parametrize("exc", [None, OSError(28, "No space left on device")])
def test_retry_then_fail(make, exc):
    store = StubStore(fail=99, exc=exc)
    d = make(store, retry_backoff=(0.0, 0.0))
    d.schedule([1, 2, 3], caches(3), NS)
    assert d.flush(timeout=10) is False
    s = d.stats()
    assert (store.attempts, s["retries"], s["failed"], s["written"], s["pending"]) == (3, 2, 1, 0, 0)


def test_retry_then_succeed(make):
    store = StubStore(fail=2)
    d = make(store, retry_backoff=(0.0, 0.0, 0.0))
    d.schedule([1, 2, 3], caches(3), NS)
    assert d.flush(timeout=10) is True
    s = d.stats()
    assert (s["retries"], s["failed"], s["written"]) == (2, 0, 1)


def test_flush_times_out_while_a_write_is_stuck(make):
    store = StubStore()
    store.gate.clear()
    d = make(store)
    d.schedule([1, 2, 3], caches(3), NS)
    d.schedule([5, 6], caches(2), NS)
    assert d.flush(timeout=0.2) is False
    assert store.entered.wait(10)  # the oldest snapshot is in flight, stuck in the store
    pend = d.pending()
    assert [(p["tokens"], p["in_flight"]) for p in pend] == [(3, True), (2, False)]
    assert pend[0]["ns_hash"] == kvfile.ns_hash(NS)
    assert d.is_durable([1, 2, 3], NS) is False
    store.gate.set()
    assert d.flush(timeout=10) is True
    assert d.is_durable([1, 2, 3], NS) and d.is_durable([5, 6], NS)
    assert d.pending() == []


def test_pending_age_uses_the_injected_clock(make):
    now = [100.0]
    d = make(StubStore(), clock=lambda: now[0])
    d.schedule([1, 2, 3], caches(3), NS)
    now[0] = 103.5
    (p,) = d.pending()
    assert (p["age_s"], p["tokens"], p["attempts"]) == (3.5, 3, 0)


def test_already_durable_is_not_rewritten(make):
    store = StubStore()
    store.writes.append((NS, (1, 2, 3, 4)))
    d = make(store)
    assert d.schedule([1, 2, 3], caches(3), NS) is True
    assert d.stats()["already_durable"] == 1 and d.stats()["pending"] == 0


def test_close_refuses_later_schedules(make):
    store = StubStore()
    d = make(store)
    d.schedule([1, 2], caches(2), NS)
    assert d.close(timeout=10) is True
    assert store.writes == [(NS, (1, 2))]
    assert d.schedule([3, 4], caches(2), NS) is False


def test_snapshot_is_taken_at_schedule_time(make, tmp_path):
    """The lane keeps mutating its cache objects after schedule; the file must hold what was scheduled."""
    store = SSDStore(tmp_path, "abcd1234", max_bytes=1 << 30)
    d = make(store)
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    d.schedule([1, 2, 3, 4], [c], NS)
    c.trim(2)
    c.update_and_fetch(mx.full((1, 2, 3, 8), 7.0), mx.full((1, 2, 3, 8), 7.0))  # overwrites positions 2..4
    assert d.flush(timeout=10)
    m = store.find([1, 2, 3, 4, 5], NS)
    r = store.restore(m)
    assert mx.array_equal(r.caches[0].keys, mx.ones((1, 2, 4, 8))).item()


SCRIPT = textwrap.dedent("""
    import sys, mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from cache.ssd_store import SSDStore
    from cache.durability import DurabilityCoordinator
    store = SSDStore(sys.argv[1], "abcd1234", max_bytes=1 << 30)
    d = DurabilityCoordinator(store, debounce_s=0.0)
    for i in range(6):
        c = KVCache()
        x = mx.random.normal((1, 2, 64, 32))
        c.update_and_fetch(x, x * 2)
        d.schedule([i] + list(range(63)), [c], "ns")
        mx.eval(mx.random.normal((64, 64)) @ mx.random.normal((64, 64)))  # main-thread work meanwhile
    print(d.close(timeout=60), store.stats()["entries"], d.stats()["written"])
""")


def test_process_exits_cleanly_after_background_writes(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "6", "6"]
    assert "terminate called" not in proc.stderr


def test_a_closed_gate_holds_due_writes_until_it_opens_and_a_flush_writes_regardless(make):
    """--ssd-write-when idle: while the gate says no (the lane is busy) a due snapshot waits, counted in gate_waits;
    it is written once the gate opens; a flush (shutdown, /admin/cache/flush) does not wait for the gate."""
    store = StubStore()
    busy = threading.Event()
    busy.set()
    d = make(store, debounce_s=0.0, gate_poll_s=0.01)
    d.set_gate(lambda: not busy.is_set())
    assert d.schedule([1, 2, 3], caches(3), NS)
    deadline = time.monotonic() + 5
    while d.stats()["gate_waits"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.stats()["gate_waits"] >= 3 and store.writes == [] and d.is_pending([1, 2, 3], NS)
    busy.clear()  # the lane went idle
    deadline = time.monotonic() + 5
    while not store.writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.writes == [(NS, (1, 2, 3))]
    busy.set()
    assert d.schedule([4, 5, 6], caches(3), NS)
    assert d.flush(timeout=5) and (NS, (4, 5, 6)) in store.writes
    # a gate that raises counts as open: the writes never stop for it
    d.set_gate(lambda: 1 / 0)
    assert d.schedule([7, 8, 9], caches(3), NS)
    deadline = time.monotonic() + 5
    while (NS, (7, 8, 9)) not in store.writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (NS, (7, 8, 9)) in store.writes


def test_drop_spills_gives_back_the_oldest_spills_and_never_a_shared_snapshot(make):
    """Memory wanted now (admission): the oldest pending spills go until the bytes asked for are given back; a
    snapshot the RAM tier still holds frees nothing and stays."""
    store = StubStore()
    size = kvfile.encode(caches(4)).nbytes
    d = make(store, debounce_s=60.0, max_pending_bytes=100 * size)
    assert d.schedule([10, 1, 2, 3], caches(4), NS)  # shared with RAM
    for first in (50, 60, 70):
        assert d.schedule([first, 1, 2, 3], caches(4), NS, delay=60.0, sole=True)
    assert d.sole_pending_bytes() == 3 * size
    assert d.drop_spills(size + 1) == 2 * size  # whole snapshots: two to give back more than one's bytes
    assert d.sole_pending_bytes() == size and d.stats()["spills_dropped"] == 2
    assert not d.is_pending([50, 1, 2, 3], NS) and not d.is_pending([60, 1, 2, 3], NS)
    assert d.is_pending([70, 1, 2, 3], NS) and d.is_pending([10, 1, 2, 3], NS)
    assert d.drop_spills(10 * size) == size and d.drop_spills(1) == 0  # nothing left to drop but the shared one
    assert d.is_pending([10, 1, 2, 3], NS)


def test_a_disowned_snapshot_counts_as_a_spill(make):
    """The RAM tier superseded an entry whose write is pending (the longer one's write was declined): the snapshot
    is the only holder of its arrays now, bounded and dropped like a spill; an unknown or sole one is unchanged."""
    store = StubStore()
    size = kvfile.encode(caches(4)).nbytes
    d = make(store, debounce_s=60.0, max_pending_bytes=100 * size, max_sole_bytes=size)
    assert d.schedule([10, 1, 2, 3], caches(4), NS)
    assert d.schedule([20, 1, 2, 3], caches(4), NS)
    assert d.sole_pending_bytes() == 0
    assert d.disown([10, 1, 2, 3], NS) and d.sole_pending_bytes() == size
    assert not d.disown([10, 1, 2, 3], NS) and not d.disown([99], NS)  # already sole / nothing pending
    assert d.disown([20, 1, 2, 3], NS)  # past the spills' bound: the older one goes
    assert d.sole_pending_bytes() == size and d.stats()["spills_dropped"] == 1
    assert not d.is_pending([10, 1, 2, 3], NS) and d.is_pending([20, 1, 2, 3], NS)
    assert d.drop_spills(1) == size and not d.is_pending([20, 1, 2, 3], NS)


def test_forget_drops_a_pending_snapshot(make):
    store = StubStore()
    d = make(store, debounce_s=60.0)
    assert d.schedule([10, 1, 2, 3], caches(4), NS)
    assert d.forget([10, 1, 2, 3], NS) and not d.is_pending([10, 1, 2, 3], NS)
    assert not d.forget([10, 1, 2, 3], NS)
    assert d.stats()["dropped"] == 1 and d.stats()["pending_bytes"] == 0
