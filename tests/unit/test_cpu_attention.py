"""models.attention.cpu: grouped-query attention folded into the query axis gives mlx-lm's attention (the fused
path's figures to float32 rounding) for every mask kind it takes, hands the others back, and a model switched over
to it computes the same logits."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

from models.attention import cpu as cpu_attention
from tests.fixtures.tiny_models import tiny_llama


def _qkv(B, H, KV, L, S, D=16, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((B, H, L, D)), mx.random.normal((B, KV, S, D)), mx.random.normal((B, KV, S, D)))


@pytest.mark.parametrize("L,S", [(1, 37), (5, 5), (4, 29)])
def test_grouped_attention_equals_the_fused_path_for_every_mask_kind(L, S):
    q, k, v = _qkv(3, 6, 2, L, S)
    lengths = mx.array([S, S - 2, 3])  # rows of different lengths, as a ragged or padded batch masks them
    bool_mask = (mx.arange(S)[None, None, None, :] < lengths[:, None, None, None]) & \
        (mx.arange(S)[None, None, None, :] <= (mx.arange(L) + S - L)[None, None, :, None])
    additive = mx.where(bool_mask, 0.0, -1e9)
    for mask in (None, "causal", bool_mask, additive, bool_mask[0, 0]):
        ours = cpu_attention.grouped_attention(q, k, v, 0.25, mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        assert ours.shape == theirs.shape == (3, 6, L, 16)
        assert mx.allclose(ours, theirs, atol=1e-5), type(mask)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_values_of_another_width_than_the_keys_come_out_at_their_width(mask):
    """Multi-head latent attention's prompt side (GLM-4.7-Flash: 192-wide keys, 256-wide values)."""
    q, k, _ = _qkv(2, 6, 2, 4, 29)
    v = mx.random.normal((2, 2, 29, 24))
    ours = cpu_attention.grouped_attention(q, k, v, 0.25, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert ours.shape == theirs.shape == (2, 6, 4, 24)
    assert mx.allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("L,S", [(1, 37), (4, 29)])
def test_attention_sinks_take_their_share_of_the_softmax_as_the_fused_path_does(L, S):
    """gpt-oss's sinks: one logit per head, a softmax column that weighs no value; with a sliding-window mask too."""
    q, k, v = _qkv(2, 6, 2, L, S, seed=3)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 3.0, -0.5])
    window = (mx.arange(S)[None, :] <= (mx.arange(L) + S - L)[:, None]) & \
        (mx.arange(S)[None, :] > (mx.arange(L) + S - L - 8)[:, None])  # the last 8 keys of each query
    for mask in (None, "causal", window):
        ours = cpu_attention.grouped_attention(q, k, v, 0.25, mask, sinks)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask, sinks=sinks)
        assert mx.allclose(ours, theirs, atol=1e-5), type(mask)
        assert not mx.allclose(ours, cpu_attention.grouped_attention(q, k, v, 0.25, mask), atol=1e-3)


def test_masks_of_other_shapes_go_back_to_mlx_lm():
    q, k, v = _qkv(1, 4, 2, 3, 8)
    per_head = mx.ones((1, 4, 3, 8), dtype=mx.bool_)
    assert cpu_attention.grouped_attention(q, k, v, 1.0, per_head) is None
    wrapped = cpu_attention._wrap(base.scaled_dot_product_attention)
    out = wrapped(q, k, v, cache=None, scale=1.0, mask=per_head)  # handed to mlx-lm's own
    assert mx.allclose(out, mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=per_head), atol=1e-6)


def test_a_switched_model_computes_the_same_logits():
    model = tiny_llama(seed=3)  # 4 query heads over 2 KV heads
    module = __import__(type(model.layers[0].self_attn).__module__, fromlist=["x"])
    previous = module.scaled_dot_product_attention  # an earlier load in this process may have switched it
    module.scaled_dot_product_attention = base.scaled_dot_product_attention
    ids = mx.array([[5, 9, 2, 7, 7, 1, 30, 4]])
    try:
        before = model(ids, cache=make_prompt_cache(model))  # mlx-lm's own path
        assert cpu_attention.install(model) >= 1
        assert module.scaled_dot_product_attention is not base.scaled_dot_product_attention
        cache = make_prompt_cache(model)
        after = model(ids[:, :5], cache=cache)
        step = model(ids[:, 5:], cache=cache)  # a chunk over a cache: the causal mask with S > L
        assert mx.allclose(before[:, :5], after, atol=1e-4) and mx.allclose(before[:, 5:], step, atol=1e-4)
    finally:
        module.scaled_dot_product_attention = previous


def test_the_numpy_softmax_for_large_scores_equals_mlxs_over_threads_and_masked_rows(monkeypatch):
    """Above NUMPY_SOFTMAX_MIN scores the softmax runs in numpy, split over threads: the same attention, and a row
    its mask hides entirely gets zeros (not NaN)."""
    monkeypatch.setattr(cpu_attention, "NUMPY_SOFTMAX_MIN", 1)
    monkeypatch.setattr(cpu_attention, "_threads", lambda: 3)
    q, k, v = _qkv(2, 6, 2, 7, 40, seed=5)
    mask = mx.arange(40)[None, None, None, :] <= (mx.arange(7) + 33)[None, None, :, None]
    mask = mx.concatenate([mask, mx.zeros_like(mask)], axis=0)  # row 1 sees nothing
    ours = cpu_attention.grouped_attention(q, k, v, 0.3, mask)
    theirs = mx.fast.scaled_dot_product_attention(q[:1], k[:1], v[:1], scale=0.3, mask=mask[:1])
    assert mx.allclose(ours[:1], theirs, atol=1e-5)
    assert not mx.any(mx.isnan(ours)).item() and mx.all(ours[1] == 0).item()
