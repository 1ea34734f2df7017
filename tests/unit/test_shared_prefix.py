"""models.attention.shared_prefix: a hit's caches that read the entry's KV where it lies give the logits of a plain copy, never
write into the entry, trim back into the prefix, and become plain KVCache layers (the same positions) for whatever
stores or batches them; the engine hands them out only where the model's attention reads segments: the CPU's wrapper
(models.attention.cpu) and the CUDA one (models.attention.gpu, switched in here on the CPU: its decode and verify
steps read the segments, longer chunks their concatenation)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from cache.copying import fork
from models import hook
from models.attention import cpu as cpu_attention
from models.attention import gpu as gpu_attention
from models.attention import reads_segments
from models.attention.shared_prefix import SharedPrefixKVCache, flatten, share_prefix
from tests.fixtures.tiny_models import tiny_llama


def _entry(model, n: int, seed: int = 0) -> list:
    mx.random.seed(seed)
    ids = mx.random.randint(3, 200, (1, n))
    caches = make_prompt_cache(model)
    model(ids, cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.fixture(params=["cpu", "cuda"])
def model(request):
    m = tiny_llama(3)
    if request.param == "cpu":
        cpu_attention.install(m)  # as load_model does on the CPU
    else:
        hook.restore(m, hook.ATTENTION)
        assert hook.switch(m, gpu_attention._wrap) > 0  # as install does on CUDA
    assert reads_segments(m)
    yield m
    hook.restore(m, hook.ATTENTION)


def test_only_a_model_whose_every_attention_reads_segments_is_given_them():
    m = tiny_llama(3)
    hook.restore(m, hook.ATTENTION)
    assert not reads_segments(m)  # mlx-lm's own attention
    assert hook.switch(m, gpu_attention._wrap) > 0
    assert reads_segments(m)
    first = next(mod for mod in hook._modules(m) if getattr(mod, hook.ATTENTION, None) is not None)
    setattr(first, hook.ATTENTION, getattr(first, hook.ATTENTION).mlx_lane_original)  # one module left on mlx-lm's
    assert not reads_segments(m)


def test_the_cuda_wrapper_reads_segments_for_steps_and_joins_them_for_chunks():
    mx.random.seed(3)
    prefix = (mx.random.normal((1, 2, 40, 16)), mx.random.normal((1, 2, 40, 16)))
    cache = SharedPrefixKVCache(*prefix)
    taken = []
    wrapped = gpu_attention._wrap(lambda q, k, v, **kw: taken.append(k.shape[2]) or q[..., :16])
    for width in (1, gpu_attention.MAX_WIDTH):  # a decode step, the widest verify step: read where they lie
        q = mx.random.normal((1, 4, width, 16))
        keys, values = cache.update_and_fetch(mx.random.normal((1, 2, width, 16)), mx.random.normal((1, 2, width, 16)))
        mask = "causal" if width > 1 else None
        out = wrapped(q, keys, values, cache=cache, scale=0.25, mask=mask)
        expected = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask=mask)
        assert mx.allclose(out, expected, atol=1e-5), float(mx.max(mx.abs(out - expected)))
    assert taken == []
    width = gpu_attention.MAX_WIDTH + 1  # a prompt chunk: the joined keys, to cuDNN's path (or composed)
    q = mx.random.normal((1, 4, width, 16))
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, width, 16)), mx.random.normal((1, 2, width, 16)))
    wrapped(q, keys, values, cache=cache, scale=0.25, mask="causal")
    assert taken == [40 + 1 + gpu_attention.MAX_WIDTH + width]


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
    long_chunk = mx.random.randint(3, 200, (1, 12))  # past the CUDA wrapper's MAX_WIDTH: the joined segments there
    for ids in (chunk, chunk[:, :1], chunk[:, 2:3], long_chunk, chunk[:, 3:4]):
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


def test_the_engine_hands_shared_hits_to_a_model_on_either_wrapper(model):
    from server.engine.slot import measure

    assert measure(model, base=True).reads_shared_prefix
    assert not measure(model, base=True, read_shared_prefix=False).reads_shared_prefix  # --debug-copy-hits
