"""Attention for grouped-query models on the CPU, without copying the keys and values once per query head.

mlx-lm's models call ``mlx_lm.models.base.scaled_dot_product_attention``, which calls
``mx.fast.scaled_dot_product_attention``. MLX has no fused kernel for it on the CPU: its fallback puts each KV
head's group of query heads on an axis of its own and broadcasts the keys and values over it in two batched
matmuls, which copies them (measured with the default model, 9 query heads over 3 KV heads, float32 + OpenBLAS:
a batched decode step of 8 rows at 3,000 tokens of context 838 ms, 618 ms here).

Here a KV head's query heads are folded into the query-length axis instead (``(B, H, L, D)`` ->
``(B, KV, H/KV * L, D)``: a reshape, no copy), so each matmul reads every key and value once. And the softmax, which
is most of a long prompt's prefill on the CPU (MLX's exp there is scalar, ~4x numpy's), runs in numpy over both
cores once the scores are large (``_softmax``). The arithmetic is the same (scores, mask, a float32 softmax, the
weighted sum); the logits differ from the fused path's in the last bits only (default model: at most 3e-5 of a
logit, the same argmax).

``install(model)`` swaps the function in the modules of the model's layers (mlx-lm imports it by name into each
model module) for one that takes this path where it applies and hands everything else to mlx-lm's own: quantized
KV (``cache.bits``), one KV head per query head, masks of other shapes. Sliding windows come as masks; attention
sinks (gpt-oss: a per-head logit that takes probability mass and gives no value) are a column of the softmax. Only
on the CPU: a GPU has fused kernels. `--attention mlx` leaves mlx-lm's path in place (to compare).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import numpy as np

from models.hook import switch, switched_functions
from models.attention.shared_prefix import SharedPrefixKVCache, segmented_attention

__all__ = ["install", "grouped_attention"]


def grouped_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: Optional[mx.array | str], sinks: Optional[mx.array] = None) -> Optional[mx.array]:
    """``softmax(q k^T * scale + mask) v`` for ``queries`` (B, H, L, D) over ``keys`` (B, KV, S, D) and ``values``
    (B, KV, S, Dv), H a multiple of KV (the result is (B, H, L, Dv)); ``mask`` None, ``"causal"`` (query i sees keys
    up to i + S - L), or a bool / additive array of shape (L, S), (B or 1, 1, L, S); ``sinks`` (H,): each head's sink
    logit, one more column of its softmax that weighs no value. Returns None for a mask it does not take (the caller
    falls back)."""
    return segmented_attention(queries, [(keys, values)], scale, mask, sinks, softmax=_softmax)


def _softmax(scores: mx.array) -> mx.array:
    """A float32 softmax over the last axis. MLX's CPU elementwise kernels are scalar: its exp costs ~25 ns per
    element on this machine, numpy's 6.4, so above ``NUMPY_SOFTMAX_MIN`` scores (a long prompt's chunk, a batch of
    long rows) the scores are evaluated and the softmax runs in numpy, split over ``_threads()`` (numpy lets go of
    the GIL in its loops), then goes back into the graph; below it the synchronisation would cost more than it saves."""
    if scores.size < NUMPY_SOFTMAX_MIN or scores.dtype != mx.float32:
        return mx.softmax(scores, axis=-1, precise=True)
    mx.eval(scores)
    a = np.asarray(scores).reshape(-1, scores.shape[-1])
    out = np.empty_like(a)

    def part(lo: int, hi: int) -> None:
        x, y = a[lo:hi], out[lo:hi]
        top = x.max(axis=-1, keepdims=True)
        np.subtract(x, np.where(np.isfinite(top), top, 0.0), out=y)  # a row masked out entirely gives zeros
        np.exp(y, out=y)
        total = y.sum(axis=-1, keepdims=True)
        np.divide(y, np.where(total > 0, total, 1.0), out=y)

    n, k = a.shape[0], _threads()
    if k == 1 or n < 2 * k:
        part(0, n)
    else:
        cuts = [n * i // k for i in range(k + 1)]
        list(_pool().map(lambda i: part(cuts[i], cuts[i + 1]), range(k)))
    return mx.array(out.reshape(scores.shape))


NUMPY_SOFTMAX_MIN = 1 << 16  # scores: 8 rows at ~900 tokens of context, or a 512-token chunk at ~40
_POOL = None


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(_threads(), thread_name_prefix="mlx-lane-softmax")
    return _POOL


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, SharedPrefixKVCache):  # keys/values: its lazy concatenation, unused
            out = segmented_attention(queries, cache.segments(), scale, mask, sinks, softmax=_softmax)
            if out is not None:
                return out
        if not hasattr(cache, "bits") and queries.ndim == 4 and keys.ndim == 4 \
                and queries.shape[1] != keys.shape[1] and queries.shape[1] % keys.shape[1] == 0:
            out = grouped_attention(queries, keys, values, scale, mask, sinks)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.mlx_lane_original = original
    scaled_dot_product_attention.mlx_lane_path = "cpu"
    scaled_dot_product_attention.mlx_lane_reads_segments = True  # models.attention.reads_segments
    return scaled_dot_product_attention


_ON = True  # --attention mlx: MLX's own attention everywhere


def configure(on: bool = True) -> None:
    """The process's setting (server.serve, from `--attention`), before a model is loaded."""
    global _ON
    _ON = bool(on)


def install(model) -> int:
    """On the CPU, route the attention of ``model``'s modules through ``grouped_attention``; returns how many model
    modules were switched (0 on a GPU, after ``configure(on=False)``, or where a model has its own)."""
    if mx.default_device() != mx.cpu or not _ON:
        return 0
    return switch(model, _wrap)
