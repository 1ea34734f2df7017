"""The on-disk format of one prefix-cache entry: a safetensors file that cannot run code.

(About 465 lines on purpose, one job, the format: the per-class codecs (plain, rotating, quantized, recurrent state,
and the checkpoints a hybrid or sliding-window entry carries) and the validation that must mirror them are one
contract, and keeping them in one file keeps "what is written" and "what is accepted" reviewable side by side.)

A file holds the KV state of one token sequence for every layer of a model:

    tensors   "<layer>.<part>" (nested CacheList children: "<layer>.c<j>.<part>"), only the live part of each
              buffer (mlx-lm allocates KV buffers in steps of 256; the tail past `offset` is not stored);
    metadata  one key, "mlx_lane", whose value is JSON:
              {"format": "mlx-lane-kv", "version": 1, "fingerprint", "ns", "ns_hash", "tokens": [ids],
               "trimmable": bool or [positions] (its reach: cache.prefix), "nbytes": int,
               "layers": [{"tag": class tag, "meta": {ints}}], "extra": {}}

Contract:
- The caches of an entry cover exactly its `tokens`: the store trims a restored entry by `len(tokens) - p`.
- Classes are restored through `_CODECS`, an explicit {tag: codec} registry over mlx-lm's KVCache,
  RotatingKVCache, ArraysCache, QuantizedKVCache and CacheList (nested), and mlx-vlm's classes (one `vlm` codec
  over the explicit list of cache.vlm_classes). No pickle, no `globals()`: an unknown tag,
  a missing or extra tensor, a shape that disagrees with the metadata, a truncated or foreign file all raise
  `KVFileError`, and nothing is half-built.
- `save` is atomic: `<path>.tmp` in the same directory -> write -> fsync -> rename -> fsync the directory. A crash
  leaves either the old state or the complete new file (plus a `.tmp` the store's scan deletes). The writer holds
  an exclusive `flock` on the temp file until after the rename (`cache.filelocks`), so a scan by another process
  sharing the directory tells a dead writer's temp file from a live one.
- `encode(caches)` captures a detached, immutable snapshot (slices of the arrays, evaluated, so the caller may keep
  mutating its cache objects); `save` accepts caches or an `Encoded`.

Threads: MLX work off the main thread must run on a stream created in that thread (on the default stream it can
abort the process at exit: mlx 0.32, Linux);
`load(..., stream=s)` and `with mx.stream(s): save(...)` let the caller arrange that.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from cache import filelocks, host_copies, vlm_classes
from cache.checkpoints import Checkpointed, reach_of

__all__ = ["FORMAT", "VERSION", "KVFileError", "KVHeader", "KVFile", "Encoded", "encode", "save", "load",
           "read_header", "ns_hash"]

FORMAT = "mlx-lane-kv"
VERSION = 1
_META_KEY = "mlx_lane"
_MAX_HEADER = 64 << 20  # 1M token ids fit in ~8 MB of JSON; anything far larger is not ours
_MAX_DEPTH = 4  # CacheList nesting; bounds recursion on hostile metadata
_MAX_TOKEN = 1 << 31


class KVFileError(Exception):
    """A file that is not a valid, matching mlx-lane KV file. The file is safe to delete."""


def ns_hash(ns: str) -> str:
    """First 16 hex digits of sha256(ns): the namespace's folder name and its identity in headers."""
    return hashlib.sha256(ns.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class KVHeader:
    """What `read_header` learns without touching tensor data."""

    fingerprint: str
    ns: str
    ns_hash: str
    tokens: tuple[int, ...]
    trimmable: Any  # its reach (cache.prefix): True, False, or the positions it can be cut back to
    nbytes: int  # tensor bytes (the file is a little larger)
    layers: tuple[dict, ...]
    extra: dict


@dataclass(frozen=True)
class KVFile:
    """A loaded entry. The caller owns `caches` (fresh objects over freshly read arrays)."""

    tokens: tuple[int, ...]
    caches: list
    meta: KVHeader


@dataclass(frozen=True)
class Encoded:
    """A detached snapshot of per-layer caches, ready to save: immutable arrays plus JSON-able layer metadata."""

    arrays: dict[str, mx.array]
    layers: tuple[dict, ...]
    trimmable: Any  # its reach (cache.prefix): True, False, or the positions it can be cut back to
    nbytes: int


# ---------------------------------------------------------------------------------------------------------------
# Codecs: one encode/decode pair per class. encode(cache, put) -> meta; decode(meta, get, depth) -> cache.
# `put(part, array)` registers a tensor under the layer's prefix; `get(part)` returns it or raises KVFileError.

Put = Callable[[str, mx.array], None]
Get = Callable[[str], mx.array]


def _int(meta: dict, key: str, lo: int = 0, hi: int = 1 << 40) -> int:
    v = meta.get(key)
    if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
        raise KVFileError(f"bad layer field {key!r}: {v!r}")
    return v


def _kv_pair(get: Get, n: int) -> tuple[mx.array, mx.array]:
    k, v = get("keys"), get("values")
    if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[2] != n:
        raise KVFileError(f"keys/values shapes {k.shape}/{v.shape} disagree with length {n}")
    return k, v


def _enc_kv(c: KVCache, put: Put) -> dict:
    if c.keys is None or c.offset == 0:
        return {"offset": 0}
    put("keys", c.keys[..., : c.offset, :])  # the buffer past offset is allocation slack
    put("values", c.values[..., : c.offset, :])
    return {"offset": c.offset}


def _dec_kv(meta: dict, get: Get, depth: int) -> KVCache:
    c = KVCache()
    n = _int(meta, "offset")
    if n:
        c.keys, c.values = _kv_pair(get, n)
        c.offset = n
    return c


def _enc_rot(c: RotatingKVCache, put: Put) -> dict:
    idx = c.state[-1]  # mlx-lm's public state ends with the ring's write index (no private name: cache stands alone)
    meta = {"offset": c.offset, "keep": c.keep, "max_size": c.max_size, "idx": idx}
    if c.keys is None:
        return {**meta, "len": 0}
    n = min(c.offset, c.keys.shape[2])  # before the window wraps, only [:offset] is live
    put("keys", c.keys[..., :n, :])
    put("values", c.values[..., :n, :])
    return {**meta, "len": n}


def _dec_rot(meta: dict, get: Get, depth: int) -> RotatingKVCache:
    max_size = _int(meta, "max_size", 1)
    c = RotatingKVCache(max_size=max_size, keep=_int(meta, "keep", 0, max_size))
    n, offset, idx = _int(meta, "len"), _int(meta, "offset"), _int(meta, "idx")
    if n:
        if n > offset or idx > n:
            raise KVFileError(f"rotating cache len {n}, offset {offset}, idx {idx} are inconsistent")
        c.keys, c.values = _kv_pair(get, n)
    c.state = (c.keys, c.values, offset, c.keep, c.max_size, idx)  # the public state sets the write index too
    return c


def _enc_quant(c: QuantizedKVCache, put: Put) -> dict:
    meta = {"offset": 0, "group_size": c.group_size, "bits": c.bits, "parts": 0}
    if c.keys is None or c.offset == 0:
        return meta
    for name, parts in (("keys", c.keys), ("values", c.values)):
        for i, x in enumerate(parts):
            put(f"{name}.{i}", x[..., : c.offset, :])
    return {**meta, "offset": c.offset, "parts": len(c.keys)}


def _dec_quant(meta: dict, get: Get, depth: int) -> QuantizedKVCache:
    c = QuantizedKVCache(group_size=_int(meta, "group_size", 1, 1 << 16), bits=_int(meta, "bits", 1, 16))
    n, parts = _int(meta, "offset"), _int(meta, "parts", 0, 3)
    if n:
        if parts < 2:
            raise KVFileError(f"quantized cache with {parts} parts")
        kv = [tuple(get(f"{name}.{i}") for i in range(parts)) for name in ("keys", "values")]
        if any(x.ndim != 4 or x.shape[2] != n for t in kv for x in t):
            raise KVFileError(f"quantized parts disagree with length {n}")
        c.keys, c.values = kv
        c.offset = n
    return c


def _enc_arrays(c: ArraysCache, put: Put) -> dict:
    present = []
    for j, x in enumerate(c.cache):
        present.append(x is not None)
        if x is not None:
            put(f"a{j}", x[...])  # a new array: the owner may assign into its own object later
    for name in ("left_padding", "lengths"):
        if getattr(c, name) is not None:
            put(name, getattr(c, name)[...])
    return {"present": present, "left_padding": c.left_padding is not None, "lengths": c.lengths is not None}


def _dec_arrays(meta: dict, get: Get, depth: int) -> ArraysCache:
    present = meta.get("present")
    if not isinstance(present, list) or len(present) > 4096 or any(type(p) is not bool for p in present):
        raise KVFileError("bad ArraysCache 'present' list")
    c = ArraysCache(len(present))
    c.cache = [get(f"a{j}") if p else None for j, p in enumerate(present)]
    for name in ("left_padding", "lengths"):
        if meta.get(name) is True:
            setattr(c, name, get(name))
        elif meta.get(name) is not False:
            raise KVFileError(f"bad ArraysCache field {name!r}")
    return c


def _enc_ckpt(c: Checkpointed, put: Put) -> dict:
    """A checkpointed layer (cache.checkpoints): its inner layer, then each snapshot, each in its own codec."""
    inner = _tag_of(c.inner)
    snaps = []
    for j, (position, snap) in enumerate(sorted(c.snapshots.items())):
        if _tag_of(snap) != inner or type(snap) is not type(c.inner):
            raise TypeError("a checkpoint's class differs from its layer's")
        snaps.append({"position": position, "meta": _CODECS[inner].encode(snap, _prefixed(put, f"s{j}."))})
    return {"offset": c.offset, "tag": inner, "inner": _CODECS[inner].encode(c.inner, _prefixed(put, "i.")),
            "snapshots": snaps}


def _dec_ckpt(meta: dict, get: Get, depth: int) -> Checkpointed:
    offset, snaps = _int(meta, "offset"), meta.get("snapshots")
    if meta.get("tag") in ("ckpt", "CacheList") or not isinstance(snaps, list) or len(snaps) > 4096:
        raise KVFileError("bad checkpointed layer")
    inner = _decode_layer({"tag": meta.get("tag"), "meta": meta.get("inner")}, lambda p: get("i." + p), depth + 1)
    out = {}
    for j, s in enumerate(snaps):
        if not isinstance(s, dict):
            raise KVFileError("bad checkpoint")
        position = _int(s, "position", 1, max(1, offset - 1))
        out[position] = _decode_layer({"tag": meta["tag"], "meta": s.get("meta")},
                                      lambda p, j=j: get(f"s{j}.{p}"), depth + 1)
    return Checkpointed(inner, offset, out)


def _enc_list(c: CacheList, put: Put) -> dict:
    children = []
    for j, child in enumerate(c.caches):
        tag = _tag_of(child)
        children.append({"tag": tag, "meta": _CODECS[tag].encode(child, _prefixed(put, f"c{j}."))})
    return {"children": children}


def _dec_list(meta: dict, get: Get, depth: int) -> CacheList:
    children = meta.get("children")
    if not isinstance(children, list):
        raise KVFileError("bad CacheList 'children'")
    return CacheList(*(_decode_layer(ch, lambda part, j=j: get(f"c{j}.{part}"), depth + 1)
                       for j, ch in enumerate(children)))


@dataclass(frozen=True)
class _Codec:
    cls: type
    encode: Callable[[Any, Put], dict]
    decode: Callable[[dict, Get, int], Any]


# The only classes a file can name. Exact types: a subclass may carry state these codecs would drop.
_CODECS: dict[str, _Codec] = {
    "KVCache": _Codec(KVCache, _enc_kv, _dec_kv),
    "RotatingKVCache": _Codec(RotatingKVCache, _enc_rot, _dec_rot),
    "QuantizedKVCache": _Codec(QuantizedKVCache, _enc_quant, _dec_quant),
    "ArraysCache": _Codec(ArraysCache, _enc_arrays, _dec_arrays),
    "CacheList": _Codec(CacheList, _enc_list, _dec_list),
    "ckpt": _Codec(Checkpointed, _enc_ckpt, _dec_ckpt),
    # mlx-vlm's classes (the second source's models): one codec over their public state (cache.vlm_classes)
    "vlm": _Codec(object, vlm_classes.encode, lambda meta, get, depth: vlm_classes.decode(meta, get, depth)),
}
_TAGS: dict[type, str] = {codec.cls: tag for tag, codec in _CODECS.items() if codec.cls is not object}


def _tag_of(cache: Any) -> str:
    tag = _TAGS.get(type(cache)) or ("vlm" if vlm_classes.tag_of(cache) is not None else None)
    if tag is None:
        raise TypeError(f"cannot save cache class {type(cache).__name__}; supported: {', '.join(_CODECS)}")
    return tag


def _prefixed(put: Put, prefix: str) -> Put:
    return lambda part, x: put(prefix + part, x)


def _decode_layer(layer: Any, get: Get, depth: int) -> Any:
    if depth > _MAX_DEPTH or not isinstance(layer, dict) or not isinstance(layer.get("meta"), dict):
        raise KVFileError("bad layer description")
    codec = _CODECS.get(layer.get("tag"))  # type: ignore[arg-type]
    if codec is None:
        raise KVFileError(f"unknown cache class tag {layer.get('tag')!r}")
    return codec.decode(layer["meta"], get, depth)


# ---------------------------------------------------------------------------------------------------------------
# Public verbs


def encode(caches: Sequence[Any]) -> Encoded:
    """Snapshot `caches` (one per layer) into arrays + metadata. TypeError on an unsupported class.

    The arrays are new, evaluated MLX arrays (views where MLX can), so later `update_and_fetch` or in-place
    assignment on the caller's cache objects cannot change the snapshot. Cheap: no copy of KV data.
    """
    arrays: dict[str, mx.array] = {}

    def put(name: str, x: mx.array) -> None:
        arrays[name] = x

    layers = []
    for i, c in enumerate(caches):
        tag = _tag_of(c)
        layers.append({"tag": tag, "meta": _CODECS[tag].encode(c, _prefixed(put, f"{i}."))})
    mx.eval(list(arrays.values()))
    trimmable = reach_of(list(caches))
    return Encoded(arrays, tuple(layers), trimmable, sum(x.nbytes for x in arrays.values()))


def save(path: str | os.PathLike, tokens: Sequence[int], caches: Sequence[Any] | Encoded, *, fingerprint: str,
         ns: str, extra_meta: dict | None = None, before_rename: Callable[[], None] | None = None) -> int:
    """Write `caches` covering `tokens` to `path` atomically; return the file size in bytes.

    `before_rename` (a test seam) runs after the temp file is fsynced and before the rename: a process killed
    inside it leaves exactly what a crash mid-write leaves.

    OSError (ENOSPC, EROFS, EIO...) propagates after the temp file is removed; TypeError for unsupported classes;
    ValueError for token ids outside [0, 2**31).
    """
    ids = [int(t) for t in tokens]
    if any(not 0 <= t < _MAX_TOKEN for t in ids):
        raise ValueError("token ids must be in [0, 2**31)")
    enc = caches if isinstance(caches, Encoded) else encode(caches)
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "ns": ns, "ns_hash": ns_hash(ns),
            "tokens": ids, "trimmable": enc.trimmable, "nbytes": enc.nbytes,
            "layers": list(enc.layers), "extra": dict(extra_meta or {})}
    path = os.fspath(path)
    tmp = path + ".tmp"
    f = open(tmp, "wb")
    try:
        # held until after the rename: another replica's scan deletes only temp files whose writer is gone
        filelocks.writing(f)
        # the entry's own arrays, or device copies of them (cache.host_copies: why, and why not by default)
        arrays = host_copies.host_read_copies(enc.arrays)
        mx.save_safetensors(f, arrays, {_META_KEY: json.dumps(meta, separators=(",", ":"))})
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        f.close()
    _fsync_dir(os.path.dirname(path) or ".")
    return size


