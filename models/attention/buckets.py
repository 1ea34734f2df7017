"""Prompt chunks' attention padded to a few shapes, so that cuDNN's plans are reused (CUDA; off by default).

MLX's CUDA backend hands a prompt chunk's attention (more than one query a row, head size up to 128, 16-bit) to
cuDNN, which builds an execution plan for each exact (queries, keys, values, mask) shape and strides it meets (mlx
0.32, ``backend/cuda/scaled_dot_product_attention.cpp``: ``build_sdpa_cache_key``, a per-thread cache of 256 plans).
An agent's turn is a chunk of a new length past a context of a new length, so nearly every such forward plans anew:
on the H100 a gpt-oss-20b chunk after a 5k-token hit took 106 / 117 / 162 ms at 128 / 330 / 1,024 tokens when its
shape was new and 29 / 48 / 85 ms once planned (BENCHMARKS.md, 2026-12-07, thirteenth session).

Here such a call is padded up to buckets (``QUERY_BUCKET`` queries, ``KEY_BUCKET`` keys) and handed to the same
function, so that turns of nearby lengths meet a plan already built. The padding never changes what a real query
sees:

- ``"causal"`` (a lone sequence's chunk; cuDNN aligns it bottom-right: query r of L sees keys up to r + S - L):
  ``front`` zero queries before the chunk and ``end`` zero queries and zero keys after it. A real query i then sits
  at row front + i of front + L + end rows over S + end keys, and sees keys up to i + S - L, as before; the front
  rows see less, the end rows the zero keys; both are cut from the result. ``front`` is at most the cached keys
  (S - L), since cuDNN takes no more queries than keys.
- a boolean array mask, (L, S) or (B or 1, 1, L, S) (a sliding-window layer's chunk; rows prefilled together,
  left-padded): queries and keys after the real ones, the padded keys hidden from every real query, each padded
  query seeing the first key (no empty row).
- no mask (every query sees every key): the queries alone.

The cost: the copies of the padded queries, keys and values (a forward's K/V once: ~0.25 GB for gpt-oss-20b at 5k
tokens, well under a millisecond on an H100) and the padded rows' arithmetic, against a plan's ~70 ms. Whether it pays
served is not measured yet, so ``--debug-cudnn-buckets Q,K`` turns it on (``configure``); ``0`` (the default) leaves
every call as it is.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

__all__ = ["configure", "applies", "padded_attention", "QUERY_BUCKET", "KEY_BUCKET"]

QUERY_BUCKET = 0  # queries a chunk is padded to a multiple of (0: off)
KEY_BUCKET = 0  # keys likewise
CUDNN_DTYPES = (mx.bfloat16, mx.float16)  # what cuDNN's attention takes (float32 goes to MLX's own, unplanned)


def configure(query_bucket: int = 0, key_bucket: int = 0) -> None:
    """The process's setting (models.attention.configure, from ``--debug-cudnn-buckets Q,K``): both 0 (off) or both
    positive."""
    global QUERY_BUCKET, KEY_BUCKET
    if query_bucket < 0 or key_bucket < 0 or (query_bucket == 0) != (key_bucket == 0):
        raise ValueError(f"cuDNN buckets {query_bucket},{key_bucket}: both 0 (off) or both positive")
    QUERY_BUCKET, KEY_BUCKET = int(query_bucket), int(key_bucket)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def applies(queries: mx.array, keys: mx.array, values: mx.array, mask) -> bool:
    """A call cuDNN would take and plan (mlx 0.32's ``supports_sdpa_cudnn`` for a prompt chunk): on, more than one
    query a row, 16-bit, head sizes multiples of 8 up to 128, and a mask this module pads (``"causal"``, none, or a
    boolean (L, S) or (B or 1, 1, L, S) array: a window layer's, rows prefilled together)."""
    if not QUERY_BUCKET or queries.ndim != 4 or keys.ndim != 4 or queries.shape[2] <= 1:
        return False
    if queries.dtype not in CUDNN_DTYPES:
        return False
    if any(d % 8 or d > 128 for d in (queries.shape[-1], values.shape[-1])):
        return False
    if mask is None or isinstance(mask, str):
        return mask in (None, "causal")
    return mask.dtype == mx.bool_ and (mask.ndim == 2 or (mask.ndim == 4 and mask.shape[1] == 1))


def padded_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask,
                     sinks: Optional[mx.array], attention: Callable, query_bucket: int = 0,
                     key_bucket: int = 0) -> mx.array:
    """``attention(queries, keys, values, scale=, mask=, sinks=)`` computed over shapes padded up to the buckets (the
    module doc says how); the module's buckets when none are given. ``mask``: one that ``applies`` takes."""
    query_bucket, key_bucket = query_bucket or QUERY_BUCKET, key_bucket or KEY_BUCKET
    L, S = queries.shape[2], keys.shape[2]
    if mask is None:  # every query sees every key: only the queries are padded (a padded key would be seen)
        rows = _round_up(L, query_bucket) - L
        return attention(_pad(queries, 0, rows), _pad(keys, 0, 0), _pad(values, 0, 0), scale=scale, mask=None,
                         sinks=sinks)[:, :, :L]
    end = _round_up(S, key_bucket) - S
    k, v = _pad(keys, 0, end), _pad(values, 0, end)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"no padding for the attention mask {mask!r}")
        front = min(_round_up(L + end, query_bucket) - (L + end), max(S - L, 0))  # at most the cached keys
        out = attention(_pad(queries, front, end), k, v, scale=scale, mask="causal", sinks=sinks)
        return out[:, :, front: front + L]
    rows = _round_up(L, query_bucket) - L
    m = _padded_mask(mask, L, S, rows, end)
    return attention(_pad(queries, 0, rows), k, v, scale=scale, mask=m, sinks=sinks)[:, :, :L]


# The last two masks padded, with the masks they came from (held, so that an id is never reused meanwhile): a model's
# layers share one mask a forward (two where window layers alternate with full ones), so each is padded once a
# forward, not once a layer (rows prefilled together at 2k x 6k: ~100 MB a copy)
_PADDED: list[tuple[mx.array, tuple[int, int], mx.array]] = []
_PADDED_KEPT = 2  # held between forwards too: a window layer's and a full layer's


def _padded_mask(mask: mx.array, L: int, S: int, rows: int, end: int) -> mx.array:
    for source, pads, padded in _PADDED:
        if source is mask and pads == (rows, end):
            return padded
    m = mask.reshape(1, 1, L, S) if mask.ndim == 2 else mx.broadcast_to(mask, (mask.shape[0], 1, L, S))
    if end:
        m = mx.concatenate([m, mx.zeros((m.shape[0], 1, L, end), mx.bool_)], axis=3)
    if rows:
        first_key = mx.arange(S + end) == 0  # a padded query sees one key: no row of nothing
        m = mx.concatenate([m, mx.broadcast_to(first_key, (m.shape[0], 1, rows, S + end))], axis=2)
    _PADDED.insert(0, (mask, (rows, end), m))
    del _PADDED[_PADDED_KEPT:]
    return m


def _pad(x: mx.array, front: int, end: int) -> mx.array:
    """``x`` (B, heads, n, D) with ``front`` and ``end`` zero positions around its third axis: a new contiguous array
    either way, so its strides depend on the padded shape alone (cuDNN's plan is keyed on strides too)."""
    parts = ([mx.zeros(x.shape[:2] + (front,) + x.shape[3:], x.dtype)] if front else []) + [x] + (
        [mx.zeros(x.shape[:2] + (end,) + x.shape[3:], x.dtype)] if end else [])
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.contiguous(x)
