"""A KV cache that reads a prefix cache entry in place: a RAM hit's first token without copying the entry's KV.

A RAM-tier hit hands the taker new ``KVCache`` objects over the entry's arrays (``cache.copying.fork``); mlx-lm's
``KVCache`` holds one contiguous buffer per layer, so the taker's first new token makes it copy the whole prefix
into a new buffer (the entry must stay untouched). On this CPU that copy was ~35 ms of a ~125 ms hit at 1,024
tokens of the default model (47 MB over 30 layers, mostly first-touch page faults of the new buffer), and it
grows with the conversation: the price of every agent turn's hit.

``SharedPrefixKVCache`` keeps the entry's arrays as a read-only first segment and writes new positions into a
``KVCache`` of its own (the tail). ``segmented_attention`` (below) attends over both segments where they lie (the
scores of each, one softmax over all, each segment's weighted values summed), so nothing is copied:
``models.attention.cpu`` for every step on the CPU, ``models.attention.gpu`` for decode and verify steps on CUDA. For
anything else it is a ``KVCache``: ``keys`` / ``values`` are the lazy concatenation of the two segments (MLX computes it only if something
evaluates it), ``offset``, ``trim``, ``make_mask`` and ``update_and_fetch`` behave as KVCache's. Two exceptions:
``state`` is the segments (so that ``mx.eval(c.state)`` after a chunk evaluates what was written, not a copy), and
the cache is not a plain ``KVCache`` for the rest of the server: ``flatten`` gives one (the prefix cache, the batch
and the SSD tier see only those).

Used by the lane for a solo sequence's hit (``share_prefix``) where every attention of the model goes through one of
those (``models.attention.reads_segments``). On CUDA a prompt chunk past ``MAX_WIDTH`` queries reads the lazy
concatenation instead (MLX's kernels want one buffer: one copy of the prefix, as mlx-lm's ``KVCache`` makes when a
chunk outgrows its room), and a row joining a batch is copied into the batch's buffers either way
(``RaggedKV.extend`` writes the segments where they go).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

__all__ = ["SharedPrefixKVCache", "share_prefix", "flatten", "segmented_attention"]


class SharedPrefixKVCache(KVCache):
    def __init__(self, keys: mx.array, values: mx.array):
        """Over the first ``keys.shape[2]`` positions of a (B, KV, S, D) entry (views: nothing is copied)."""
        # KVCache.__init__ is not called: keys / values / offset are properties here
        self._prefix = (keys, values)
        self._tail = _tail()

    @classmethod
    def over(cls, cache: KVCache) -> "SharedPrefixKVCache":
        n = cache.offset
        return cls(cache.keys[..., :n, :], cache.values[..., :n, :])

    # -- what the model's attention reads -----------------------------------------------------------
    def segments(self) -> list[tuple[mx.array, mx.array]]:
        """The (keys, values) pieces in position order: the shared prefix, then this cache's own positions."""
        pk, pv = self._prefix
        out = [(pk, pv)] if pk.shape[2] else []
        t = self._tail
        if t.offset:
            out.append((t.keys[..., : t.offset, :], t.values[..., : t.offset, :]))
        return out

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._tail.update_and_fetch(keys, values)
        return self.keys, self.values  # lazy: unused (never computed) where the attention reads the segments

    # -- KVCache's interface --------------------------------------------------------------------------
    @property
    def prefix_length(self) -> int:
        return self._prefix[0].shape[2]

    @property
    def offset(self) -> int:
        return self.prefix_length + self._tail.offset

    @offset.setter
    def offset(self, value: int) -> None:  # KVCache.trim's ``self.offset -= n``
        p = self.prefix_length
        if value >= p:
            self._tail.offset = value - p
        else:
            pk, pv = self._prefix
            self._prefix = (pk[..., :value, :], pv[..., :value, :])
            self._tail = _tail()

    @property
    def keys(self) -> Optional[mx.array]:
        return _joined([k for k, _ in self.segments()])

    @property
    def values(self) -> Optional[mx.array]:
        return _joined([v for _, v in self.segments()])

    # whoever assigns the arrays (a pipeline-parallel model orders its ranks with ``cache.keys = mx.depends(...)``)
    # gets one segment: correct, at the price of the copy this class exists to avoid
    @keys.setter
    def keys(self, value: mx.array) -> None:
        n, values = self.offset, self.values
        self._prefix, self._tail = (value[..., :n, :], values), _tail()

    @values.setter
    def values(self, value: mx.array) -> None:
        n, keys = self.offset, self.keys
        self._prefix, self._tail = (keys, value[..., :n, :]), _tail()

    @property
    def state(self):
        return [a for seg in self.segments() for a in seg]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for seg in self.segments() for a in seg)

    def empty(self) -> bool:
        return self.offset == 0

    def flatten(self, room: int = 0) -> KVCache:
        """A plain KVCache holding the same positions (one copy, made when evaluated), with ``room`` more positions
        in its buffers (zeros past ``offset``: the next tokens are written in place, as mlx-lm's KVCache grows)."""
        out = KVCache()
        if self.offset:
            keys, values = self.keys, self.values
            assert keys is not None and values is not None  # it holds positions
            if room > 0:
                keys, values = (mx.concatenate([a, mx.zeros(a.shape[:2] + (room,) + a.shape[3:], a.dtype)], axis=2)
                                for a in (keys, values))
            out.keys, out.values, out.offset = keys, values, self.offset
        return out