def _fsync_dir(d: str) -> None:
    # The rename is durable only once the directory entry is; some filesystems refuse O_RDONLY dir fsync.
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_header(path: str | os.PathLike, *, expect_fingerprint: str | None = None,
                expect_ns: str | None = None) -> KVHeader:
    """Parse and validate the safetensors JSON header only (no tensor data). KVFileError if invalid.

    Also checks that the file is exactly as long as its tensor table says, so truncation is caught here.
    OSError from opening the file propagates (the caller tells a vanished file from a bad one).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise KVFileError("file shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise KVFileError(f"header length {n} is not plausible")
        blob = f.read(n)
        size = os.fstat(f.fileno()).st_size
    if len(blob) != n:
        raise KVFileError("truncated header")
    try:
        table = json.loads(blob)
        meta = json.loads(table["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise KVFileError(f"not an mlx-lane KV file: {e.__class__.__name__}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise KVFileError("not an mlx-lane KV file")
    if meta.get("version") != VERSION:
        raise KVFileError(f"format version {meta.get('version')!r}, expected {VERSION}")
    try:
        end = max((int(t["data_offsets"][1]) for name, t in table.items() if name != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise KVFileError("bad tensor table") from None
    if 8 + n + end != size:
        raise KVFileError(f"file is {size} bytes, its header describes {8 + n + end}")
    fp, ns, tokens, layers = meta.get("fingerprint"), meta.get("ns"), meta.get("tokens"), meta.get("layers")
    if not isinstance(fp, str) or not isinstance(ns, str) or meta.get("ns_hash") != ns_hash(ns):
        raise KVFileError("bad fingerprint or namespace fields")
    if not isinstance(tokens, list) or any(type(t) is not int or not 0 <= t < _MAX_TOKEN for t in tokens):
        raise KVFileError("bad token ids")
    if not isinstance(layers, list) or type(meta.get("nbytes")) is not int or not _is_reach(meta.get("trimmable")):
        raise KVFileError("bad layer table")
    if expect_fingerprint is not None and fp != expect_fingerprint:
        raise KVFileError(f"model fingerprint {fp!r} != {expect_fingerprint!r}")
    if expect_ns is not None and ns != expect_ns:
        raise KVFileError("namespace mismatch")
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}
    reach = meta["trimmable"] if type(meta["trimmable"]) is bool else tuple(meta["trimmable"])
    return KVHeader(fp, ns, meta["ns_hash"], tuple(tokens), reach, meta["nbytes"], tuple(layers), extra)


def _is_reach(value: Any) -> bool:
    """A header's reach (cache.prefix): a bool, or the positions its checkpoints cut it back to."""
    return type(value) is bool or (isinstance(value, list) and len(value) <= 4096
                                   and all(type(p) is int and 0 < p < _MAX_TOKEN for p in value))


