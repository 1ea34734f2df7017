"""Hybrid models in the ragged layout: the recurrent state of each row (linear attention, SSM, short convolutions:
mlx-lm's ``ArraysCache`` layers) in slots beside the attention layers' ``RaggedKV``.

A recurrent layer's state is a fixed-size summary of everything a row has seen: it has no positions, so rows of
different lengths need no padding at all, and a decode step (every row feeds one token) advances every row's state
exactly as it would alone. ``RaggedStates`` keeps, per recurrent layer, each state array of exactly the live rows
stacked on a row axis (no free slots: a step's new state is the whole array, so keeping free slots beside it cost a
copy of every state each step); the model's layer reads and writes them through ``_StateLayer``, which has what
mlx-lm's recurrent layers use of an ``ArraysCache`` (``cache[i]`` get and set, ``lengths``, ``advance``,
``make_mask``). A join appends the row's state (one copy of the arrays, at the join); a leave copies it out and
moves the last row into the hole, in the same order as ``RaggedKV.release``.

``HybridRagged`` puts the two side by side under the model's layer order and answers the ``RaggedKV`` interface the
ragged batch uses (``from_rows``, ``extend``, ``reserve``, ``layers``, ``commit``, ``extract``, ``release``,
``nbytes``, ``lengths``). A state cannot be rewound: a hybrid row never speculates in a batch; what leaves covers exactly
the tokens its batch says (pipelined on a GPU, every token it returned: such a row leaves only when it finishes,
``server.engine.batch.choose.moves``). Only the lane thread touches one.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from server.engine.batch.ragged_kv import RaggedKV, holds_kv, window_of

__all__ = ["HybridRagged", "RaggedStates", "is_state"]


def is_state(cache) -> bool:
    """A recurrent-state layer (mlx-lm's ``ArraysCache`` and the subclasses models use)."""
    return isinstance(cache, ArraysCache)


class RaggedStates:
    def __init__(self, sizes: list[int]):
        """``sizes``: the number of state arrays of each recurrent layer."""
        self._arrays: list[list[Optional[mx.array]]] = [[None] * n for n in sizes]  # (rows, ...) per array
        self.rows = 0
        self.layers = [_StateLayer(self, i) for i in range(len(sizes))]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self._arrays for a in layer if a is not None)

    def extend(self, rows: list[list[ArraysCache]]) -> None:
        """Append these rows' states after the live rows (one copy of each array, at the join)."""
        for layer, arrays in enumerate(self._arrays):
            for e in range(len(arrays)):
                states = [row[layer].cache[e] for row in rows]
                ref = next((s for s in states if s is not None), arrays[e])
                if ref is None:
                    continue
                zero = mx.zeros((1,) + ref.shape[1:], ref.dtype)  # a row that has no such array yet
                parts = ([arrays[e]] if arrays[e] is not None else
                         [mx.zeros((self.rows,) + ref.shape[1:], ref.dtype)] if self.rows else [])
                arrays[e] = mx.concatenate(parts + [zero if s is None else s for s in states])
        self.rows += len(rows)
        mx.eval([a for layer in self._arrays for a in layer if a is not None])

    def extract(self, i: int) -> list[ArraysCache]:
        out = []
        for arrays in self._arrays:
            c = ArraysCache(len(arrays))
            c.cache = [mx.contiguous(a[i: i + 1]) + 0 if a is not None else None for a in arrays]
            out.append(c)
        mx.eval([a for c in out for a in c.cache if a is not None])
        return out

    def release(self, holes: list[int], movers: list[int], live: int) -> None:
        """The rows ``movers`` move into ``holes``; ``live`` rows remain (``RaggedKV.release``'s order). Each mover's
        state is copied into its hole in place and the arrays are cut to the live rows (a view): a leave moves one
        row's state, not every row's (a gather of the live rows copied all of them, ~0.8 GB at 16 Qwen3.5-9B rows,
        and held both copies at once)."""
        if not live:
            for arrays in self._arrays:
                arrays[:] = [None] * len(arrays)
            self.rows = 0
            return
        pairs = list(zip(holes, movers))
        present = [(arrays, e) for arrays in self._arrays for e, a in enumerate(arrays) if a is not None]
        if pairs:
            # the movers' rows in buffers of their own, evaluated first: the writes below then find each state
            # array unshared and update it in place (as RaggedKV.release does). Only queued, the copies would still
            # hold the arrays' buffers when the writes are encoded, and each write would copy its whole array
            moved = [[mx.contiguous(arrays[e][mv: mv + 1]) + 0 for _, mv in pairs] for arrays, e in present]
            mx.eval([c for row in moved for c in row])
            for (arrays, e), copies in zip(present, moved):
                a = arrays[e]
                for (h, _), c in zip(pairs, copies):
                    a[h: h + 1] = c
        for arrays, e in present:
            arrays[e] = arrays[e][:live]
        self.rows = live
        mx.eval([arrays[e] for arrays, e in present])


