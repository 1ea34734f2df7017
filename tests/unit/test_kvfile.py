"""cache.kvfile: exact round trips per mlx-lm cache class, and every bad file is a KVFileError."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from cache import host_copies, kvfile
from cache.kvfile import KVFileError

FP = "0123abcd"
NS = "model:0123abcd"


def _rand(n, heads=2, dim=32, dtype=mx.float32, key=0):
    k1, k2 = mx.random.split(mx.random.key(key))
    return (mx.random.normal((1, heads, n, dim), key=k1).astype(dtype),
            mx.random.normal((1, heads, n, dim), key=k2).astype(dtype))


def _feed(cache, steps, dtype=mx.float32, seed=0):
    """update_and_fetch chunks of the given sizes; returns the outputs (for comparing continuations)."""
    outs = []
    for i, n in enumerate(steps):
        outs.append(cache.update_and_fetch(*_rand(n, dtype=dtype, key=seed * 1000 + i)))
    return outs


def _live(c):
    """The meaningful state of a cache: arrays cut to their live length, plus the ints."""
    if isinstance(c, CacheList):
        return [x for child in c.caches for x in _live(child)]
    if isinstance(c, ArraysCache):
        return [x for x in c.cache if x is not None] + [c.left_padding, c.lengths]
    if isinstance(c, QuantizedKVCache):
        return [x[..., : c.offset, :] for x in (*c.keys, *c.values)] + [c.offset, c.group_size, c.bits]
    if isinstance(c, RotatingKVCache):
        n = min(c.offset, c.keys.shape[2])
        return [c.keys[..., :n, :], c.values[..., :n, :], c.offset, c.keep, c.max_size, c._idx]
    return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset]


def _same(a, b):
    fa, fb = tree_flatten(a), tree_flatten(b)
    assert len(fa) == len(fb)
    for (_, x), (_, y) in zip(fa, fb):
        if isinstance(x, mx.array) or isinstance(y, mx.array):
            assert isinstance(x, mx.array) and isinstance(y, mx.array)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert mx.array_equal(x, y).item()
        else:
            assert x == y


def _roundtrip(tmp_path, caches, tokens):
    path = tmp_path / "e.safetensors"
    kvfile.save(path, tokens, caches, fingerprint=FP, ns=NS, extra_meta={"who": "test"})
    f = kvfile.load(path, expect_fingerprint=FP, expect_ns=NS)
    assert f.tokens == tuple(tokens)
    assert f.meta.extra == {"who": "test"}
    assert [type(c) for c in f.caches] == [type(c) for c in caches]
    for a, b in zip(caches, f.caches):
        _same(_live(a), _live(b))
    return f


KV_CASES = {
    # name: (factory, fill steps, continuation steps, trimmable after fill)
    "kv": (KVCache, [5, 1, 1, 243], [1, 20, 1], True),  # continuation crosses the 256 allocation step
    "rot_before_wrap": (lambda: RotatingKVCache(max_size=16, keep=2), [5, 1, 1], [1, 3, 1, 1, 9, 1], True),
    "rot_after_wrap": (lambda: RotatingKVCache(max_size=8, keep=2), [5] + [1] * 6, [1, 1, 4, 1], False),
    "rot_concat_wrap": (lambda: RotatingKVCache(max_size=8, keep=0), [6, 7], [1, 3, 1], False),
    "quant": (lambda: QuantizedKVCache(group_size=32, bits=8), [5, 1, 250], [1, 7], True),
}


@pytest.mark.parametrize("name", sorted(KV_CASES))
def test_kv_like_round_trip_and_continuation(tmp_path, name):
    factory, fill, more, trimmable = KV_CASES[name]
    orig = factory()
    _feed(orig, fill)
    tokens = list(range(sum(fill)))
    f = _roundtrip(tmp_path, [orig], tokens)
    assert f.meta.trimmable is trimmable
    restored = f.caches[0]
    # Continuing both with the same data must give identical attention inputs at every step.
    for a, b in zip(_feed(orig, more, seed=7), _feed(restored, more, seed=7)):
        _same(a, b)
    _same(_live(orig), _live(restored))


def test_bfloat16_round_trip(tmp_path):
    c = KVCache()
    _feed(c, [7], dtype=mx.bfloat16)
    f = _roundtrip(tmp_path, [c], list(range(7)))
    assert f.caches[0].keys.dtype == mx.bfloat16


def test_arrays_cache_round_trip(tmp_path):
    c = ArraysCache(3)
    c[0] = mx.random.normal((1, 3, 4))
    c[2] = mx.random.normal((1, 5)).astype(mx.bfloat16)
    f = _roundtrip(tmp_path, [c], [1, 2, 3])
    assert f.meta.trimmable is False
    assert f.caches[0].cache[1] is None
    assert not f.caches[0].is_trimmable()


def test_cache_list_nested_round_trip(tmp_path):
    inner = CacheList(KVCache(), RotatingKVCache(max_size=4))
    _feed(inner.caches[0], [3])
    _feed(inner.caches[1], [3])
    arrays = ArraysCache(1)
    arrays[0] = mx.ones((1, 2))
    outer = CacheList(inner, arrays)
    kv = KVCache()
    _feed(kv, [3])
    f = _roundtrip(tmp_path, [outer, kv], [9, 8, 7])
    assert type(f.caches[0].caches[0]) is CacheList
    assert type(f.caches[0].caches[0].caches[1]) is RotatingKVCache
    assert f.meta.trimmable is False  # the ArraysCache child makes the whole entry untrimmable
    a, b = inner.caches[0], f.caches[0].caches[0].caches[0]
    _same(_feed(a, [2], seed=3), _feed(b, [2], seed=3))


def test_empty_and_trimmed_to_zero_caches(tmp_path):
    fresh, trimmed = KVCache(), KVCache()
    _feed(trimmed, [4])
    trimmed.trim(4)
    path = tmp_path / "z.safetensors"
    kvfile.save(path, [], [fresh, trimmed, RotatingKVCache(max_size=4)], fingerprint=FP, ns=NS)
    f = kvfile.load(path)
    assert [c.offset for c in f.caches] == [0, 0, 0]
    _same(_feed(trimmed, [2], seed=1), _feed(f.caches[1], [2], seed=1))


def test_encode_is_a_snapshot(tmp_path):
    """The owner may keep mutating its cache objects after encode: the snapshot must not change."""
    c = KVCache()
    _feed(c, [6])
    before = mx.array(c.keys[..., :6, :])
    enc = kvfile.encode([c])
    c.trim(3)
    _feed(c, [3], seed=5)  # writes positions 3..5 of the same buffer object
    assert not mx.array_equal(c.keys[..., :6, :], before).item()
    path = tmp_path / "s.safetensors"
    kvfile.save(path, list(range(6)), enc, fingerprint=FP, ns=NS)
    assert mx.array_equal(kvfile.load(path).caches[0].keys, before).item()


def test_unknown_class_is_a_clear_error_at_save(tmp_path):
    c = ChunkedKVCache(chunk_size=4)
    with pytest.raises(TypeError, match="ChunkedKVCache"):
        kvfile.save(tmp_path / "u.safetensors", [1], [c], fingerprint=FP, ns=NS)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    c = KVCache()
    _feed(c, [3])
    path = tmp_path / "a.safetensors"
    kvfile.save(path, [1, 2, 3], [c], fingerprint=FP, ns=NS)
    old = path.read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        kvfile.save(path, [4, 5, 6], [c], fingerprint=FP, ns=NS)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no .tmp left behind


# ------------------------------------------------------------------------------------------------ bad files


@pytest.fixture
def good(tmp_path):
    c = KVCache()
    _feed(c, [4])
    path = tmp_path / "g.safetensors"
    kvfile.save(path, [1, 2, 3, 4], [c], fingerprint=FP, ns=NS)
    return path


def _rewrite(path, edit):
    """Re-save `path` after edit(meta, arrays) mutates our JSON metadata and/or the tensors."""
    arrays, md = mx.load(str(path), return_metadata=True)
    meta = json.loads(md["mlx_lane"])
    edit(meta, arrays)
    mx.save_safetensors(str(path), arrays, {"mlx_lane": json.dumps(meta)})


def _assert_bad(path, **expect):
    with pytest.raises(KVFileError):
        kvfile.load(path, **expect)


@pytest.mark.parametrize("keep", [0, 5, 8, 100, -1])
def test_truncated_files(good, keep):
    data = good.read_bytes()
    good.write_bytes(data[: keep if keep >= 0 else len(data) - 1])
    with pytest.raises(KVFileError):
        kvfile.read_header(good)
    _assert_bad(good)


def test_random_bytes(tmp_path):
    p = tmp_path / "r.safetensors"
    p.write_bytes(os.urandom(4096))
    _assert_bad(p)
    p.write_bytes(b"\xff" * 8 + b"{}")  # absurd header length
    _assert_bad(p)


def test_foreign_safetensors(tmp_path):
    p = tmp_path / "f.safetensors"
    mx.save_safetensors(str(p), {"w": mx.ones((2, 2))})
    _assert_bad(p)
    mx.save_safetensors(str(p), {"w": mx.ones((2, 2))}, {"mlx_lane": "not json"})
    _assert_bad(p)
    mx.save_safetensors(str(p), {"w": mx.ones((2, 2))}, {"mlx_lane": json.dumps({"format": "other"})})
    _assert_bad(p)


def test_wrong_fingerprint_and_namespace(good):
    assert kvfile.load(good, expect_fingerprint=FP, expect_ns=NS).tokens == (1, 2, 3, 4)
    _assert_bad(good, expect_fingerprint="ffff0000")
    _assert_bad(good, expect_ns="model:other")


EDITS = {
    "version": lambda m, a: m.update(version=2),
    "ns_hash_mismatch": lambda m, a: m.update(ns="../../etc/passwd"),
    "tokens_not_ints": lambda m, a: m.update(tokens=["1", 2]),
    "negative_token": lambda m, a: m.update(tokens=[-1]),
    "unknown_tag": lambda m, a: m["layers"][0].update(tag="Pickler"),
    "offset_string": lambda m, a: m["layers"][0]["meta"].update(offset="4; import os"),
    "offset_mismatch": lambda m, a: m["layers"][0]["meta"].update(offset=3),
    "missing_tensor": lambda m, a: a.pop("0.values"),
    "extra_tensor": lambda m, a: a.update({"0.evil": mx.zeros((1,))}),
    "shape_mismatch": lambda m, a: a.update({"0.values": mx.zeros((1, 2, 3, 32))}),
    "layers_not_list": lambda m, a: m.update(layers={"0": 1}),
    "deep_nesting": lambda m, a: m.update(layers=[_nested(50)]),
}


def _nested(depth):
    layer = {"tag": "KVCache", "meta": {"offset": 0}}
    for _ in range(depth):
        layer = {"tag": "CacheList", "meta": {"children": [layer]}}
    return layer


@pytest.mark.parametrize("name", sorted(EDITS))
def test_bad_metadata(good, name):
    _rewrite(good, EDITS[name])
    _assert_bad(good)


def test_tensor_table_lies_about_a_shape(good):
    data = good.read_bytes()
    n = int.from_bytes(data[:8], "little")
    table = json.loads(data[8 : 8 + n])
    table["0.keys"]["shape"] = [1, 2, 4, 99]  # more bytes than its data offsets span
    blob = json.dumps(table, separators=(",", ":")).encode().ljust(n)  # same length: the file size still adds up
    assert len(blob) == n
    good.write_bytes(data[:8] + blob + data[8 + n :])
    _assert_bad(good)


def test_bad_token_ids_are_refused_at_save(tmp_path):
    c = KVCache()
    _feed(c, [1])
    with pytest.raises(ValueError):
        kvfile.save(tmp_path / "n.safetensors", [-1], [c], fingerprint=FP, ns=NS)


def test_code_in_metadata_is_never_run(good, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    pickled = "cos\nsystem\n(S'touch " + str(marker) + "'\ntR."  # a protocol-0 pickle of os.system(...)
    _rewrite(good, lambda m, a: m["layers"][0].update(tag=payload, meta={"state": pickled}))
    _assert_bad(good)
    _rewrite(good, lambda m, a: m.update(layers=[{"tag": "CacheList", "meta": {"children": [
        {"tag": "posix.system", "meta": {"cmd": payload}}]}}]))
    _assert_bad(good)
    assert not marker.exists()


def test_path_traversal_namespace_is_only_data(tmp_path):
    """A namespace is hashed for paths, and a file claiming a different one is refused when one is expected."""
    c = KVCache()
    _feed(c, [2])
    p = tmp_path / "t.safetensors"
    kvfile.save(p, [1, 2], [c], fingerprint=FP, ns="../../etc")
    h = kvfile.read_header(p)
    assert h.ns_hash == kvfile.ns_hash("../../etc") and all(ch in "0123456789abcdef" for ch in h.ns_hash)
    _assert_bad(p, expect_ns=NS)


def test_host_read_copies_are_new_arrays_with_the_same_bits():
    """--debug-ssd-host-copies: the writer reads copies bit for bit equal to the entry (negative zero and NaN kept,
    every dtype a cache holds), and by default, or off CUDA, the entry's own arrays."""
    arrays = {"f": mx.array([-0.0, 1.5, float("nan"), -3.25], dtype=mx.bfloat16), "q": mx.array([7, 2**31], mx.uint32),
              "b": mx.array([True, False])}
    assert host_copies.host_read_copies(arrays) is arrays  # this process asked for none (and has no CUDA)
    copies = host_copies.host_read_copies(arrays, own_memory=True)
    assert set(copies) == set(arrays)
    for k, x in arrays.items():
        y = copies[k]
        assert y is not x and y.dtype == x.dtype and y.shape == x.shape
        bits = mx.uint16 if x.dtype == mx.bfloat16 else x.dtype
        assert mx.array_equal(y.view(bits), x.view(bits)).item()
