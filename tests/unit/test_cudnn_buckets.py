"""models.attention.buckets: a prompt chunk's attention padded up to bucketed shapes (so that cuDNN's plans repeat)
gives what the unpadded call gives, for every mask it pads; on the CPU, MLX's own attention standing in for cuDNN."""

from __future__ import annotations

import mlx.core as mx
import pytest

from models.attention import buckets


def _attention(q, k, v, *, scale, mask, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def _inputs(B, L, S, H=4, kv=2, D=16, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((B, H, L, D)), mx.random.normal((B, kv, S, D)), mx.random.normal((B, kv, S, D)))


def _same(a, b):
    assert a.shape == b.shape
    assert mx.allclose(a, b, atol=1e-5), float(mx.max(mx.abs(a - b)))


@pytest.mark.parametrize("L,S", [(37, 37), (37, 300), (9, 9 + 5), (64, 64 + 256), (200, 5200)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_lone_causal_chunk_padded_sees_what_it_saw(L, S, with_sinks):
    q, k, v = _inputs(1, L, S)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0]) if with_sinks else None
    calls = []

    def seen(q_, k_, v_, **kw):
        calls.append((q_.shape[2], k_.shape[2]))
        return _attention(q_, k_, v_, **kw)

    ours = buckets.padded_attention(q, k, v, 0.25, "causal", sinks, seen, query_bucket=32, key_bucket=128)
    _same(ours, _attention(q, k, v, scale=0.25, mask="causal", sinks=sinks))
    (rows, keys_seen), = calls
    assert keys_seen % 128 == 0 and rows <= keys_seen  # cuDNN takes no more queries than keys
    if S - L >= 32:  # room for the front rows: the queries are bucketed too
        assert rows % 32 == 0


@pytest.mark.parametrize("lengths", [[20, 7, 13], [5, 5, 5]])
def test_rows_prefilled_together_padded_see_what_their_mask_says(lengths):
    B, L = len(lengths), 6
    S = max(lengths) + L
    q, k, v = _inputs(B, L, S, seed=1)
    # mlx-lm's batch: rows left-padded to a common end, a causal mask that hides each row's padding
    pad = mx.array([S - L - n for n in lengths])
    cols, rows = mx.arange(S), mx.arange(L) + (S - L)
    seen = cols[None, None, None, :] <= rows[None, None, :, None]
    mask = seen & (cols[None, None, None, :] >= pad[:, None, None, None])
    ours = buckets.padded_attention(q, k, v, 0.3, mask, None, _attention, query_bucket=16, key_bucket=64)
    _same(ours, _attention(q, k, v, scale=0.3, mask=mask))


def test_a_window_layers_two_dimensional_mask_and_no_mask():
    L, S = 10, 40
    q, k, v = _inputs(1, L, S, seed=2)
    cols, rows = mx.arange(S), mx.arange(L) + (S - L)
    window = (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - 16)
    _same(buckets.padded_attention(q, k, v, 0.3, window, None, _attention, query_bucket=16, key_bucket=64),
          _attention(q, k, v, scale=0.3, mask=window))
    _same(buckets.padded_attention(q, k, v, 0.3, None, None, _attention, query_bucket=16, key_bucket=64),
          _attention(q, k, v, scale=0.3, mask=None))


def test_only_what_cudnn_would_plan_is_padded(monkeypatch):
    q16, k16, v16 = (a.astype(mx.bfloat16) for a in _inputs(1, 12, 40))
    assert not buckets.applies(q16, k16, v16, "causal")  # off by default
    monkeypatch.setattr(buckets, "QUERY_BUCKET", 64)
    monkeypatch.setattr(buckets, "KEY_BUCKET", 256)
    assert buckets.applies(q16, k16, v16, "causal")
    assert buckets.applies(q16, k16, v16, mx.ones((1, 1, 12, 40), mx.bool_))
    assert not buckets.applies(q16, k16, v16, mx.zeros((1, 1, 12, 40)))  # additive: scores of its own
    assert not buckets.applies(q16[:, :, :1], k16, v16, None)  # a decode step
    assert not buckets.applies(*_inputs(1, 12, 40), "causal")  # float32: cuDNN does not take it
    wide = mx.zeros((1, 4, 12, 256), mx.bfloat16)
    assert not buckets.applies(wide, wide, wide, "causal")  # head size 256: MLX's own fallback, no plan


def test_configure_takes_both_or_neither():
    with pytest.raises(ValueError):
        buckets.configure(64, 0)
    with pytest.raises(ValueError):
        buckets.configure(-1, -1)
    buckets.configure(0, 0)
    assert buckets.QUERY_BUCKET == buckets.KEY_BUCKET == 0


@pytest.mark.parametrize("name", ["llama", "gpt_oss", "gemma3_text", "qwen3_5"])
def test_a_models_chunks_through_the_cuda_wrapper_with_buckets_give_mlx_lms_logits(name, monkeypatch):
    """A zoo model (gpt-oss: sinks and window layers; gemma3: window masks; qwen3.5: a hybrid) through
    models.attention.gpu's wrapper with the buckets on: a lone 12-token chunk past a 30-token prompt, then three rows
    prefilled together past cached tokens of their own, give mlx-lm's logits; and the padded path was taken."""
    from mlx_lm.models.cache import make_prompt_cache

    from models.attention import gpu as gpu_attention
    from tests.fixtures import zoo
    from tests.fixtures.attention_oracle import theirs_and_ours

    monkeypatch.setattr(buckets, "CUDNN_DTYPES", (mx.float32,))  # on the CPU the models are float32
    monkeypatch.setattr(buckets, "QUERY_BUCKET", 16)
    monkeypatch.setattr(buckets, "KEY_BUCKET", 64)
    padded = []
    real = buckets.padded_attention
    monkeypatch.setattr(buckets, "padded_attention", lambda *a, **k: padded.append(1) or real(*a, **k))
    model = zoo.build(name, vocab=256, seed=4)
    prompt = [(13 * i + 7) % 250 + 3 for i in range(60)]

    def logits():
        lone = make_prompt_cache(model)
        model(mx.array([prompt[:30]]), cache=lone)
        out = [model(mx.array([prompt[30:42]]), cache=lone)]
        rows = []
        for n in (30, 9, 21):
            row = make_prompt_cache(model)
            model(mx.array([prompt[:n]]), cache=row)
            rows.append(row)
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]
        out.append(model(mx.array([prompt[n: n + 12] for n in (30, 9, 21)]), cache=batch))
        mx.eval(out)
        return out

    theirs, ours = theirs_and_ours(model, gpu_attention._wrap, logits)
    for a, b in zip(theirs, ours):
        assert mx.allclose(a, b, atol=1e-4), float(mx.max(mx.abs(a - b)))
    assert padded  # the chunks took the padded path


def test_a_forwards_layers_share_one_padded_mask():
    """The layers of one forward pass the same mask: it is padded once, not once a layer; another mask is its own."""
    q, k, v = _inputs(2, 6, 30, seed=3)
    mask = mx.ones((2, 1, 6, 30), mx.bool_)
    seen = []

    def attention(q_, k_, v_, *, scale, mask, sinks=None):
        seen.append(mask)
        return _attention(q_, k_, v_, scale=scale, mask=mask, sinks=sinks)

    for _ in range(3):
        buckets.padded_attention(q, k, v, 0.3, mask, None, attention, query_bucket=16, key_bucket=64)
    assert seen[0] is seen[1] is seen[2]
    buckets.padded_attention(q, k, v, 0.3, mx.ones((2, 1, 6, 30), mx.bool_), None, attention, query_bucket=16,
                             key_bucket=64)
    assert seen[3] is not seen[0]