class _StateLayer:
    """One recurrent layer's view over the live rows, with what mlx-lm's recurrent layers use of an ArraysCache."""

    lengths = None  # every row feeds the same number of tokens: nothing is padded
    left_padding = None

    def __init__(self, owner: RaggedStates, index: int):
        self._owner, self._index = owner, index

    def __getitem__(self, e: int):
        return self._owner._arrays[self._index][e]

    def __setitem__(self, e: int, value: mx.array) -> None:
        self._owner._arrays[self._index][e] = value  # the step's new state of every live row

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, n: int):
        return None

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self):
        return [a for a in self._owner._arrays[self._index]]


class HybridRagged:
    """Attention layers in a ``RaggedKV``, recurrent layers in ``RaggedStates``, in the model's layer order."""

    def __init__(self, kinds: list[bool], kv: RaggedKV, states: RaggedStates):
        self._kinds = kinds  # per layer: True for a recurrent state
        self._kv, self._states = kv, states
        kv_layers, state_layers = iter(kv.layers), iter(states.layers)
        self.layers = [next(state_layers) if s else next(kv_layers) for s in kinds]

    @classmethod
    def from_rows(cls, rows: list[list]) -> "HybridRagged":
        kinds = [is_state(c) for c in rows[0]]
        kv = RaggedKV([window_of(c) for c in rows[0] if not is_state(c)])
        states = RaggedStates([len(c.cache) for c in rows[0] if is_state(c)])
        out = cls(kinds, kv, states)
        out.extend(rows)
        return out

    @property
    def lengths(self) -> list[int]:
        return self._kv.lengths

    @property
    def nbytes(self) -> int:
        return self._kv.nbytes + self._states.nbytes

    def __len__(self) -> int:
        return len(self._kv)

    def _split(self, row: list) -> tuple[list, list]:
        if [is_state(c) for c in row] != self._kinds:
            raise TypeError("a row's layers are not the batch's: another model's caches")
        return [c for c in row if not is_state(c)], [c for c in row if is_state(c)]

    def extend(self, rows: list[list]) -> None:
        parts = [self._split(r) for r in rows]
        if not all(holds_kv(kv) for kv, _ in parts):
            raise TypeError("a hybrid row's attention layers must be plain KVCache layers")
        self._kv.extend([kv for kv, _ in parts])
        self._states.extend([s for _, s in parts])

    def reserve(self, width: int) -> None:
        if width != 1:
            raise ValueError("a hybrid batch feeds one token per row: recurrent state cannot take positions back")
        self._kv.reserve(width)

    def commit(self, kept: list[int]) -> None:
        if any(k != 1 for k in kept):
            raise ValueError("every hybrid row keeps the one token it fed")
        self._kv.commit(kept)

    def extract(self, i: int) -> list:
        kv, states = iter(self._kv.extract(i)), iter(self._states.extract(i))
        return [next(states) if s else next(kv) for s in self._kinds]

    def release(self, gone: list[int]) -> list[int]:
        dead = set(gone)
        keep = [i for i in range(len(self._kv)) if i not in dead]
        holes = sorted(i for i in dead if i < len(keep))
        movers = [i for i in keep if i >= len(keep)]
        self._states.release(holes, movers, len(keep))
        return self._kv.release(gone)
