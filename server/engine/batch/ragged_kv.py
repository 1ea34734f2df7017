"""A batch KV layout for rows of different lengths that each write at their own end: speculation in the batch, and
the plain batch's joins and leaves without copying the running rows (``server.engine.batch.ragged``).

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
    kv.commit([kept_0, kept_1, ...])               # 0 <= kept_i <= W
    kv.rewind([n_0, n_1, ...])                     # row i drops its last n_i positions (no copy)
    caches = kv.extract(i)                         # row i's own per-layer KVCache list, for the prefix cache
    kv.extend([row_caches])                        # a row joins: written into a free slot, in place
    order = kv.release([i])                        # rows leave: the last live rows fill their slots

Rows live in slots of preallocated buffers (slots grown by half again when full, positions by a quarter again, in
steps of 256): a join
writes only the joining row, a leave moves only the rows that fill the holes (the live rows stay 0..n-1, so a
forward sees a leading slice of the buffers), and neither copies the rest of the batch. Free slots take a few zeros
per forward (the write is one scatter over all slots) and are never attended to.

What the model sees through ``kv.layers[l]``: ``offset`` (an array of the rows' lengths: RoPE positions per row),
``update_and_fetch`` (writes at each row's end; returns the buffers up to the longest end), ``make_mask`` (row i's
query q attends to columns 0..len_i+q: its own past and the causal part of what it feeds now; the columns past
its own end, stale or another row's longer history, are masked), ``attention_ranges`` (the same as two arrays, for
``models.attention.gpu``'s fused kernel on CUDA, which then reads only each row's own columns; elsewhere the mask
costs an attention over the longest row for every row, as left-padding does).

Sliding-window layers (mlx-lm's ``RotatingKVCache`` with nothing kept at the front: gpt-oss, gemma3) live here too,
as plain positions: such a layer's buffer holds a row's whole history like the others' (what a wrapped window
brought at the join lies at its last ``window`` columns; the columns below are never read), and its queries see only
the last ``window`` columns up to their own (``attention_window``: the fused kernel skips what lies below; the mask
says the same). Nothing of a window is rotated, so joins and leaves copy no more than for full attention, a rewind is
free, and ``extract`` hands back a ``RotatingKVCache`` holding the row's last ``window`` positions in order, as
mlx-lm's own cache would after the same tokens (``tests/unit/test_ragged_batch.py``). No quantized KV, no recurrent
state (that is ``HybridRagged``'s, beside this): the engine sends only such models here. Only the lane thread touches
a RaggedKV.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from models.attention.shared_prefix import SharedPrefixKVCache
from models.mlx_compat import set_ring_index, temporal_order

__all__ = ["RaggedKV", "holds_kv"]

_STEP = 256  # buffer growth, in positions (as mlx-lm's caches)


def holds_kv(caches: list) -> bool:
    """Can a RaggedKV hold this row: every layer a plain KVCache (a hit's SharedPrefixKVCache is read in place) or a
    sliding window that keeps nothing at its front?"""
    return bool(caches) and all(type(c) is KVCache or isinstance(c, SharedPrefixKVCache) or is_window(c)
                                for c in caches)


def is_window(cache) -> bool:
    """A sliding-window layer the ragged layout holds (mlx-lm's RotatingKVCache, nothing kept at its front)."""
    return type(cache) is RotatingKVCache and cache.keep == 0


def window_of(cache) -> int:
    """The layer's window in positions (0: it sees its whole row)."""
    return int(cache.max_size) if is_window(cache) else 0


def _ordered(cache) -> tuple[mx.array, mx.array]:
    """A layer's keys and values in the order of their positions (a wrapped window's buffer is rotated)."""
    if is_window(cache):
        return temporal_order(cache, cache.keys), temporal_order(cache, cache.values)
    return cache.keys, cache.values


class RaggedKV:
    def __init__(self, windows: list[int]):
        """``windows``: each layer's sliding window (0: full attention)."""
        self.lengths: list[int] = []  # per live row: positions its KV holds (rows 0..len-1 are the live ones)
        self.windows = list(windows)
        self.layers = [_Layer(self, i) for i in range(len(windows))]
        n_layers = len(windows)
        self._keys: list[Optional[mx.array]] = [None] * n_layers  # (slots, H, capacity, D); slots >= live rows
        self._values: list[Optional[mx.array]] = [None] * n_layers
        self._offset = mx.array([], dtype=mx.int32)
        self._start: Optional[mx.array] = None  # zeros, one per live row (``ranges``)
        self._pos: Optional[tuple] = None  # (width, the write positions of every slot) of the forward being built

    @classmethod
    def from_rows(cls, rows: list[list]) -> "RaggedKV":
        """A batch of the given rows (each a per-layer list of KVCache covering its own tokens)."""
        kv = cls([window_of(c) for c in rows[0]])
        kv.extend(rows)
        return kv

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        """Positions every slot has room for."""
        k = self._keys[0]
        return 0 if k is None else k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold: every slot (free ones too) at full capacity, what the memory budget must count."""
        return sum(a.nbytes for a in (*self._keys, *self._values) if a is not None)

    @property
    def slots(self) -> int:
        """Rows the buffers have room for (live rows and free slots)."""
        k = self._keys[0]
        return 0 if k is None else k.shape[0]

    # -- rows in and out ---------------------------------------------------------------------------
    def extend(self, rows: list[list]) -> None:
        """Append rows (per-layer KVCache lists, consumed; a hit's ``SharedPrefixKVCache`` layers too, read where
        they lie): each row's KV is written into a free slot, in place; the
        live rows are not copied unless the buffers must grow (slots by half again, positions in steps of 256), so
        joins cost what the joining rows hold, amortised."""
        if not rows:
            return
        lengths = [int(r[0].offset) for r in rows]
        for row in rows:
            if not holds_kv(row) or [window_of(c) for c in row] != self.windows:
                kinds = ", ".join(sorted({type(c).__name__ for c in row}))
                raise TypeError(f"RaggedKV holds plain KVCache layers and the windows {self.windows}, got {kinds}")
        first = len(self.lengths)
        need = first + len(rows)
        if self._keys[0] is None:
            self._allocate(rows, need, _round_up(max(lengths + [1])))
        else:
            self._grow(_round_up(max(lengths + [1])))
            if need > self.slots:
                self._add_slots(max(need, self.slots + self.slots // 2))
        for layer in range(len(self.layers)):
            for j, (row, n) in enumerate(zip(rows, lengths)):
                if n:
                    c, s = row[layer], first + j
                    if is_window(c):  # the positions it holds are the row's last ones
                        k, v = _ordered(c)
                        m = min(n, k.shape[2])
                        self._keys[layer][s: s + 1, :, n - m: n, :] = k[..., k.shape[2] - m:, :]
                        self._values[layer][s: s + 1, :, n - m: n, :] = v[..., v.shape[2] - m:, :]
                        continue
                    col = 0  # a hit's SharedPrefixKVCache: its segments, each written where it goes (one copy)
                    for k, v in (c.segments() if isinstance(c, SharedPrefixKVCache) else [(c.keys, c.values)]):
                        w = min(k.shape[2], n - col)
                        self._keys[layer][s: s + 1, :, col: col + w, :] = k[..., :w, :]
                        self._values[layer][s: s + 1, :, col: col + w, :] = v[..., :w, :]
                        col += w
        self.lengths.extend(lengths)
        self._set_lengths(self.lengths)
        mx.eval(self._keys, self._values)

    def extract(self, i: int) -> list:
        """Row i's own caches (new KVCache objects over a copy of its live KV)."""
        n = self.lengths[i]
        out = []
        for layer, window in enumerate(self.windows):
            c: Any
            if window:  # its last `window` positions, in order: mlx-lm's own state after the same tokens
                lo = max(0, n - window)
                c = RotatingKVCache(max_size=window, keep=0)
                set_ring_index(c, n - lo)
            else:
                lo, c = 0, KVCache()
            c.keys = mx.contiguous(self._keys[layer][i: i + 1, :, lo:n, :])
            c.values = mx.contiguous(self._values[layer][i: i + 1, :, lo:n, :])
            c.offset = n
            out.append(c)
        mx.eval([x for c in out for x in (c.keys, c.values)])
        return out

    def release(self, gone: list[int]) -> list[int]:
        """Free these rows' slots. The live rows stay rows 0..n-1: each hole below the new end takes the last live
        row (one row's KV copied per hole; the others do not move). Returns the new row order as old indices, for
        the caller's own per-row lists."""
        dead = set(gone)
        keep = [i for i in range(len(self.lengths)) if i not in dead]
        m = len(keep)
        holes = sorted(i for i in dead if i < m)
        movers = [i for i in keep if i >= m]
        order = list(range(m))
        for h, mv in zip(holes, movers):
            order[h] = mv
        if not keep:
            self._keys = [None] * len(self.layers)
            self._values = [None] * len(self.layers)
        elif holes:
            for layer in range(len(self.layers)):
                # copies first, evaluated, so that the slice writes below find the buffers unshared and write in place
                parts = [(h, self._copy(layer, mv)) for h, mv in zip(holes, movers)]
                mx.eval([x for _, kv in parts for x in kv])
                for h, (k, v) in parts:
                    n = k.shape[2]
                    self._keys[layer][h: h + 1, :, :n, :] = k
                    self._values[layer][h: h + 1, :, :n, :] = v
            mx.eval(self._keys, self._values)
        self._set_lengths([self.lengths[i] for i in order])
        return order

    def filter(self, keep: list[int]) -> None:
        """Keep only these rows, in this order (every kept row is copied; ``release`` moves only what fills holes)."""
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
        self._set_lengths(self.lengths)

    # -- a forward ---------------------------------------------------------------------------------
    def reserve(self, width: int) -> None:
        """Before a forward of `width` tokens per row: room for every row's new positions."""
        self._grow(_round_up(max(self.lengths) + width))

    def commit(self, kept: list[int]) -> None:
        """After a forward: row i keeps the first kept[i] of the positions it just wrote (the rest is overwritten
        by its next forward)."""
        if len(kept) != len(self.lengths):
            raise ValueError(f"{len(kept)} counts for {len(self.lengths)} rows")
        self._set_lengths([n + k for n, k in zip(self.lengths, kept)])

    def rewind(self, counts: list[int]) -> None:
        """Row i drops its last counts[i] positions (drafts fed and then rejected): its length goes back, nothing is
        copied (its next forward overwrites them)."""
        if len(counts) != len(self.lengths) or any(c < 0 or c > n for c, n in zip(counts, self.lengths)):
            raise ValueError(f"cannot rewind rows of lengths {self.lengths} by {counts}")
        self._set_lengths([n - c for n, c in zip(self.lengths, counts)])

    def ranges(self, width: int) -> tuple[mx.array, mx.array]:
        """What ``mask(width)`` says as two int32 arrays of shape (B,) (``models.attention.gpu``'s fused kernel
        takes these instead of the mask): row i's first visible column (0) and the last column its first query sees
        (len_i; query q sees up to len_i + q)."""
        if self._start is None or self._start.shape[0] != len(self.lengths):
            self._start = mx.zeros((len(self.lengths),), dtype=mx.int32)
        return self._start, self._offset

    def mask(self, width: int, window: int = 0) -> mx.array:
        """(B, 1, width, end) bool: row i's query q sees columns 0..len_i + q (the last ``window`` of them)."""
        end = max(self.lengths) + width
        last = self._offset[:, None] + mx.arange(width)[None, :]  # (B, W): the last column each query sees
        cols = mx.arange(end)[None, None, :]
        seen = cols <= last[:, :, None]
        if window:
            seen = seen & (cols > last[:, :, None] - window)
        return seen[:, None]

    def _write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, width = keys.shape[0], keys.shape[2]
        if self.capacity < max(self.lengths) + width:
            self._grow(_round_up(max(self.lengths) + width))
        pad = self.slots - B
        if pad:  # free slots take zeros at their first columns: one scatter over the whole buffer, in place
            keys = mx.concatenate([keys, mx.zeros((pad,) + keys.shape[1:], keys.dtype)], axis=0)
            values = mx.concatenate([values, mx.zeros((pad,) + values.shape[1:], values.dtype)], axis=0)
        pos = self._positions(width)
        self._keys[layer] = mx.put_along_axis(self._keys[layer], pos, keys, axis=2)
        self._values[layer] = mx.put_along_axis(self._values[layer], pos, values, axis=2)
        end = max(self.lengths) + width
        k, v = self._keys[layer], self._values[layer]
        if pad:
            return k[:B, :, :end, :], v[:B, :, :end, :]
        return k[..., :end, :], v[..., :end, :]

    def _positions(self, width: int) -> mx.array:
        """(slots, 1, width, 1): where each slot's new positions go (a free slot: its first columns)."""
        if self._pos is None or self._pos[0] != width:
            starts = self.lengths + [0] * (self.slots - len(self.lengths))
            pos = mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)[None, :]
            self._pos = (width, pos[:, None, :, None])
        return self._pos[1]

    def _set_lengths(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self._offset = mx.array(self.lengths, dtype=mx.int32)
        self._pos = None

    def _copy(self, layer: int, i: int) -> tuple[mx.array, mx.array]:
        n = self.lengths[i]
        k = self._keys[layer][i: i + 1, :, :n, :]
        v = self._values[layer][i: i + 1, :, :n, :]
        return mx.contiguous(k) + 0, mx.contiguous(v) + 0  # own buffers, never views of the batch's

    def _allocate(self, rows: list[list], slots: int, capacity: int) -> None:
        for layer in range(len(self.layers)):
            k, v = _reference(rows, layer)
            self._keys[layer] = mx.zeros((slots, k.shape[1], capacity, k.shape[3]), k.dtype)
            self._values[layer] = mx.zeros((slots, v.shape[1], capacity, v.shape[3]), v.dtype)

    def _add_slots(self, slots: int) -> None:
        extra = slots - self.slots
        for layer in range(len(self.layers)):
            k, v = self._keys[layer], self._values[layer]
            self._keys[layer] = mx.concatenate([k, mx.zeros((extra,) + k.shape[1:], k.dtype)], axis=0)
            self._values[layer] = mx.concatenate([v, mx.zeros((extra,) + v.shape[1:], v.dtype)], axis=0)
        self._pos = None

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` positions in every slot: a copy of every slot, so by a quarter again at least (an
        agent's next turn is usually the longest row yet: growing to just fit it would copy the batch on most joins)."""
        if self._keys[0] is None or capacity <= self.capacity:
            return
        capacity = max(capacity, _round_up(self.capacity + self.capacity // 4))
        extra = capacity - self.capacity
        for layer in range(len(self.layers)):
            k, v = self._keys[layer], self._values[layer]
            S, H, _, D = k.shape
            self._keys[layer] = mx.concatenate([k, mx.zeros((S, H, extra, D), k.dtype)], axis=2)
            self._values[layer] = mx.concatenate([v, mx.zeros((S, H, extra, v.shape[3]), v.dtype)], axis=2)


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
        return self._owner.mask(N, window_size or self._owner.windows[self._index])

    def attention_ranges(self, width: int) -> tuple[mx.array, mx.array]:
        return self._owner.ranges(width)

    @property
    def attention_window(self) -> int:
        """Its sliding window (0: none): the fused kernel's queries see only that many columns up to their own."""
        return self._owner.windows[self._index]

    def is_trimmable(self) -> bool:
        return False  # rewinds go through RaggedKV.commit, per row

    @property
    def state(self):
        return self._owner._keys[self._index], self._owner._values[self._index]

    # the layer's whole buffers, as mlx-lm's caches expose them: a pipeline-parallel model orders its ranks' work
    # through them (``cache[-1].keys = mx.depends(cache[-1].keys, h)``)
    @property
    def keys(self) -> mx.array:
        return self._owner._keys[self._index]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._owner._keys[self._index] = value

    @property
    def values(self) -> mx.array:
        return self._owner._values[self._index]

    @values.setter
    def values(self, value: mx.array) -> None:
        self._owner._values[self._index] = value


def _round_up(n: int) -> int:
    return ((n + _STEP - 1) // _STEP) * _STEP


def _reference(rows: list[list], layer: int) -> tuple[mx.array, mx.array]:
    """A (keys, values) pair that gives a layer's heads, head size and dtype: the first row that has buffers."""
    for row in rows:
        c = row[layer]
        if c.keys is not None:
            return c.keys, c.values
    raise ValueError("a row with no KV cannot start a RaggedKV")