def load(path: str | os.PathLike, *, expect_fingerprint: str | None = None, expect_ns: str | None = None,
         stream: Any = None) -> KVFile:
    """Read and rebuild an entry; KVFileError for anything invalid, OSError if the file cannot be opened.

    The arrays are evaluated before returning (the read happens here, on `stream` if given), so the file may be
    deleted right after.
    """
    header = read_header(path, expect_fingerprint=expect_fingerprint, expect_ns=expect_ns)
    try:
        arrays = mx.load(os.fspath(path), format="safetensors", stream=stream)
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError) as e:
        raise KVFileError(f"unreadable tensors: {e}") from None
    used: set[str] = set()

    def getter(prefix: str) -> Get:
        def get(part: str) -> mx.array:
            name = prefix + part
            if name not in arrays:
                raise KVFileError(f"missing tensor {name!r}")
            used.add(name)
            return arrays[name]
        return get

    try:
        caches = [_decode_layer(layer, getter(f"{i}."), 0) for i, layer in enumerate(header.layers)]
    except (TypeError, ValueError, AttributeError, RecursionError) as e:  # hostile metadata, never a crash
        raise KVFileError(f"bad layer metadata: {e.__class__.__name__}") from None
    if used != set(arrays):
        raise KVFileError(f"unexpected tensors: {sorted(set(arrays) - used)[:5]}")
    return KVFile(header.tokens, caches, header)
