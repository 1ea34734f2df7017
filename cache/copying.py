"""Mechanism of the RAM tier: zero-copy forks of mlx-lm cache objects.

`fork(caches, trim=n)` returns NEW cache objects, owned by the caller, that hold the same token positions as the
originals minus the last `n` (which must then all be trimmable). Nothing is ever written to the originals.

Why new objects over the same arrays are safe (measured in tests/unit/test_prompt_cache_mlx.py):
  * MLX arrays are immutable buffers behind handles. `x[..., a:b, :] = y` (what KVCache.update_and_fetch and
    RotatingKVCache._update_in_place do) builds a SliceUpdate and swaps the descriptor of THAT Python handle only;
    any other handle keeps its old descriptor.
  * A SliceUpdate writes in place only when its input buffer has a single owner ("donation"). A fork's arrays share
    the donor's buffer, so the first write of a taker copies it (copy-on-write); the donor's buffer never changes.
  * So a fork only needs fresh handles (a slice or `x[...]`, which MLX evaluates as a view: no bytes copied) and
    fresh containers (lists/tuples that models assign into, e.g. ArraysCache's `cache[i] = state`).
KVCache and QuantizedKVCache are sliced to the kept length, so a stored entry's state holds exactly its tokens
(keys may be allocated past `offset` in steps of 256; that padding stays in the shared buffer, unseen).
RotatingKVCache keeps its ring as is: `trim` only moves offset/_idx, which mlx-lm handles while it is trimmable
(offset < max_size, i.e. the ring has not wrapped and is still in temporal order).
mlx-vlm's classes (the second source's models) fork the same way, through `cache.vlm_classes`.
Unknown classes fall back to `copy.deepcopy` (a real copy), then `trim`. A `cache.checkpoints.Checkpointed` layer (an
untrimmable layer with snapshots at earlier positions) forks whole for an entry, and for a taker (`unwrap`) becomes
the plain layer at the position cut back to (its end, or one of its snapshots).

`cache` depends on no package of ours; mlx-lm is the library whose cache classes we fork.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlc

from cache import vlm_classes
from cache.checkpoints import Checkpointed

__all__ = ["all_trimmable", "fork", "iter_offsets", "total_nbytes"]


def _fresh(value: Any) -> Any:
    """The same nested state with new array handles and new containers; arrays are views, not copies."""
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value  # ints, strings, None: immutable


def _kept(cache: Any, trim: int) -> int:
    """Tokens left after trimming `trim` (mlx-lm's trim clamps at the offset; so do we)."""
    return cache.offset - min(cache.offset, trim)


def _fork_kv(cache: mlc.KVCache, trim: int) -> mlc.KVCache:
    out = mlc.KVCache()
    if cache.keys is not None:
        keep = _kept(cache, trim)
        out.keys = cache.keys[..., :keep, :]
        out.values = cache.values[..., :keep, :]
        out.offset = keep
    return out


def _fork_quantized(cache: mlc.QuantizedKVCache, trim: int) -> mlc.QuantizedKVCache:
    out = mlc.QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    if cache.keys is not None:
        keep = _kept(cache, trim)
        # keys/values are (packed, scales, biases) triples; update_and_fetch assigns into each element.
        out.keys = tuple(x[..., :keep, :] for x in cache.keys)
        out.values = tuple(x[..., :keep, :] for x in cache.values)
        out.offset = keep
    return out


def _fork_concatenate(cache: mlc.ConcatenateKVCache, trim: int) -> mlc.ConcatenateKVCache:
    # Its state setter recomputes offset from the shape, so slice rather than trim.
    out = mlc.ConcatenateKVCache()
    if cache.keys is not None:
        keep = _kept(cache, trim)
        out.keys = cache.keys[..., :keep, :]
        out.values = cache.values[..., :keep, :]
        out.offset = keep
    return out


def _fork_by_state(cache: Any, trim: int) -> Any:
    """Classes whose `state` is their whole content (RotatingKVCache, ChunkedKVCache, ArraysCache)."""
    out = type(cache).from_state(_fresh(cache.state))
    if trim:
        out.trim(trim)
    return out


def _fork_cache_list(cache: mlc.CacheList, trim: int) -> mlc.CacheList:
    return mlc.CacheList(*(_fork_one(c, trim) for c in cache.caches))


def _fork_unknown(cache: Any, trim: int) -> Any:
    out = copy.deepcopy(cache)
    if trim:
        out.trim(trim)
    return out


# Exact classes only: a subclass (a model's own cache) may carry attributes its state does not, so it is deep-copied.
_FORKERS: dict[type, Callable[[Any, int], Any]] = {
    mlc.KVCache: _fork_kv,
    mlc.QuantizedKVCache: _fork_quantized,
    mlc.ConcatenateKVCache: _fork_concatenate,
    mlc.RotatingKVCache: _fork_by_state,
    mlc.ChunkedKVCache: _fork_by_state,
    mlc.ArraysCache: _fork_by_state,
    mlc.CacheList: _fork_cache_list,
}


def _fork_one(cache: Any, trim: int) -> Any:
    forker = _FORKERS.get(type(cache))
    if forker is None and vlm_classes.tag_of(cache) is not None:  # mlx-vlm's classes (cache.vlm_classes)
        forker = vlm_classes.fork
    return (forker or _fork_unknown)(cache, trim)


def _arrays(value: Any) -> Iterator[mx.array]:
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)


