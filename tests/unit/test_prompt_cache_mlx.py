"""The fork mechanism on REAL mlx-lm cache objects (no model: update_and_fetch with random arrays).

What must hold: takers never change the donor entry, put never keeps objects the lane mutates afterwards, each taker
sees exactly what a cache built from scratch with the same inputs would see, and take/put copy no KV bytes.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc

from cache.copying import fork
from cache.prompt_cache import PromptCache

HEADS, DIM = 2, 64  # DIM a multiple of the quantization group size


def kv(seed: int, steps: int):
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return mx.random.normal((1, HEADS, steps, DIM), key=k1), mx.random.normal((1, HEADS, steps, DIM), key=k2)


def feed(cache, seed: int, chunks):
    """Feed chunks of random KV (sizes in `chunks`), seeded from `seed`; returns the last fetched (keys, values)."""
    out = None
    for i, steps in enumerate(chunks):
        out = cache.update_and_fetch(*kv(seed * 1000 + i, steps))
    mx.eval(out)
    return out


def to_np(value):
    """Nested state -> nested numpy/ints, for exact before/after comparison."""
    if isinstance(value, mx.array):
        return np.array(value)
    if isinstance(value, (list, tuple)):
        return [to_np(v) for v in value]
    return value


def assert_same(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# Each case: a cache factory, the chunk sizes the donor is fed, the taker's prompt relation, and the reference chunks
# that rebuild the taker's prefix from scratch (same seeds) so "the taker sees its own data" is checked exactly.
CASES = {
    # name: (factory, donor chunks, hit length, chunks rebuilding the first `hit length` tokens)
    "kv-trim": (mlc.KVCache, [40, 1, 1, 1], 30, None),
    "kv-full": (mlc.KVCache, [300, 1, 1], 302, [300, 1, 1]),  # allocated past offset: 512 slots
    "quantized-trim": (lambda: mlc.QuantizedKVCache(group_size=64, bits=8), [20, 1, 1], 15, None),
    "rotating-trim": (lambda: mlc.RotatingKVCache(max_size=64, keep=4), [12, 1, 1, 1, 1], 14, [12, 1, 1]),
    "rotating-wrapped": (lambda: mlc.RotatingKVCache(max_size=32, keep=4), [30, 1, 1, 1, 1, 1], 35, [30, 1, 1, 1, 1, 1]),
}


def donor(name):
    factory, chunks, _, _ = CASES[name]
    caches = [factory() for _ in range(3)]
    for layer, c in enumerate(caches):
        feed(c, layer, chunks)
    return caches, sum(chunks)


def reference(name, layer, taker_seed, taker_chunks):
    """A fresh cache fed the donor's first tokens, then the taker's own: what the taker must see."""
    factory, chunks, length, rebuild = CASES[name]
    ref = factory()
    if rebuild is None:  # plain KV caches: one chunk of the donor's first `length` tokens gives the same positions
        keys, values = [], []
        for i, steps in enumerate(chunks):
            k, v = kv(layer * 1000 + i, steps)
            keys.append(k)
            values.append(v)
        ref.update_and_fetch(mx.concatenate(keys, axis=2)[..., :length, :], mx.concatenate(values, axis=2)[..., :length, :])
    else:
        feed(ref, layer, rebuild)
    return to_np(list(feed(ref, taker_seed, taker_chunks)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_twenty_takers_never_touch_the_donor(name):
    caches, n = donor(name)
    length = CASES[name][2]
    tokens = list(range(n))
    pc = PromptCache(10**10)
    pc.put(tokens, caches, "m")
    lane_before = [to_np(c.state) for c in caches]
    # The lane keeps generating with its own objects after the put (prompt-boundary snapshot).
    for layer, c in enumerate(caches):
        feed(c, 500 + layer, [1, 1, 3])
    prompt = tokens[:length] + [10**6] * (2 if length == n else 1)  # diverges right after `length`
    taker_chunks = [1, 1, 1, 4, 1]
    for taker in range(20):
        hit = pc.take(prompt, "m")
        assert hit is not None and hit.length == length
        for layer, c in enumerate(hit.caches):
            assert c is not caches[layer]
            got = to_np(list(feed(c, 7000 + taker * 10 + layer, taker_chunks)))
            assert_same(got, reference(name, layer, 7000 + taker * 10 + layer, taker_chunks))
    # The stored entry still holds exactly what the lane had at put time (KV caches are stored sliced to offset).
    full = pc.take(tokens + [10**6], "m")
    assert full.length == n
    for c, before in zip(full.caches, lane_before):
        after = to_np(c.state)
        assert_same(after[2:], before[2:])  # offset and the other ints
        for got, want in zip(np_leaves(after[:2]), np_leaves(before[:2])):
            assert_same(got, want[..., : got.shape[-2], :])


def np_leaves(value):
    if isinstance(value, np.ndarray):
        return [value]
    return [leaf for v in value for leaf in np_leaves(v)]


def test_untrimmable_rotating_needs_a_full_prefix():
    caches, n = donor("rotating-wrapped")
    assert not caches[0].is_trimmable()
    pc = PromptCache(10**10)
    pc.put(list(range(n)), caches, "m")
    assert pc.take(list(range(n - 1)) + [-1, -2], "m") is None  # would need a trim of the wrapped ring
    assert pc.take(list(range(n)), "m") is None  # equal prompt: capped at n-1, also a trim
    assert pc.take(list(range(n)) + [-1], "m").length == n


def test_arrays_cache_takers_get_their_own_list():
    state = [mx.ones((1, 3, 8)), mx.full((1, 2, 4), 2.0)]
    lane = mlc.ArraysCache(2)
    lane[0], lane[1] = state
    pc = PromptCache(10**10)
    pc.put([1, 2, 3], [lane], "m")
    lane[0] = mx.zeros((1, 3, 8))  # models replace (not write) recurrent state
    for i in range(20):
        hit = pc.take([1, 2, 3, 4], "m")
        assert hit.length == 3 and not hit.caches[0].is_trimmable()
        hit.caches[0][0] = mx.full((1, 3, 8), float(i))
        hit.caches[0][1][..., 0] = mx.array(-1.0)  # even an in-place write stays with the taker
    again = pc.take([1, 2, 3, 4], "m").caches[0]
    assert np.array_equal(np.array(again[0]), np.ones((1, 3, 8)))
    assert np.array_equal(np.array(again[1]), np.full((1, 2, 4), 2.0))
    assert pc.take([1, 2, 4], "m") is None  # untrimmable: no trim to 2


def test_cache_list_forks_each_member():
    a, b = mlc.KVCache(), mlc.KVCache()
    feed(a, 1, [10])
    feed(b, 2, [10])
    pc = PromptCache(10**10)
    pc.put(list(range(10)), [mlc.CacheList(a, b)], "m")
    hit = pc.take(list(range(6)) + [99], "m")
    assert hit.length == 6
    members = hit.caches[0].caches
    assert [m.offset for m in members] == [6, 6] and members[0] is not a
    feed(members[0], 9, [1, 1])
    assert pc.take(list(range(10)) + [99], "m").caches[0].caches[0].offset == 10


def test_fork_refuses_to_trim_untrimmable():
    c = mlc.ArraysCache(1)
    c[0] = mx.ones((1, 2))
    with pytest.raises(ValueError, match="not every cache is trimmable"):
        fork([c], trim=1)


def test_take_and_put_copy_no_kv_bytes():
    layers = [mlc.KVCache() for _ in range(8)]
    for i, c in enumerate(layers):
        feed(c, i, [2000])  # 2048 slots allocated
    kv_bytes = sum(c.nbytes for c in layers)  # ~16.8 MB
    pc = PromptCache(10**10)
    mx.synchronize()
    base = mx.get_active_memory()
    pc.put(list(range(2000)), layers, "m")
    hits = [pc.take(list(range(1500)) + [-1], "m") for _ in range(20)]
    mx.synchronize()
    grown = mx.get_active_memory() - base
    assert all(h.length == 1500 for h in hits)
    assert grown < kv_bytes // 100, f"take/put allocated {grown} bytes for {kv_bytes} bytes of KV"
    # Copy-on-write: the first extension of a taker allocates its own buffer; the donor is unchanged by it.
    for i, c in enumerate(hits[0].caches):
        feed(c, 900 + i, [1])
    mx.synchronize()
    assert mx.get_active_memory() - base > kv_bytes // 2
