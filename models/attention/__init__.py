"""mlx-lane's attention paths, and the layouts they read.

mlx-lm's models call ``mlx_lm.models.base.scaled_dot_product_attention``; ``models.hook.switch`` puts mlx-lane's own in its
place where one applies (``models.loading.load`` installs both at load; only one applies on a device):

    cpu.py            on the CPU: grouped-query attention without copying K/V per query head, and the segments of
                      a ``SharedPrefixKVCache`` read where they lie (shared_prefix.py: a RAM hit's first token does
                      not copy the cached prefix)
    gpu.py            on CUDA: a decode batch's rows of different lengths in one fused kernel, no mask; it reads each
                      row's visible columns through the declared view ``RowRanges`` below (the ragged batch's layers,
                      server.engine.batch.ragged_kv, implement it) or mlx-lm's ``BatchKVCache``'s own fields; and a
                      single sequence's decode or verify step over a ``SharedPrefixKVCache``'s segments, as cpu.py
    composed.py       on CUDA: a step of a few queries past cached keys (a verify step) in plain ops, where cuDNN
                      would plan each new shape
    buckets.py        on CUDA: a prompt chunk for cuDNN padded up to a few shapes, so that its plans are reused
                      (`--debug-cudnn-buckets`, off by default)

``configure(...)`` is the process's choice (server.serve, from `--attention` and the `--debug-gpu-attention-*`
flags), made before a model is loaded; ``attention_path(model)`` says which path a loaded model runs (/stats).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx

from models.attention import buckets, cpu, gpu
from models.hook import attention_path, switched_functions

__all__ = ["RowRanges", "configure", "attention_path", "fused_batch_attention", "reads_segments"]


@runtime_checkable
class RowRanges(Protocol):
    """A batch cache layer that says which key columns each row's queries may see (the fused CUDA kernel reads
    this instead of a mask)."""

    def attention_ranges(self, width: int) -> tuple[mx.array, mx.array]:
        """After a forward's ``width`` new positions were written: row b's first visible column and the last
        column its first query sees (query i sees up to that + i), both int32 of shape (B,)."""
        ...


def configure(on: bool = True, *, gpu_split: int = 256, gpu_unroll: int = 4, gpu_composed_max: int = 8,
              gpu_prefill_max: int = 0, cudnn_buckets: tuple[int, ...] = (0, 0)) -> None:
    """``on`` False (`--attention mlx`): MLX's own attention everywhere. The CUDA kernel's two tuning knobs, up to
    how many queries per row a step past cached keys runs composed (composed.py) instead of cuDNN, up to how many a
    single sequence's prompt chunk runs in the kernel (``gpu.PREFILL_MAX``), and the (queries, keys) buckets a chunk
    for cuDNN is padded to (buckets.py; (0, 0): off)."""
    cpu.configure(on)
    gpu.configure(on, gpu_split, gpu_unroll, gpu_composed_max, gpu_prefill_max)
    buckets.configure(*cudnn_buckets)


def fused_batch_attention() -> bool:
    """Does a decode batch's attention run in the fused CUDA kernel here (the ragged layout pays on a GPU then)?"""
    return gpu.enabled()


def reads_segments(model) -> bool:
    """True when every attention of ``model``'s modules goes through a wrapper of this package that reads a
    ``SharedPrefixKVCache``'s segments where they lie (cpu.py's, gpu.py's): then a RAM hit's caches may be handed to the
    model as such (server.engine.slot ``reads_shared_prefix``)."""
    from mlx_lm.models import base

    fns = switched_functions(model)
    return bool(fns) and all(getattr(fn, "mlx_lane_original", None) is base.scaled_dot_product_attention
                             and getattr(fn, "mlx_lane_reads_segments", False) for fn in fns)