def fork(caches: Sequence[Any], *, trim: int = 0, unwrap: bool = False) -> list[Any]:
    """New per-layer cache objects over the same arrays, with the last `trim` tokens dropped.

    The caller owns the result and may extend it freely; `caches` are only read. `trim > 0` requires every cache to
    be trimmable or checkpointed there (ValueError otherwise: trimming an untrimmable cache silently would change the
    generated text). `unwrap`: a taker's caches, checkpointed layers as plain ones (what a model computes with).
    The result is evaluated (views: no bytes copied) so it holds no lazy graph pointing back at `caches`; arrays the
    caller left lazy get computed here, which the durability writer relies on (it serializes evaluated arrays).
    """
    if trim < 0:
        raise ValueError(f"trim must be >= 0, got {trim}")
    if trim and not all(c.is_trimmable() or (isinstance(c, Checkpointed) and c.offset - trim in c.points)
                        for c in caches):
        raise ValueError("cannot trim: not every cache is trimmable (or checkpointed there)")
    out = [_fork_checkpointed(c, trim, unwrap) if isinstance(c, Checkpointed) else _fork_one(c, trim)
           for c in caches]
    arrays = [a for c in out for a in _arrays(getattr(c, "state", ()))]
    if arrays:
        mx.eval(arrays)
    return out


def _fork_checkpointed(cache: Checkpointed, trim: int, unwrap: bool) -> Any:
    if unwrap:
        position = cache.offset - trim
        return _fork_one(cache.inner if position == cache.offset else cache.snapshots[position], 0)
    if trim:
        raise ValueError("a checkpointed layer is stored whole: cut it back only for a taker (unwrap)")
    return Checkpointed(_fork_one(cache.inner, 0), cache.offset,
                        {p: _fork_one(s, 0) for p, s in cache.snapshots.items()})


def fork_checkpoints(caches: Sequence[Any], below: int) -> dict[int, dict[int, Any]]:
    """The checkpoints a stored entry's layers share below ``below`` tokens, as {position: {layer index: a plain
    cache object covering exactly position tokens}} (fresh handles: nothing copied). A taker that continues from
    the entry carries them into the entry it stores, so that entry reaches every point the old one did and may
    supersede it without losing a checkpoint."""
    layers = [(i, c) for i, c in enumerate(caches) if isinstance(c, Checkpointed)]
    if not layers:
        return {}
    shared = set.intersection(*(set(c.snapshots) for _, c in layers))
    return {p: {i: _fork_one(c.snapshots[p], 0) for i, c in layers} for p in sorted(shared) if p < below}


def all_trimmable(caches: Iterable[Any]) -> bool:
    return all(c.is_trimmable() for c in caches)


def total_nbytes(caches: Iterable[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


def iter_offsets(caches: Iterable[Any]) -> Iterator[int]:
    """The token offsets the caches report (through CacheList too); caches without an int offset are skipped."""
    for c in caches:
        inner = getattr(c, "caches", None)
        if isinstance(c, mlc.CacheList) and inner is not None:
            yield from iter_offsets(inner)
            continue
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            yield offset
