"""A batch KV layout for rows of different lengths that each write at their own end: speculation in the batch.

mlx-lm's ``BatchKVCache`` left-pads rows to a common end and writes every row's new tokens at one shared column, so
a step must add the same number of tokens to every row and a rewind takes the same number from every row. Verifying
drafts in a batch needs the opposite: row i feeds 1 + k_i tokens (its pending token and its drafts) and keeps
1 + a_i of them (what was accepted). Here each row's KV is left-aligned (row i holds positions 0..len_i-1 of its
own sequence) and a forward of width W writes row i's W new positions at columns len_i..len_i+W-1 (one
``put_along_axis`` per layer); after the forward ``commit(kept)`` sets len_i += kept_i, and whatever a row wrote
past its new end (rejected drafts, the right-padding of a row with fewer drafts) is simply overwritten by its next
forward. Nothing is copied to rewind.

    kv = RaggedKV.from_rows([row_caches, ...])     # each row: its own per-layer KVCache list (consumed)
    logits = model(tokens_BxW, cache=kv.layers)    # every row feeds W tokens (pad what it does not have)
    kv.commit([kept_0, kept_1, ...])               # 1 <= kept_i <= W
    caches = kv.extract(i)                         # row i's own per-layer KVCache list, for the prefix cache

What the model sees through ``kv.layers[l]``: ``offset`` (an array of the rows' lengths: RoPE positions per row),
``update_and_fetch`` (writes at each row's end; returns the buffers up to the longest end), ``make_mask`` (row i's
query q attends to columns 0..len_i+q: its own past and the causal part of what it feeds now; the columns past
its own end, stale or another row's longer history, are masked). The mask costs an attention over the longest row
for every row, as left-padding does.

Only plain ``KVCache`` layers (no sliding window, no quantized KV, no recurrent state): the engine sends only such
models here. Only the lane thread touches a RaggedKV.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

__all__ = ["RaggedKV"]

_STEP = 256  # buffer growth, in positions (as mlx-lm's caches)


class RaggedKV:
    def __init__(self, n_layers: int):
        self.lengths: list[int] = []  # per row: positions its KV holds
        self.layers = [_Layer(self, i) for i in range(n_layers)]
        self._keys: list[Optional[mx.array]] = [None] * n_layers
        self._values: list[Optional[mx.array]] = [None] * n_layers
        self._offset = mx.array([], dtype=mx.int32)
        self._width = 0  # tokens per row of the forward being built (set by the first layer's write)

    @classmethod
    def from_rows(cls, rows: list[list]) -> "RaggedKV":
        """A batch of the given rows (each a per-layer list of KVCache covering its own tokens)."""
        kv = cls(len(rows[0]))
        kv.extend(rows)
        return kv

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        k = self._keys[0]
        return 0 if k is None else k.shape[2]

    # -- rows in and out ---------------------------------------------------------------------------
    def extend(self, rows: list[list]) -> None:
        """Append rows (per-layer KVCache lists, consumed): their KV is copied into the batch buffers."""
        if not rows:
            return
        lengths = [int(r[0].offset) for r in rows]
        cap = max(self.capacity, _round_up(max(lengths + [1])))
        self._grow(cap)
        for layer in range(len(self.layers)):
            ks, vs = [], []
            for row, n in zip(rows, lengths):
                c = row[layer]
                if type(c) is not KVCache:
                    raise TypeError(f"RaggedKV holds plain KVCache layers, got {type(c).__name__}")
                k, v = (c.keys[..., :n, :], c.values[..., :n, :]) if n else _empty_like(self, layer, c)
                ks.append(_pad_to(k, cap))
                vs.append(_pad_to(v, cap))
            new_k, new_v = mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)
            old_k, old_v = self._keys[layer], self._values[layer]
            self._keys[layer] = new_k if old_k is None else mx.concatenate([old_k, new_k], axis=0)
            self._values[layer] = new_v if old_v is None else mx.concatenate([old_v, new_v], axis=0)
        self.lengths.extend(lengths)
        self._offset = mx.array(self.lengths, dtype=mx.int32)
        mx.eval(self._keys, self._values)

    def extract(self, i: int) -> list:
        """Row i's own caches (new KVCache objects over a copy of its live KV)."""
        n = self.lengths[i]
        out = []
        for layer in range(len(self.layers)):
            c = KVCache()
            c.keys = mx.contiguous(self._keys[layer][i: i + 1, :, :n, :])
            c.values = mx.contiguous(self._values[layer][i: i + 1, :, :n, :])
            c.offset = n
            out.append(c)
        mx.eval([x for c in out for x in (c.keys, c.values)])
        return out

    def filter(self, keep: list[int]) -> None:
        """Keep only these rows, in this order."""
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self._keys = [None] * len(self.layers)
            self._values = [None] * len(self.layers)
        else:
            idx = mx.array(keep, dtype=mx.int32)
            top = _round_up(max(self.lengths))  # shrink the buffers to what the longest kept row needs
            self._keys = [k[idx, :, :top, :] for k in self._keys]
            self._values = [v[idx, :, :top, :] for v in self._values]
            mx.eval(self._keys, self._values)
        self._offset = mx.array(self.lengths, dtype=mx.int32)

    # -- a forward ---------------------------------------------------------------------------------
    def reserve(self, width: int) -> None:
        """Before a forward of `width` tokens per row: room for every row's new positions."""
        self._grow(_round_up(max(self.lengths) + width))

    def commit(self, kept: list[int]) -> None:
        """After a forward: row i keeps the first kept[i] of the positions it just wrote (the rest is overwritten
        by its next forward)."""
        if len(kept) != len(self.lengths):
            raise ValueError(f"{len(kept)} counts for {len(self.lengths)} rows")
        self.lengths = [n + k for n, k in zip(self.lengths, kept)]
        self._offset = mx.array(self.lengths, dtype=mx.int32)

    def mask(self, width: int) -> mx.array:
        """(B, 1, width, end) bool: row i's query q sees columns 0..len_i + q."""
        end = max(self.lengths) + width
        last = self._offset[:, None] + mx.arange(width)[None, :]  # (B, W): the last column each query sees
        return (mx.arange(end)[None, None, :] <= last[:, :, None])[:, None]

    def _write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        width = keys.shape[2]
        if self.capacity < max(self.lengths) + width:
            self._grow(_round_up(max(self.lengths) + width))
        pos = (self._offset[:, None] + mx.arange(width)[None, :])[:, None, :, None]  # (B, 1, W, 1)
        self._keys[layer] = mx.put_along_axis(self._keys[layer], pos, keys, axis=2)
        self._values[layer] = mx.put_along_axis(self._values[layer], pos, values, axis=2)
        end = max(self.lengths) + width
        return self._keys[layer][..., :end, :], self._values[layer][..., :end, :]

    def _grow(self, capacity: int) -> None:
        if self._keys[0] is None or capacity <= self.capacity:
            return
        extra = capacity - self.capacity
        for layer in range(len(self.layers)):
            k, v = self._keys[layer], self._values[layer]
            B, H, _, D = k.shape
            self._keys[layer] = mx.concatenate([k, mx.zeros((B, H, extra, D), k.dtype)], axis=2)
            self._values[layer] = mx.concatenate([v, mx.zeros((B, H, extra, v.shape[3]), v.dtype)], axis=2)


