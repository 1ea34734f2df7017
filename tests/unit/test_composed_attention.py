"""models.attention.composed against MLX's fused attention, on the CPU (the path itself is taken on CUDA only)."""

import mlx.core as mx
import pytest

from models.attention.composed import composed_attention, fits


def _inputs(B=2, H=8, kv=2, W=5, S=19, D=16, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, H, W, D)).astype(dtype)
    k = mx.random.normal((B, kv, S, D)).astype(dtype)
    v = mx.random.normal((B, kv, S, D)).astype(dtype)
    return q, k, v


def _close(a, b, tol=1e-5):
    assert a.shape == b.shape
    assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tol, rtol=tol).item(), \
        mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


@pytest.mark.parametrize("kv", [1, 2, 8])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_grouped_heads_with_no_mask_or_a_causal_one_aligned_to_the_last_key(kv, mask):
    q, k, v = _inputs(kv=kv)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    _close(composed_attention(q, k, v, 0.25, mask), want)


@pytest.mark.parametrize("shape", [(2, 1, 5, 19), (1, 1, 5, 19), (2, 8, 5, 19), (5, 19), (1, 5, 19)])
def test_boolean_and_additive_array_masks_broadcast_as_the_fused_kernel_does(shape):
    q, k, v = _inputs()
    mx.random.seed(3)
    seen = mx.random.uniform(shape=shape) > 0.3
    seen = seen | (mx.arange(19) == 0)  # every query sees at least one key
    for mask in (seen, mx.where(seen, 0.0, -1e9).astype(mx.float32)):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
        _close(composed_attention(q, k, v, 0.3, mask), want)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_sinks_add_one_logit_per_query_head_with_no_value(mask):
    q, k, v = _inputs(H=4, kv=2)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask, sinks=sinks)
    _close(composed_attention(q, k, v, 0.25, mask, sinks=sinks), want)


def test_bfloat16_inputs_keep_their_dtype_and_agree_to_bf16_precision():
    q, k, v = _inputs(dtype=mx.bfloat16)
    got = composed_attention(q, k, v, 0.25, "causal")
    assert got.dtype == mx.bfloat16
    want = mx.fast.scaled_dot_product_attention(*(x.astype(mx.float32) for x in (q, k, v)), scale=0.25,
                                                mask="causal")
    _close(got, want, tol=3e-2)


def test_an_unknown_mask_name_is_an_error_and_fits_caps_the_scores():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="unknown attention mask"):
        composed_attention(q, k, v, 0.25, "sliding")
    assert fits(q, k)
    assert not fits(mx.zeros((8, 64, 512, 1)), mx.zeros((8, 8, 8192, 1)))
