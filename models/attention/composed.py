"""A few queries past a long cached prefix, in plain MLX ops (scores, a masked softmax, a matmul), on CUDA.

Why not ``mx.fast.scaled_dot_product_attention``: on CUDA it hands any step of more than one query (head size up to
128) to cuDNN, which builds an execution plan for each exact shape it meets (queries, keys, mask: mlx 0.32,
``backend/cuda/scaled_dot_product_attention.cpp``, a per-thread cache of 256 plans). A single sequence's verify
step (1 + k drafted tokens) meets a key length never seen before every step. Measured on the H200 with gpt-oss-20b
(``bench/gpu_prefill_after_hit.py``, BENCHMARKS.md 2026-12-05): a 128-token chunk after a 5k-token hit took 27 ms
through cuDNN once its shape was known, 89 ms when it was new, 46 ms here either way the first time (34 ms later).
So by default (``MAX_QUERIES`` = 8) only verify-sized steps come here: for prompt chunks of
hundreds of tokens cuDNN's plan pays once shapes repeat, and served agents were no faster with them here.
MLX's own composed fallback (``fast.cpp``) computes the same, but only where cuDNN refuses.

``composed_attention`` takes what the fast function takes (grouped heads, ``"causal"`` aligned to the last key, a
boolean or additive array mask, gpt-oss's sinks) and computes it as MLX's fallback does: scores in the inputs'
dtype, a precise (float32) softmax. ``applies`` says where models.attention.gpu takes it: 2..``MAX_QUERIES``
queries per row over more keys than queries, KV not quantized, and scores under ``MAX_SCORES`` at once.
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx

__all__ = ["composed_attention", "applies", "configure", "MAX_SCORES"]

MAX_SCORES = 1 << 28  # score elements one call may hold (512 MiB in bf16): past that, the fused kernel's memory wins
# Queries per row up to which a step past cached keys comes here (--debug-gpu-attention-composed-max; 0: never).
# Measured on the H200 (BENCHMARKS.md, 2026-12-05): gpt-oss chunks of 128-330 tokens after a 5k hit took 46-64 ms
# here vs 89-103 ms through cuDNN when their shape was new, but 34-63 vs 27-41 ms once seen, and served agents
# (whose later turns prefill together) were no faster at 512 (34.5 vs 32.8 s, one run each): so not past 8.
MAX_QUERIES = 8


def configure(max_queries: int = 8) -> None:
    """The process's setting (models.attention.gpu.configure, from --debug-gpu-attention-composed-max)."""
    global MAX_QUERIES
    if max_queries < 0:
        raise ValueError(f"composed attention's max queries {max_queries} out of range (at least 0)")
    MAX_QUERIES = int(max_queries)


def applies(queries: mx.array, keys: mx.array, cache) -> bool:
    """A step of 2..MAX_QUERIES queries per row over more keys than queries (a single sequence's verify step; a short
    chunk past a cache hit with a larger MAX_QUERIES), KV not quantized, its scores (B x H x W x S) under MAX_SCORES:
    cuDNN would build a plan for its never-seen shape."""
    if hasattr(cache, "bits") or queries.ndim != 4 or keys.ndim != 4:
        return False
    B, H, W, _ = queries.shape
    S = keys.shape[2]
    return 1 < W <= MAX_QUERIES and S > W and B * H * W * S <= MAX_SCORES


def composed_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                       mask: Union[None, str, mx.array] = None, sinks: Optional[mx.array] = None) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` for ``queries`` (B, H, W, D), ``keys`` (B, KV, S, D) and ``values``
    (B, KV, S, Dv), H a multiple of KV (Dv may differ from D: multi-head latent attention, GLM-4.7-Flash / DeepSeek-V3,
    has 192-wide keys and 256-wide values); the result is (B, H, W, Dv). ``mask`` None, ``"causal"`` (query i sees
    keys up to ``S - W + i``) or an array broadcastable to (B, H, W, S), boolean (True: seen) or additive; ``sinks``
    (H,): one more logit per query head, with no value."""
    B, H, W, D = queries.shape
    kv, S = keys.shape[1], keys.shape[2]
    rep = H // kv
    q = (queries * mx.array(scale, dtype=queries.dtype)).reshape(B, kv, rep, W, D)
    scores = q @ mx.swapaxes(keys, -1, -2)[:, :, None]  # (B, KV, rep, W, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        seen = mx.arange(S)[None, :] <= (mx.arange(W) + (S - W))[:, None]
        scores = mx.where(seen, scores, mx.array(-mx.inf, dtype=scores.dtype))
    elif mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape) if mask.ndim < 4 else mask
        # (B|1, H|1, W, S) -> (B|1, KV|1, rep|1, W, S)
        m = m.reshape(m.shape[0], 1, 1, *m.shape[2:]) if m.shape[1] == 1 else m.reshape(
            m.shape[0], kv, rep, *m.shape[2:])
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(-mx.inf, dtype=scores.dtype))
        else:
            scores = scores + m.astype(scores.dtype)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kv, rep, 1, 1), (B, kv, rep, W, 1))
        weights = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)[..., 1:]
    else:
        weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values[:, :, None]).reshape(B, H, W, values.shape[-1])
