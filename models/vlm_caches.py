"""What each of mlx-vlm's cache classes allows: the one place the engine learns it (models.loading.vlm_text's models).

mlx-vlm 0.7.10 keeps cache classes of its own, beside mlx-lm's and not subclasses of them: its ``KVCache``,
``RotatingKVCache``, ``ArraysCache``, ``CacheList`` and ``PoolingCache`` (``mlx_vlm.models.cache``), and a few
models' own (qwen4_exp's ``QSAKVCache``: KV plus its sparse indexer's keys; hy_v4's ``HyV4KVCache``). ``ROLES`` names
what each one holds, and everything the server decides about a model of the second source follows from those roles
(``measure``: the facts server.engine.slot records; spec.rewind reads ``is_recurrent``):

    kv         positions, cut back by ``trim`` (attention; QSA keeps its indexer's keys in step)
    window     a sliding window (``RotatingKVCache``): once wrapped, nothing can be taken back
    recurrent  a fixed-size summary of every token seen (linear attention, convolutions, qwen4_exp's n-gram history)
    pooled     tokens compressed ``ratio`` to one (DeepSeek V4, GLM-5): once a pool is written, nothing can be taken back

A layer may be a ``CacheList`` of several (DeepSeek V4: a window and one or two pools; GLM-5: KV, KV, a pool, KV).
What a model of these classes gets (``VlmFacts``): the prefix cache keeps checkpoints of every layer that is not pure
``kv``; its requests decode alone, each interleaved with the batch (``mergeable`` False: mlx-vlm's batch caches are
exact for mlx-vlm's own batch loop, and this engine's batch kinds hold mlx-lm's classes), logged once at load; they
speculate: a verify forward's rejected drafts are taken back by trimming the ``kv`` layers and putting every other
layer back from a ``snapshot`` kept before the forward, then feeding the accepted tokens again (spec.rewind).

Pure data and class tests: nothing here computes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ROLES", "VlmFacts", "role_of", "roles_of", "is_vlm_cache", "is_recurrent", "restores", "snapshot",
           "measure", "declared_classes"]

# (module, class name) -> role. Exact classes only: a subclass may hold state its parent's role does not describe.
ROLES: dict[tuple[str, str], str] = {
    ("mlx_vlm.models.cache", "KVCache"): "kv",
    ("mlx_vlm.models.cache", "RotatingKVCache"): "window",
    ("mlx_vlm.models.cache", "ArraysCache"): "recurrent",
    ("mlx_vlm.models.cache", "PoolingCache"): "pooled",
    ("mlx_vlm.models.qwen4_exp.language", "QSAKVCache"): "kv",
    ("mlx_vlm.models.hy_v4.cache", "HyV4KVCache"): "kv",
}
_LIST = ("mlx_vlm.models.cache", "CacheList")


def _key(cache: Any) -> tuple[str, str]:
    cls = type(cache)
    return cls.__module__, cls.__name__


def is_vlm_cache(cache: Any) -> bool:
    """A cache object of mlx-vlm's (a declared class, or a CacheList of them)."""
    return _key(cache) in ROLES or _key(cache) == _LIST


def role_of(cache: Any) -> Optional[str]:
    """The declared role of one (non-list) cache object; None for a class not declared here."""
    return ROLES.get(_key(cache))


def roles_of(cache: Any) -> tuple[Optional[str], ...]:
    """The roles of a layer's caches (a CacheList's children in order; one for any other layer)."""
    if _key(cache) == _LIST:
        return tuple(r for child in cache.caches for r in roles_of(child))
    return (role_of(cache),)


def is_recurrent(cache: Any) -> bool:
    """A layer that holds only recurrent state (mlx-vlm's ArraysCache)."""
    return role_of(cache) == "recurrent"


def restores(cache: Any) -> bool:
    """A layer of mlx-vlm's that takes a verify forward back only from a snapshot (``snapshot``, spec.rewind): one
    that is not pure ``kv`` (a recurrent state, a window, a pool, a CacheList holding one)."""
    return is_vlm_cache(cache) and any(r != "kv" for r in roles_of(cache))


def snapshot(cache: Any) -> Any:
    """A new object of the layer's class holding what it holds now, over new handles of its arrays (nothing copied:
    the layer's later in-place writes leave the snapshot as it was). spec.rewind keeps one before a verify forward
    and puts it back in the layer's place to take the forward back."""
    if _key(cache) == _LIST:
        return type(cache)(*(snapshot(c) for c in cache.caches))
    return type(cache).from_state(_fresh(cache.state), cache.meta_state)


def _fresh(value: Any) -> Any:
    import mlx.core as mx

    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    return value


@dataclass(frozen=True)
class VlmFacts:
    """What a model of mlx-vlm's cache classes allows (see the module docstring)."""

    recurrent: bool  # some layer holds recurrent state or a pool: nothing can be taken back there
    windowed: bool  # some layer is a sliding window
    checkpointed_layers: tuple[int, ...]  # layers that are not pure kv: the prefix cache keeps their checkpoints
    window: Optional[int]  # the smallest sliding window
    rewinds: bool  # a verify forward's rejected drafts can be taken back (every layer's class is declared)
    unknown: tuple[str, ...]  # classes not declared in ROLES (such a model decodes alone, never speculates)


def measure(layers: list) -> VlmFacts:
    """The facts of a model whose fresh caches are ``layers`` (one per layer, mlx-vlm's classes)."""
    per_layer = [roles_of(c) for c in layers]
    unknown = tuple(sorted({type(c).__name__ for c, roles in zip(layers, per_layer) if None in roles}))
    flat = [r for roles in per_layer for r in roles]
    windows = [w for c in layers for w in _windows(c)]
    return VlmFacts(
        recurrent=any(r in ("recurrent", "pooled") for r in flat),
        windowed="window" in flat,
        checkpointed_layers=tuple(i for i, roles in enumerate(per_layer) if any(r != "kv" for r in roles)),
        window=min(windows) if windows else None,
        rewinds=not unknown,  # kv layers trim; every other layer is put back from a snapshot (spec.rewind)
        unknown=unknown,
    )


def _windows(cache: Any) -> list[int]:
    if _key(cache) == _LIST:
        return [w for child in cache.caches for w in _windows(child)]
    return [int(cache.max_size)] if role_of(cache) == "window" else []


def declared_classes() -> dict[str, type]:
    """{"module.Class": the class} for every declared class that imports here (for the SSD codecs' registry and the
    tests); a family whose module does not import (a missing extra) is left out."""
    out = {}
    for module, name in (*ROLES, _LIST):
        try:
            out[f"{module}.{name}"] = getattr(importlib.import_module(module), name)
        except ImportError:
            continue
    return out