def _tail() -> KVCache:
    """The buffer of a cache's own positions: grown 32 positions at a time, not mlx-lm's 256 (a hit's first token
    would otherwise fault in 256 fresh positions per layer, ~12 MB with the default model, for one)."""
    t = KVCache()
    t.step = TAIL_STEP
    return t


TAIL_STEP = 32


def _joined(parts: list) -> Optional[mx.array]:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def share_prefix(caches: list) -> list:
    """A hit's caches as ``SharedPrefixKVCache`` where every layer is a plain ``KVCache`` holding positions;
    otherwise the same list. The caller decides that the model's attention reads segments
    (``models.attention.reads_segments``)."""
    if not caches or not all(type(c) is KVCache and c.keys is not None and c.offset for c in caches):
        return caches
    return [SharedPrefixKVCache.over(c) for c in caches]


def flatten(caches: list, room: int = 0) -> list:
    """Plain ``KVCache`` layers for what stores or batches them (``SharedPrefixKVCache.flatten``, with ``room`` more
    positions; others as they are), evaluated: a stored entry must not hold a lazy copy that its next taker would pay
    for."""
    if not any(isinstance(c, SharedPrefixKVCache) for c in caches):
        return caches
    out = [c.flatten(room) if isinstance(c, SharedPrefixKVCache) else c for c in caches]
    mx.eval([a for c in out if c.keys is not None for a in (c.keys, c.values)])
    return out


def _precise_softmax(scores: mx.array) -> mx.array:
    return mx.softmax(scores, axis=-1, precise=True)


def segmented_attention(queries: mx.array, segments: list, scale: float, mask: Optional[mx.array | str],
                        sinks: Optional[mx.array] = None, softmax: Callable[[mx.array], mx.array] = _precise_softmax
                        ) -> Optional[mx.array]:
    """``softmax(q k^T * scale + mask) v`` for ``queries`` (B, H, L, D) over keys and values held in pieces along the
    sequence axis (``segments``: (keys (B, KV, S_i, D), values (B, KV, S_i, Dv)) pairs in position order, e.g. a
    shared prefix and a cache's own tail), read where they lie: each piece's scores, one ``softmax`` over all of them
    (float32; the mask applies to their columns in order), each piece's weighted values summed. Nothing the size of
    the keys or values is copied. H a multiple of KV; ``mask`` None, ``"causal"`` (query i sees keys up to
    i + S - L), or a bool / additive array of shape (L, S), (B or 1, 1, L, S); ``sinks`` (H,): each head's sink
    logit, one more column of its softmax that weighs no value. Returns None for a mask it does not take (the caller
    falls back). ``models.attention.cpu`` passes its numpy softmax; on CUDA ``models.attention.gpu`` takes MLX's."""
    B, H, L, D = queries.shape
    kv = segments[0][0].shape[1]
    S = sum(k.shape[2] for k, _ in segments)
    rep = H // kv
    if isinstance(mask, str):
        if mask != "causal":
            return None
        mask = mx.arange(S)[None, :] <= (mx.arange(L) + (S - L))[:, None]
    if mask is not None and not (mask.ndim == 2 or (mask.ndim == 4 and mask.shape[1] == 1)):
        return None
    q = (queries * scale).reshape(B, kv, rep * L, D)
    parts = [q @ k.swapaxes(-1, -2) for k, _ in segments]
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    if mask is not None:
        scores = scores.reshape(B, kv, rep, L, S)
        m = mask if mask.ndim == 2 else mask[:, :, None]  # (B, 1, 1, L, S): every head of every group
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, mx.array(-mx.inf, scores.dtype))
        else:
            scores = scores + m
        scores = scores.reshape(B, kv, rep * L, S)
    if sinks is not None:  # one more column per head: its sink logit (rep query heads per KV head, in order)
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, kv, rep, 1, 1), (B, kv, rep, L, 1))
        scores = mx.concatenate([scores.reshape(B, kv, rep, L, S), sink], axis=-1).reshape(B, kv, rep * L, S + 1)
    weights = softmax(scores)
    if sinks is not None:
        weights = weights[..., :S]
    if len(segments) == 1:
        out = weights @ segments[0][1]
    else:
        out, col = None, 0
        for k, v in segments:
            n = k.shape[2]
            part = weights[..., col: col + n] @ v
            out = part if out is None else out + part
            col += n
    return out.reshape(B, H, L, out.shape[-1])  # the values' width (latent attention's differs from the keys')