class _Layer:
    """One layer's view of a RaggedKV, with the cache interface mlx-lm's attention layers use."""

    def __init__(self, owner: RaggedKV, index: int):
        self._owner, self._index = owner, index

    @property
    def offset(self) -> mx.array:
        return self._owner._offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._owner._write(self._index, keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **_) -> mx.array:
        return self._owner.mask(N)

    def is_trimmable(self) -> bool:
        return False  # rewinds go through RaggedKV.commit, per row

    @property
    def state(self):
        return self._owner._keys[self._index], self._owner._values[self._index]


def _round_up(n: int) -> int:
    return ((n + _STEP - 1) // _STEP) * _STEP


def _pad_to(x: mx.array, length: int) -> mx.array:
    n = x.shape[2]
    if n == length:
        return x
    B, H, _, D = x.shape
    return mx.concatenate([x, mx.zeros((B, H, length - n, D), x.dtype)], axis=2)


def _empty_like(kv: RaggedKV, layer: int, c: KVCache) -> tuple[mx.array, mx.array]:
    """A row with no KV yet: zero-length arrays of the batch's shape (or of the row's own, if it has buffers)."""
    ref_k = kv._keys[layer] if kv._keys[layer] is not None else c.keys
    ref_v = kv._values[layer] if kv._values[layer] is not None else c.values
    if ref_k is None:
        raise ValueError("a row with no KV cannot start a RaggedKV")
    return (mx.zeros((1, ref_k.shape[1], 0, ref_k.shape[3]), ref_k.dtype),
            mx.zeros((1, ref_v.shape[1], 0, ref_v.shape[3]), ref_v.dtype))
