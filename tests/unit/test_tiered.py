"""cache.tiered: RAM over SSD with real mlx-lm KVCache objects and a real SSDStore on tmp_path (no model).

Covered: write-behind (never on the caller's thread), SSD preferred only when strictly longer, the cost model
deciding restore vs recompute, spill on eviction, idle demotion with an injected clock, prefetch coalescing,
flush semantics, clear() touching RAM only.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from cache.copying import total_nbytes
from cache.durability import DurabilityCoordinator
from cache.rates import CostModel
from cache.ssd_store import SSDStore
from cache.tiered import TieredCache

FP = "ab" * 8
NS = "model-ns"
LAYERS = 2
HEADS, DIM = 2, 8


def kv(tokens):
    """Caches whose content is a function of the token ids, so a restored prefix can be checked exactly."""
    n = len(tokens)
    ids = mx.array(np.asarray(tokens, dtype=np.float32)).reshape(1, 1, n, 1)
    out = []
    for layer in range(LAYERS):
        c = KVCache()
        k = mx.broadcast_to(ids + layer, (1, HEADS, n, DIM))
        c.update_and_fetch(k, -k)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def entry_bytes(tokens):
    """What the RAM tier charges for an entry (KVCache allocates in steps of 256 tokens: padding included)."""
    return total_nbytes(kv(tokens))


def assert_covers(caches, tokens):
    n = len(tokens)
    want = np.asarray(tokens, dtype=np.float32).reshape(1, 1, n, 1)
    for layer, c in enumerate(caches):
        assert c.offset == n
        keys = np.array(c.keys[..., :n, :])
        assert np.array_equal(keys, np.broadcast_to(want + layer, keys.shape))


def wait_for(pred, timeout=10.0):
    """Poll a condition the writer thread will make true (not a timing assertion: a bound on waiting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


class CountingStore:
    """An SSDStore whose restores are counted and can be held at a gate."""

    def __init__(self, inner):
        self.inner = inner
        self.restores = 0
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def restore(self, match):
        self.restores += 1
        self.gate.wait(10)
        return self.inner.restore(match)


@pytest.fixture
def make(tmp_path):
    made = []

    def factory(*, ram_bytes=1 << 30, prefill_tok_s=1.0, read_bytes_s=1e12, root=None, clock=time.monotonic,
                demote_idle_s=0.0, debounce_s=1000.0):
        store = CountingStore(SSDStore(root or tmp_path / "kv", FP, 1 << 30))
        dur = DurabilityCoordinator(store, debounce_s=debounce_s, retry_backoff=(0.0,))
        cost = CostModel(prefill_tok_s=prefill_tok_s, read_bytes_s=read_bytes_s)
        tier = TieredCache.build(ram_bytes, store, dur, cost, clock=clock, demote_idle_s=demote_idle_s,
                                 start_timer=False)
        made.append(tier)
        return tier, store

    yield factory
    for t in made:
        t.close(timeout=5)


A = list(range(1, 21))  # 20 tokens


def test_put_writes_behind_never_on_the_callers_thread(make):
    tier, store = make()
    tier.put(A, kv(A), NS)
    assert store.stats()["writes"] == 0 and not store.covers(A, NS)  # debounce 1000 s: nothing written yet
    assert [p["tokens"] for p in tier.pending()] == [20]
    assert tier.flush(5) is True
    assert store.covers(A, NS) and tier.pending() == []


def test_restore_from_ssd_after_ram_is_cleared(make):
    tier, store = make()
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    assert tier.clear() == 1
    assert store.stats()["entries"] == 1  # clear is RAM only
    hit = tier.take(A + [99], NS)
    assert hit is not None and hit.source == "ssd" and hit.length == 20
    assert_covers(hit.caches, A)
    assert tier.stats()["entries"] == 1  # the restored entry is now in RAM
    again = tier.take(A + [98], NS)
    assert again.source == "ram" and again.length == 20 and store.restores == 1


def test_restore_trims_to_the_usable_prefix(make):
    tier, _ = make()
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    tier.clear()
    prompt = A[:12] + [500, 501]
    hit = tier.take(prompt, NS)
    assert hit.source == "ssd" and hit.length == 12
    assert_covers(hit.caches, A[:12])


# (RAM entry tokens, expected source, expected length) with SSD holding A (20 tokens), prompt A + [99]
PREFERENCE = [
    pytest.param(A, "ram", 20, id="equal-length-ram-wins"),
    pytest.param(A[:15], "ssd", 20, id="ssd-strictly-longer"),
    pytest.param(None, "ssd", 20, id="ram-empty"),
]


@pytest.mark.parametrize("ram_tokens,source,length", PREFERENCE)
def test_ssd_preferred_only_when_strictly_longer(make, ram_tokens, source, length):
    tier, store = make()
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    tier.clear()
    if ram_tokens is not None:
        tier._ram.put(ram_tokens, kv(ram_tokens), NS)  # RAM only, no write-behind
    hit = tier.take(A + [99], NS)
    assert (hit.source in ("ram", "session") if source == "ram" else hit.source == "ssd")
    assert hit.length == length
    assert store.restores == (0 if source == "ram" else 1)


def test_cost_model_decides_restores(make):
    tier, store = make(prefill_tok_s=1000.0, read_bytes_s=1e12)
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    tier.cost_model._read = 1.0  # the disk turned slow since (measured rates move): now a restore cannot pay
    tier.clear()
    assert tier.take(A + [99], NS) is None and store.restores == 0
    decisions = tier.ssd_stats()["cost_model"]
    assert (decisions["decisions_restore"], decisions["decisions_recompute"]) == (0, 1)
    assert tier.prefetch(A + [99], NS) is False  # prefetch obeys the same rule
    tier.cost_model._read = 1e12
    tier.clear()
    hit = tier.take(A + [99], NS)
    assert hit is not None and hit.source == "ssd" and store.restores == 1


def test_an_entry_that_could_never_pay_back_is_not_written(make):
    """On a machine where recomputing beats reading (an H200 with an 8B model), writing KV to SSD only costs decode
    time: the cost model declines it, /stats says so, and flush does not wait for it."""
    tier, store = make(prefill_tok_s=1e9, read_bytes_s=1.0)
    tier.put(A, kv(A), NS)
    assert tier.pending() == [] and tier.flush(5) is True and store.stats()["writes"] == 0
    stats = tier.ssd_stats()
    assert stats["writes_declined"] == 1 and stats["cost_model"]["writes_declined"] == 1
    tier.cost_model._prefill, tier.cost_model._read = 1.0, 1e12  # where restoring wins (this CPU), it is written
    tier.put(A[:10], kv(A[:10]), NS)
    assert tier.flush(5) and store.covers(A[:10], NS)


def test_an_anchor_whose_entries_are_never_written_does_not_hold_up_flush(make):
    """A trimmable anchor (a prompt-boundary entry) waits for the entry that extends it to be written; where the
    cost model declines writes, that never comes: the anchor is declined too, and flush answers durable (it was
    503 for every request that shared its prompt, whenever writes were declined)."""
    tier, store = make(prefill_tok_s=1e9, read_bytes_s=1.0)
    tier.put(A[:10], kv(A[:10]), NS, anchor=True)
    tier.put(A, kv(A), NS)
    assert tier.pending() == [] and tier.flush(5) is True and store.stats()["writes"] == 0
    assert tier.ssd_stats()["writes_declined"] == 2


def test_observe_prefill_feeds_the_cost_model(make):
    tier, _ = make(prefill_tok_s=1.0)
    tier.observe_prefill(4, 1.0)  # too short to count
    assert tier.ssd_stats()["cost_model"]["prefill_measured"] is False
    tier.observe_prefill(1000, 0.5)
    assert tier.ssd_stats()["cost_model"]["prefill_tok_s"] == 2000.0


def test_eviction_spills_a_not_yet_durable_entry(make):
    tier, store = make(ram_bytes=entry_bytes(A) * 3 // 2)  # room for one entry
    B = list(range(100, 120))
    calls = []
    schedule = tier._durability.schedule
    tier._durability.schedule = lambda *a, **k: calls.append((len(a[0]), k.get("sole", False))) or schedule(*a, **k)
    tier.put(A, kv(A), NS)
    tier.put(B, kv(B), NS)  # evicts A from RAM
    assert tier.stats()["entries"] == 1
    assert wait_for(lambda: store.covers(A, NS))  # written without a flush: the spill skips the debounce
    assert not store.covers(B, NS)  # B is still debounced
    assert tier.ssd_stats()["spills"] == 1
    assert (len(A), True) in calls and (len(B), False) in calls  # the spill says it is the arrays' only holder
    # written, A's spill holds nothing any more; B's pending snapshot shares its arrays with RAM's entry
    assert wait_for(lambda: tier.ssd_stats()["spilled_pending_bytes"] == 0)
    assert tier.ssd_stats()["pending_bytes"] > 0 and tier.ssd_stats()["spills_dropped"] == 0
    tier.clear()
    hit = tier.take(A + [1], NS)
    assert hit.source == "ssd" and hit.length == 20


def test_room_made_for_running_requests_is_not_kept_as_pending_spills(make):
    """Admission asks the RAM tier for memory (make_room): the entries it evicts are not held as pending spills
    (with the disk's writes held back they would keep every byte); held_bytes counts RAM and spills alike."""
    tier, store = make(ram_bytes=1 << 30)
    tier.set_write_gate(lambda: False)  # the lane is busy: nothing reaches the disk
    B = list(range(100, 120))
    tier.put(A, kv(A), NS)
    tier.put(B, kv(B), NS)
    ram = tier.stats()["bytes"]
    assert tier.held_bytes() == ram and tier.ssd_stats()["pending"] == 2  # pending snapshots RAM shares: no extra
    freed = tier.make_room(1)  # the least recent entry, A, leaves RAM
    assert freed >= entry_bytes(A) and tier.stats()["entries"] == 1
    # A's spill was dropped at once: its memory went back, and nothing was written
    assert tier.held_bytes() == tier.stats()["bytes"] == ram - freed
    s = tier.ssd_stats()
    assert s["spills"] == 1 and s["spills_dropped"] == 1 and s["spilled_pending_bytes"] == 0 and s["writes"] == 0
    assert not store.covers(A, NS)
    # an eviction of the RAM tier's own (its cap, not admission) still spills and holds the spill for the disk
    C = list(range(200, 220))
    small, _ = make(ram_bytes=entry_bytes(A) * 3 // 2)
    small.set_write_gate(lambda: False)
    small.put(A, kv(A), NS)
    small.put(C, kv(C), NS)  # evicts A
    assert small.ssd_stats()["spilled_pending_bytes"] > 0
    assert small.held_bytes() == small.stats()["bytes"] + small.ssd_stats()["spilled_pending_bytes"]


def test_a_pending_write_of_an_entry_ram_superseded_is_held_memory(make, monkeypatch):
    """A longer entry supersedes A in RAM but its own write is declined (the cost model): A's pending snapshot is
    the only holder of A's arrays, so held_bytes counts it and admission's make_room can give it back."""
    tier, _ = make(ram_bytes=1 << 30)
    tier.set_write_gate(lambda: False)  # the lane is busy: nothing reaches the disk
    tier.put(A, kv(A), NS)
    assert tier.held_bytes() == tier.stats()["bytes"]
    longer = A + [7, 8, 9]
    monkeypatch.setattr(tier, "_worth_writing", lambda tokens, caches, ns: list(tokens) != longer)
    tier.put(longer, kv(longer), NS)
    s = tier.ssd_stats()
    assert tier.stats()["entries"] == 1 and s["pending"] == 1
    assert s["spilled_pending_bytes"] == s["pending_bytes"] > 0  # A's snapshot, counted as a spill now
    assert tier.held_bytes() == tier.stats()["bytes"] + s["pending_bytes"]
    tier.make_room(1)  # admission wants memory: the longer entry leaves RAM, its spill is dropped, A's stays
    assert tier.stats()["entries"] == 0 and tier.held_bytes() == s["pending_bytes"]
    assert tier.make_room(1) == s["pending_bytes"] and tier.held_bytes() == 0  # RAM is empty: the spill gives it


def test_an_evicted_entry_no_longer_worth_writing_takes_its_pending_write_with_it(make, monkeypatch):
    """Scheduled while the cost model still said yes, evicted after it learned better: the pending snapshot would
    be the only holder of the entry's arrays, so it goes with the entry."""
    tier, _ = make(ram_bytes=1 << 30)
    tier.set_write_gate(lambda: False)
    tier.put(A, kv(A), NS)
    assert tier.ssd_stats()["pending"] == 1
    monkeypatch.setattr(tier, "_worth_writing", lambda tokens, caches, ns: False)
    tier.make_room(1)
    s = tier.ssd_stats()
    assert tier.stats()["entries"] == 0 and s["pending"] == 0 and s["spills"] == 0
    assert tier.held_bytes() == 0


def test_entry_larger_than_ram_goes_to_ssd_only(make):
    tier, store = make(ram_bytes=entry_bytes(A) // 2)
    tier.put(A, kv(A), NS)
    assert tier.stats()["entries"] == 0
    assert wait_for(lambda: store.covers(A, NS))
    hit = tier.take(A + [1], NS)  # restored, too big for RAM: served from the restored objects
    assert hit.source == "ssd" and hit.length == 20
    assert_covers(hit.caches, A)


def test_idle_entries_are_demoted(make):
    now = [0.0]
    tier, store = make(clock=lambda: now[0], demote_idle_s=300.0)
    B = list(range(100, 120))
    tier.put(A, kv(A), NS)
    now[0] = 200.0
    tier.put(B, kv(B), NS)
    now[0] = 350.0
    assert tier.demote_idle() == 1  # A idle 350 s, B 150 s
    assert tier.stats()["entries"] == 1 and tier.ssd_stats()["demotions"] == 1
    assert wait_for(lambda: store.covers(A, NS))
    assert not store.covers(B, NS)
    now[0] = 1000.0
    assert tier.demote_idle() == 1 and tier.stats()["entries"] == 0


def test_demotion_off_when_zero(make):
    now = [0.0]
    tier, _ = make(clock=lambda: now[0], demote_idle_s=0)
    tier.put(A, kv(A), NS)
    now[0] = 1e6
    assert tier.demote_idle() == 0 and tier.stats()["entries"] == 1


def test_prefetch_coalesces_identical_reads(make):
    tier, store = make()
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    tier.clear()
    store.gate.clear()  # hold the first read so the second prefetch finds it in flight
    assert tier.prefetch(A + [99], NS) is True
    assert tier.prefetch(A + [98], NS) is True
    result = {}
    taker = threading.Thread(target=lambda: result.setdefault("hit", tier.take(A + [99], NS)))
    taker.start()  # a take while the read is in flight joins it
    store.gate.set()
    taker.join(10)
    hit = result["hit"]
    assert hit.source == "ssd" and hit.length == 20
    assert store.restores == 1
    s = tier.ssd_stats()
    assert s["prefetches"] == 1 and s["prefetch_coalesced"] == 1
    assert tier.take(A + [98], NS).source == "ram" and store.restores == 1


def test_prefetch_skips_when_ram_is_as_long(make):
    tier, store = make()
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    assert tier.prefetch(A + [99], NS) is False  # RAM still holds A
    assert tier.prefetch([7, 7, 7], NS) is False  # nothing on disk
    assert store.restores == 0


def test_flush_rewrites_an_entry_whose_write_was_abandoned_once_the_disk_takes_it(make, monkeypatch):
    """A write given up on (a full disk) is not retried by the writer; the entry stays in RAM, uncovered. Nothing
    puts it again (its conversation moved on), so flush itself schedules it: durable once the disk takes it."""
    tier, store = make()
    real_write, full = store.inner.write, [True]
    monkeypatch.setattr(store.inner, "write", lambda *a: False if full[0] else real_write(*a))
    tier.put(A, kv(A), NS)
    assert tier.flush(5) is False  # retried once, then abandoned
    assert [p["state"] for p in tier.pending()] == ["not_written"] and not store.covers(A, NS)
    full[0] = False  # the space is back; no new put of A
    assert tier.flush(5) is True
    assert store.covers(A, NS) and tier.pending() == []
    assert tier.ssd_stats()["flush_rewrites"] == 1  # the first flush wrote A's pending snapshot, the second again


def test_flush_fails_on_an_unwritable_dir_and_serving_continues(make, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tier, store = make(root=blocker / "kv")
    tier.put(A, kv(A), NS)
    assert tier.flush(5) is False
    assert [p["state"] for p in tier.pending()] == ["not_written"]
    assert tier.flush(5) is False  # still not durable: the second flush tried A again, and failed again
    s = tier.ssd_stats()
    assert s["failed"] >= 1 and s["writes_abandoned"] == 2 and s["flush_rewrites"] == 1
    hit = tier.take(A + [99], NS)  # RAM still serves
    assert hit.source == "ram" and hit.length == 20


def test_close_flushes(make):
    tier, store = make()
    tier.put(A, kv(A), NS)
    assert tier.close(timeout=5) is True
    assert store.covers(A, NS)


def test_namespaces_never_mix(make):
    tier, _ = make()
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    tier.clear()
    assert tier.take(A + [99], "other-ns") is None


def test_ready_starts_a_read_the_lane_would_otherwise_do_on_its_own_clock(make):
    tier, store = make()
    tier.put(A, kv(A), NS)
    assert tier.flush(5)
    tier.clear()  # RAM lost it: only the file has the prefix
    store.gate.clear()  # hold the read
    assert tier.ready(A + [99], NS) is False  # a read was started, off the lane
    assert tier.ssd_stats()["prefetches"] == 1
    assert tier.ready(A + [99], NS) is False  # still reading: the request keeps waiting
    store.gate.set()
    for _ in range(100):
        if tier.ready(A + [99], NS):
            break
        time.sleep(0.05)
    assert tier.ready(A + [99], NS) is True
    hit = tier.take(A + [99], NS)
    assert hit.source == "ssd" and hit.length == 20 and store.restores == 1  # the take joined it: no lane read
    assert tier.ready([5, 5, 5], NS) is True  # nothing on disk: nothing to wait for
