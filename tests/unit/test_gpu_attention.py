"""models.attention.gpu: the columns its fused CUDA kernel lets each query see (``row_ranges``) are exactly what the
batch caches' masks say, for both decode-batch layouts, and the path stays out of the way where it does not apply.

The kernel itself runs only on MLX's CUDA backend; CI has no GPU, so its arithmetic is checked against
``reference_attention`` on the H200 by ``bench/gpu_attention.py --parts check`` (BENCHMARKS.md). What is checked here
is everything around it: the ranges (a wrong range would be silently wrong text on a GPU), the reference the
benchmark holds the kernel to, and when the path is taken."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache

from models.attention import gpu as gpu_attention
from server.engine.batch.ragged_kv import RaggedKV

KV, D = 2, 16


def _row(n: int, seed: int) -> list:
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, KV, n, D)), mx.random.normal((1, KV, n, D)))
    return [c]


def _new(B: int, W: int, seed: int = 7):
    mx.random.seed(seed)
    return mx.random.normal((B, KV, W, D)), mx.random.normal((B, KV, W, D)), mx.random.normal((B, 3 * KV, W, D))


def _masked(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)


@pytest.mark.parametrize("W", [1, 3])
def test_ragged_rows_ranges_are_the_ragged_mask(W):
    lengths = [5, 17, 1, 9]  # rows of very different lengths, left-aligned in one buffer
    kv = RaggedKV.from_rows([_row(n, i) for i, n in enumerate(lengths)])
    kv.reserve(W)
    layer = kv.layers[0]
    mask = layer.make_mask(W)  # built before the forward writes, as the model does
    nk, nv, q = _new(len(lengths), W)
    keys, values = layer.update_and_fetch(nk, nv)
    start, last = gpu_attention.row_ranges(layer, W)
    assert start.tolist() == [0, 0, 0, 0] and last.tolist() == lengths
    ours = gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last)
    assert mx.allclose(ours, _masked(q, keys, values, mask), atol=1e-5)


@pytest.mark.parametrize("W", [1, 2])
def test_left_padded_rows_ranges_are_mlx_lms_batch_mask(W):
    lengths = [6, 11, 3]
    rows = [_row(n, i) for i, n in enumerate(lengths)]
    batch = KVCache.merge([r[0] for r in rows])  # mlx-lm's BatchKVCache: rows right-justified, left-padded
    mask = batch.make_mask(W)
    nk, nv, q = _new(len(lengths), W)
    keys, values = batch.update_and_fetch(nk, nv)
    start, last = gpu_attention.row_ranges(batch, W)
    assert start.tolist() == [11 - n for n in lengths] and last.tolist() == [11] * 3
    ours = gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last)
    assert mx.allclose(ours, _masked(q, keys, values, mask), atol=1e-5)


def test_caches_without_known_ranges_keep_their_mask():
    assert gpu_attention.row_ranges(KVCache(), 1) is None  # one sequence: MLX's own kernels take it
    batch = KVCache.merge([_row(4, 0)[0], _row(2, 1)[0]])
    batch.prepare(right_padding=[0, 2])  # a batched prefill's right padding: the mask knows more than the ranges
    assert gpu_attention.row_ranges(batch, 1) is None


def test_only_decode_shaped_16_bit_steps_qualify():
    q = mx.zeros((4, 32, 1, 128), dtype=mx.bfloat16)
    k = mx.zeros((4, 8, 300, 128), dtype=mx.bfloat16)
    assert gpu_attention._applies(q, k, k, object())
    assert not gpu_attention._applies(q.astype(mx.float32), k.astype(mx.float32), k.astype(mx.float32), object())
    wide = mx.zeros((4, 32, gpu_attention.MAX_WIDTH + 1, 128), dtype=mx.bfloat16)  # a prefill chunk: cuDNN's
    assert not gpu_attention._applies(wide, k, k, object())
    assert not gpu_attention._applies(q[..., :80], k[..., :80], k[..., :80], object())  # head size 80

    class Quantized:
        bits = 8

    assert not gpu_attention._applies(q, k, k, Quantized())


def test_a_window_layers_ranges_and_sinks_are_what_its_mask_and_mlx_say():
    """A sliding-window layer of the ragged batch: the reference the kernel is checked against (window + sinks)
    equals MLX's attention over the mask the layer gives the model, sinks included."""
    from mlx_lm.models.cache import RotatingKVCache

    def window_row(n, seed, window=6):
        mx.random.seed(seed)
        c = RotatingKVCache(max_size=window, keep=0)
        for i in range(n):  # token by token: the buffer wraps and rotates as a decode's would
            c.update_and_fetch(mx.random.normal((1, 2, 1, D)), mx.random.normal((1, 2, 1, D)))
        return [c]

    lengths = [3, 9, 14]
    kv = RaggedKV.from_rows([window_row(n, i) for i, n in enumerate(lengths)])
    layer = kv.layers[0]
    assert layer.attention_window == 6
    W = 2
    mx.random.seed(9)
    q = mx.random.normal((3, 4, W, D))
    kv.reserve(W)
    keys, values = layer.update_and_fetch(mx.random.normal((3, 2, W, D)), mx.random.normal((3, 2, W, D)))
    mask = layer.make_mask(W)
    start, last = gpu_attention.row_ranges(layer, W)
    sinks = mx.random.normal((4,))
    ours = gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last, window=6, sinks=sinks)
    theirs = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, mask=mask, sinks=sinks)
    assert mx.allclose(ours, theirs, atol=1e-5)
    # the window really narrows what is seen: without it the answer differs
    assert not mx.allclose(ours, gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last,
                                                                   sinks=sinks), atol=1e-3)


def test_not_installed_off_cuda():
    from tests.fixtures.tiny_models import tiny_llama

    model = tiny_llama(0)
    assert gpu_attention.install(model) == 0  # this machine's MLX is the CPU build, or no CUDA device
    try:
        gpu_attention.configure(on=False)  # --attention mlx
        assert not gpu_attention.enabled()
    finally:
        gpu_attention.configure()


def test_the_wrapper_hands_what_does_not_apply_to_mlx_lm():
    calls = []

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append(mask)
        return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)

    wrapped = gpu_attention._wrap(original)
    q, k, v = (mx.random.normal((1, 2, 1, 16)) for _ in range(3))
    out = wrapped(q, k, v, cache=KVCache(), scale=0.25, mask=None)  # float32, one row: not the kernel's
    assert calls == [None] and out.shape == (1, 2, 1, 16)
