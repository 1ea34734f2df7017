"""models.attention.composed against MLX's fused attention, on the CPU (the path itself is taken on CUDA only)."""

import mlx.core as mx
import pytest

from models.attention import composed
from models.attention.composed import composed_attention
from tests.fixtures.attention_oracle import theirs_and_ours


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
def test_values_wider_than_keys_as_latent_attention_has_them(mask):
    """GLM-4.7-Flash / DeepSeek-V3's multi-head latent attention: 192-wide queries and keys, 256-wide values (scaled
    down here). Its verify steps reached this path on the H100 (2026-12-07) and failed to reshape."""
    q, k, _ = _inputs(D=12)
    mx.random.seed(5)
    v = mx.random.normal((2, 2, 19, 16))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = composed_attention(q, k, v, 0.25, mask)
    assert got.shape == (2, 8, 5, 16)
    _close(got, want)


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


def test_an_unknown_mask_name_is_an_error_and_the_scores_are_capped(monkeypatch):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="unknown attention mask"):
        composed_attention(q, k, v, 0.25, "sliding")
    monkeypatch.setattr(composed, "MAX_QUERIES", 512)
    assert composed.applies(q, k, None)
    assert not composed.applies(mx.zeros((8, 64, 512, 1)), mx.zeros((8, 8, 8192, 1)), None)


def test_the_cuda_wrapper_composes_verify_sized_steps_past_cached_keys_and_hands_on_the_rest(monkeypatch):
    """models.attention.gpu's routing (the wrapper runs on any device; installed on CUDA only): a step of 2..8
    queries over more keys composes, a one-token step, a cold prompt (keys == queries), a longer chunk, quantized
    KV and MAX_QUERIES 0 go to mlx-lm's function."""
    from models.attention import gpu

    calls = []

    def original(q, k, v, cache=None, scale=1.0, mask=None, sinks=None):
        calls.append(q.shape[2])
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)

    attend = gpu._wrap(original)

    class Quantized:
        bits = 8

    for W, S, cache, composes in [(5, 40, None, True), (8, 40, None, True), (1, 40, None, False),
                                  (5, 5, None, False), (9, 40, None, False), (5, 40, Quantized(), False)]:
        calls.clear()
        q, k, v = _inputs(B=1, W=W, S=S)
        got = attend(q, k, v, cache, 0.25, "causal" if W > 1 else None)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal" if W > 1 else None)
        _close(got, want)
        assert (calls == []) == composes, (W, S, calls)
    monkeypatch.setattr(composed, "MAX_QUERIES", 0)
    calls.clear()
    q, k, v = _inputs(B=1, W=5, S=40)
    attend(q, k, v, None, 0.25, "causal")
    assert calls == [5]


@pytest.mark.parametrize("name", ["glm4_moe_lite", "llama"])
def test_a_verify_sized_chunk_past_a_prompt_composes_to_mlx_lms_logits(name, monkeypatch):
    """A GLM-4.7-Flash (the zoo's DeepSeek-V3 layers, values 48 wide and keys 32: multi-head latent attention computes
    a prompt chunk with keys and values of different widths, as the real model's 192 and 256) and the zoo's llama
    with the server's CUDA attention wrapper: a 5-token chunk past a 30-token prompt (what a verify step or a short turn past
    a cache hit is) is composed in every attention layer and gives mlx-lm's logits. Before 2026-12-07 the latent
    attention's chunk failed to reshape here (on the H100, GLM-4.7-Flash's verify step)."""
    from mlx_lm.models.cache import make_prompt_cache

    from models.attention import gpu
    from tests.fixtures import zoo

    monkeypatch.setitem(zoo.ZOO, "glm4_moe_lite", {**zoo.ZOO["deepseek_v3"], "v_head_dim": 48})
    model = zoo.build(name, vocab=256, seed=4)
    prompt = mx.array([[(7 * i + 3) % 250 + 3 for i in range(35)]])
    widths = []
    real = composed.composed_attention

    def counted(queries, keys, values, *args, **kwargs):
        widths.append((queries.shape[-1], values.shape[-1]))
        return real(queries, keys, values, *args, **kwargs)

    def logits():
        caches = make_prompt_cache(model)
        model(prompt[:, :30], cache=caches)
        out = model(prompt[:, 30:], cache=caches).astype(mx.float32)
        mx.eval(out)
        return out

    composed.composed_attention = counted  # the oracle's run calls mlx-lm's function only
    try:
        theirs, ours = theirs_and_ours(model, gpu._wrap, logits)
    finally:
        composed.composed_attention = real
    # the 5-token chunk in every layer (all attention here); the cold 30-token prompt went to mlx-lm's
    assert len(widths) == len(make_prompt_cache(model)) > 1
    if name == "glm4_moe_lite":
        assert set(widths) == {(32, 48)}, widths
    _close(ours, theirs, tol=1e-4)
