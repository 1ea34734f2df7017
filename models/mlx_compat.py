"""Every private name of mlx-lm that mlx-lane uses, in one place (mlx-lm 0.32).

mlx-lm keeps a few things we need behind underscored names: the function that merges per-sequence caches into batch
caches, the write index of its ring and batch KV caches, the right padding a batched prefill leaves pending, and the
detokenizer's leading-space trim. They may change in any release, so nothing else of ours names them: the engine,
the attention kernels and the speculative rewind reach them only through the functions below, and
tests/unit/test_mlx_compat.py fails when the installed mlx-lm no longer has one of them (``NAMES``), naming it.
``missing()`` says the same at start-up (server.serve logs it), for a user who installed a newer mlx-lm than the
suite ran on.

``cache`` (which depends on no package of ours) reads a ring cache's write index through mlx-lm's public ``state``
instead (cache.kvfile).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from mlx_lm.models import cache as _cache
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

_generate = importlib.import_module("mlx_lm.generate")  # the module (``mlx_lm.generate`` is also a function's name)

__all__ = ["NAMES", "missing", "merge_caches", "ring_index", "set_ring_index", "temporal_order", "batch_index",
           "right_padding", "keep_leading_space"]

# (where, the private name): what this module relies on (instances' attributes are checked on a fresh instance)
NAMES: tuple[tuple[str, str], ...] = (
    ("mlx_lm.generate", "_merge_caches"),
    ("mlx_lm.models.cache.RotatingKVCache", "_idx"),
    ("mlx_lm.models.cache.RotatingKVCache", "_temporal_order"),
    ("mlx_lm.models.cache.BatchKVCache", "_idx"),
    ("mlx_lm.models.cache.BatchKVCache", "_right_padding"),
    ("mlx_lm.tokenizer_utils.BPEStreamingDetokenizer", "_maybe_trim_space"),
)


def missing() -> list[str]:
    """The names of ``NAMES`` the installed mlx-lm lacks (empty: every one is there)."""
    holders: dict[str, Any] = {
        "mlx_lm.generate": _generate,
        "mlx_lm.models.cache.RotatingKVCache": _cache.RotatingKVCache(max_size=4),
        "mlx_lm.models.cache.BatchKVCache": _cache.BatchKVCache([0]),
        "mlx_lm.tokenizer_utils.BPEStreamingDetokenizer": BPEStreamingDetokenizer,
    }
    return [f"{where}.{name}" for where, name in NAMES if not hasattr(holders[where], name)]


def merge_caches(per_sequence: list[list[Any]]) -> list[Any]:
    """mlx-lm's ``_merge_caches``: each layer's caches of several sequences as one batch cache per layer
    (``BatchKVCache`` / ``BatchRotatingKVCache`` / ``ArraysCache``, left-padded)."""
    merge: Callable[[list[list[Any]]], list[Any]] = getattr(_generate, "_merge_caches")
    return merge(per_sequence)


def ring_index(cache: Any) -> int:
    """Where a ``RotatingKVCache`` writes next in its buffer (its ``_idx``)."""
    return int(cache._idx)


def set_ring_index(cache: Any, index: int) -> None:
    cache._idx = int(index)


def temporal_order(cache: Any, buffer: Any) -> Any:
    """A ``RotatingKVCache``'s keys or values (``buffer``) in the order of their positions (a wrapped window's
    buffer is rotated: its ``_temporal_order``)."""
    return cache._temporal_order(buffer)


def batch_index(cache: Any) -> int:
    """The columns a ``BatchKVCache`` has written (its ``_idx``: every row's end, left padding included)."""
    return int(cache._idx)


def right_padding(cache: Any) -> Any:
    """The right padding a ``BatchKVCache`` has pending (a batched prefill's; None at a decode step)."""
    return getattr(cache, "_right_padding", None)


def keep_leading_space(detokenizer: Any) -> None:
    """Make a streaming detokenizer keep the first token's leading space (mlx-lm drops it, right for a chat reply;
    a raw completion keeps it). SentencePiece's has a public switch; the BPE one trims in ``_maybe_trim_space``."""
    if hasattr(detokenizer, "trim_space"):  # SPMStreamingDetokenizer
        detokenizer.trim_space = False
    elif hasattr(detokenizer, "_maybe_trim_space"):  # BPEStreamingDetokenizer trims when no text came yet
        detokenizer._maybe_trim_space = _untrimmed


def _untrimmed(text: str) -> str:
    return text
