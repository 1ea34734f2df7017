"""mlx-vlm's cache classes in the prefix cache: zero-copy forks (RAM tier) and the SSD file's codec for them.

Models of the second source (mlx-vlm's language models: qwen4_exp, deepseek_v4, glm5_next, ...) compute with
mlx-vlm's own cache classes, not mlx-lm's. Each has the same small shape as mlx-lm's: ``state`` (arrays, ``None``s
and a few ints, nested in tuples), ``meta_state`` (strings or an int), ``from_state``, ``trim``, ``is_trimmable``,
``nbytes``. ``CLASSES`` names every class the tiers handle, explicitly ({tag: (module, class)}: no ``globals()``
lookup, a file cannot name anything else); a ``CacheList`` is handled through its children.

- ``fork(cache, trim)``: a new object over the same arrays (``from_state`` of fresh handles, then ``trim``), as
  cache.copying forks mlx-lm's classes;
- ``encode(cache, put)`` / ``decode(tag, meta, get)``: the ``vlm`` codec of cache.kvfile. The metadata holds the
  state's shape as JSON (``{"a": part}`` an array, ``{"i": n}`` an int, ``null``, ``{"l": [...]}`` a sequence, rebuilt as a list) and the
  meta state (strings or ints); tensors are ``s<k>``. Anything else in a file is a ValueError (the caller's
  KVFileError): a file from anywhere can only rebuild these classes over arrays.

mlx-vlm is optional: without it ``CLASSES`` resolves to nothing and no file names a ``vlm:`` tag we accept.
``cache`` depends on no package of ours; models.vlm_caches declares what each class allows the engine (the tests
check that both name the same classes).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any, Callable

import mlx.core as mx

__all__ = ["CLASSES", "LIST", "tag_of", "fork", "encode", "decode"]

CLASSES: dict[str, tuple[str, str]] = {
    "vlm:KVCache": ("mlx_vlm.models.cache", "KVCache"),
    "vlm:RotatingKVCache": ("mlx_vlm.models.cache", "RotatingKVCache"),
    "vlm:ArraysCache": ("mlx_vlm.models.cache", "ArraysCache"),
    "vlm:PoolingCache": ("mlx_vlm.models.cache", "PoolingCache"),
    "vlm:QSAKVCache": ("mlx_vlm.models.qwen4_exp.language", "QSAKVCache"),
    "vlm:HyV4KVCache": ("mlx_vlm.models.hy_v4.cache", "HyV4KVCache"),
}
LIST = "vlm:CacheList"
_LIST_CLASS = ("mlx_vlm.models.cache", "CacheList")
_MAX_DEPTH = 6
_MAX_ITEMS = 64


@lru_cache(maxsize=1)
def _resolved() -> dict[str, type]:
    """{tag: class} for every class whose module imports here (none without mlx-vlm)."""
    out = {}
    for tag, (module, name) in (*CLASSES.items(), (LIST, _LIST_CLASS)):
        try:
            out[tag] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return out


def tag_of(cache: Any) -> str | None:
    """The tag of an mlx-vlm cache object (exact class), or None for any other."""
    module = type(cache).__module__
    if not module.startswith("mlx_vlm."):
        return None
    for tag, cls in _resolved().items():
        if type(cache) is cls:
            return tag
    return None


def _children(cache: Any) -> list:
    return list(cache.caches)


def _list_of(children: list) -> Any:
    return _resolved()[LIST](*children)


def _fresh(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    return value


def fork(cache: Any, trim: int = 0) -> Any:
    """A new cache object holding the same positions as ``cache`` minus the last ``trim`` (new handles over the same
    immutable arrays; nothing is copied)."""
    tag = tag_of(cache)
    if tag == LIST:
        return _list_of([fork(c, trim) for c in _children(cache)])
    if tag is None:
        raise TypeError(f"{type(cache).__name__} is not an mlx-vlm cache class this tier knows")
    out = type(cache).from_state(_fresh(cache.state), cache.meta_state)
    if trim:
        out.trim(trim)
    return out


# -- the SSD codec ------------------------------------------------------------------------------------------------

Put = Callable[[str, mx.array], None]
Get = Callable[[str], mx.array]


def encode(cache: Any, put: Put) -> dict:
    """The layer's metadata; its arrays go to ``put`` (parts ``s0``, ``s1``, ...; a CacheList's child j under
    ``c<j>.``). TypeError for a class not in ``CLASSES``."""
    tag = tag_of(cache)
    if tag == LIST:
        return {"tag": LIST, "children": [encode(c, _under(put, f"c{j}.")) for j, c in enumerate(_children(cache))]}
    if tag is None:
        raise TypeError(f"cannot save cache class {type(cache).__name__}")
    counter = [0]

    def shape(value: Any, depth: int = 0) -> Any:
        if isinstance(value, mx.array):
            k = counter[0]
            counter[0] += 1
            put(f"s{k}", value[...])
            return {"a": k}
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
            raise TypeError(f"{type(cache).__name__}'s state holds a {type(value).__name__}")
        if isinstance(value, int):
            return {"i": int(value)}
        if depth >= _MAX_DEPTH:
            raise TypeError("state nested too deep")
        return {"l": [shape(v, depth + 1) for v in value]}

    return {"tag": tag, "state": shape(cache.state), "meta": _meta(cache.meta_state)}


def _meta(value: Any) -> Any:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= _MAX_ITEMS:
        return [_meta(v) for v in value]
    raise TypeError(f"meta state of type {type(value).__name__}")


def decode(meta: dict, get: Get, depth: int = 0) -> Any:
    """Rebuild a layer from ``encode``'s metadata; ValueError for anything it would not have written."""
    if depth > _MAX_DEPTH or not isinstance(meta, dict):
        raise ValueError("bad mlx-vlm cache description")
    tag = meta.get("tag")
    classes = _resolved()
    if tag == LIST:
        children = meta.get("children")
        if LIST not in classes or not isinstance(children, list) or not 0 < len(children) <= _MAX_ITEMS:
            raise ValueError("bad mlx-vlm CacheList")
        return _list_of([decode(ch, _from(get, f"c{j}."), depth + 1) for j, ch in enumerate(children)])
    if not isinstance(tag, str) or tag not in CLASSES or tag not in classes:
        raise ValueError(f"unknown mlx-vlm cache class tag {tag!r}")
    state = _state(meta.get("state"), get, 0)
    cls: Any = classes[tag]
    return cls.from_state(state, _checked_meta(meta.get("meta"), 0))


def _under(put: Put, prefix: str) -> Put:
    def child(part: str, x: mx.array) -> None:
        put(prefix + part, x)
    return child


def _from(get: Get, prefix: str) -> Get:
    def child(part: str) -> mx.array:
        return get(prefix + part)
    return child


def _state(value: Any, get: Get, depth: int) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) != 1 or depth > _MAX_DEPTH:
        raise ValueError("bad mlx-vlm cache state")
    (kind, v), = value.items()
    if kind == "a" and type(v) is int and 0 <= v < 4096:
        return get(f"s{v}")
    if kind == "i" and type(v) is int:
        return v
    if kind == "l" and isinstance(v, list) and len(v) <= _MAX_ITEMS:
        return [_state(x, get, depth + 1) for x in v]  # lists: a model assigns into some (ArraysCache)
    raise ValueError("bad mlx-vlm cache state")


def _checked_meta(value: Any, depth: int) -> Any:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return value
    if isinstance(value, list) and len(value) <= _MAX_ITEMS and depth < _MAX_DEPTH:
        return tuple(_checked_meta(v, depth + 1) for v in value)
    raise ValueError("bad mlx-vlm cache meta state")
