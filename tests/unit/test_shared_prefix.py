"""models.attention.shared_prefix: a hit's caches that read the entry's KV where it lies give the logits of a plain copy, never
write into the entry, trim back into the prefix, and become plain KVCache layers (the same positions) for whatever
stores or batches them; the engine hands them out only where the model's attention reads segments."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from cache.copying import fork
from models.attention import cpu as cpu_attention
from models.attention.shared_prefix import SharedPrefixKVCache, flatten, share_prefix
from tests.fixtures.tiny_models import tiny_llama


def _entry(model, n: int, seed: int = 0) -> list:
    mx.random.seed(seed)
    ids = mx.random.randint(3, 200, (1, n))
    caches = make_prompt_cache(model)
    model(ids, cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.fixture
def model():
    m = tiny_llama(3)
    cpu_attention.install(m)  # as load_model does on the CPU
    assert cpu_attention.routes(m)
    return m


def test_segments_and_plain_view_hold_the_same_positions():
    k, v = mx.random.normal((1, 2, 7, 8)), mx.random.normal((1, 2, 7, 8))
    c = SharedPrefixKVCache(k, v)
    nk, nv = mx.random.normal((1, 2, 3, 8)), mx.random.normal((1, 2, 3, 8))
    c.update_and_fetch(nk, nv)
    assert c.offset == 10 and c.prefix_length == 7
    assert [s[0].shape[2] for s in c.segments()] == [7, 3]
    assert mx.array_equal(c.keys, mx.concatenate([k, nk], axis=2))
    flat = c.flatten()
    assert type(flat) is KVCache and flat.offset == 10 and mx.array_equal(flat.values, mx.concatenate([v, nv], axis=2))


def test_trim_goes_back_into_the_prefix_without_touching_it():
    k, v = mx.random.normal((1, 2, 7, 8)), mx.random.normal((1, 2, 7, 8))
    c = SharedPrefixKVCache(k, v)
    c.update_and_fetch(mx.ones((1, 2, 2, 8)), mx.ones((1, 2, 2, 8)))
    assert c.trim(1) == 1 and c.offset == 8
    assert c.trim(4) == 4 and c.offset == 4 and c.prefix_length == 4
    c.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    assert mx.array_equal(c.keys[..., :4, :], k[..., :4, :])
    assert mx.array_equal(c.keys[..., 4:, :], mx.zeros((1, 2, 1, 8)))
    assert k.shape == (1, 2, 7, 8)  # the entry's arrays: unchanged


def test_a_hit_through_shared_segments_gives_a_plain_copys_logits_and_leaves_the_entry_alone(model):
    entry = _entry(model, 40)
    before = [mx.array(c.keys) for c in entry]
    shared = share_prefix(fork(entry))
    assert all(isinstance(c, SharedPrefixKVCache) for c in shared)
    plain = [KVCache() for _ in entry]
    for p, e in zip(plain, entry):
        p.update_and_fetch(mx.array(e.keys[..., :e.offset, :]), mx.array(e.values[..., :e.offset, :]))
    mx.random.seed(5)
    chunk = mx.random.randint(3, 200, (1, 6))  # a multi-token chunk (causal mask over both segments), then steps
    for ids in (chunk, chunk[:, :1], chunk[:, 2:3]):
        a = model(ids, cache=shared)
        b = model(ids, cache=plain)
        assert mx.allclose(a, b, atol=1e-4), float(mx.max(mx.abs(a - b)))
    for c in shared + plain:
        c.trim(3)  # a rejected draft's rewind, then one more step
    assert mx.allclose(model(chunk[:, 4:5], cache=shared), model(chunk[:, 4:5], cache=plain), atol=1e-4)
    assert all(mx.array_equal(b, c.keys) for b, c in zip(before, entry))  # never written into


def test_flatten_gives_evaluated_plain_layers_for_the_store_and_the_batch(model):
    shared = share_prefix(fork(_entry(model, 12)))
    model(mx.array([[5, 6]]), cache=shared)
    flat = flatten(shared)
    assert all(type(c) is KVCache and c.offset == 14 for c in flat)
    plain = [KVCache()]
    assert flatten(plain) is plain  # nothing to do: the same list


def test_only_plain_kv_layers_with_positions_are_shared():
    assert share_prefix([]) == []
    empty = [KVCache()]
    assert share_prefix(empty) is empty
    from mlx_lm.models.cache import RotatingKVCache

    rot = RotatingKVCache(max_size=8)
    rot.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    assert share_prefix([rot]) == [rot]


def test_a_pipeline_style_assignment_keeps_the_positions():
    k, v = mx.random.normal((1, 2, 5, 8)), mx.random.normal((1, 2, 5, 8))
    c = SharedPrefixKVCache(k, v)
    c.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    c.keys = mx.depends(c.keys, mx.zeros((1,)))  # what a pipeline-parallel model does to order its ranks
    assert c.offset == 6 and mx.array_equal(c.keys[..., 5:, :], mx.ones((1, 2, 1, 8)))
    assert mx.array_equal(c.values[..., :5, :], v)


def test_a_ragged_batch_takes_shared_rows_as_they_lie(model):
    from server.engine.batch.ragged_kv import RaggedKV

    entry = _entry(model, 30, seed=1)
    shared = share_prefix(fork(entry))
    model(mx.array([[7, 8, 9]]), cache=shared)  # the hit's own positions: a tail after the shared prefix
    plain = flatten(shared)
    other = _entry(model, 11, seed=2)
    a = RaggedKV.from_rows([shared, fork(other)])
    b = RaggedKV.from_rows([plain, fork(other)])
    assert a.lengths == b.lengths == [33, 11]
    for x, y in zip(a._keys + a._values, b._keys + b._values):
        assert mx.array_equal(x, y)
