"""Where a ragged batch keeps its rows' caches: one declared interface, ``RaggedStore``, over two layouts.

    RaggedKV       every layer a plain KVCache: rows left-aligned in slots of preallocated KV (ragged_kv.py)
    HybridRagged   a hybrid model's attention layers in a RaggedKV, its recurrent layers' states in slots beside
                   them, in the model's layer order (ragged_states.py)

``store_for(rows)`` picks the layout for a batch's first rows; the ragged batch (ragged.py) then uses only the verbs
below, so a third layout (sliding windows) plugs in here. Only the lane thread touches a store.
"""

from __future__ import annotations

from typing import Any, Protocol

from server.engine.batch.ragged_kv import RaggedKV
from server.engine.batch.ragged_states import HybridRagged, is_state

__all__ = ["RaggedStore", "store_for"]


class RaggedStore(Protocol):
    """The rows' caches of a ragged batch, each row in a slot of its own (rows 0..n-1 are the live ones)."""

    @property
    def layers(self) -> list[Any]:
        """What the model's forward takes as its cache: one view per layer over every live row."""
        ...

    @property
    def lengths(self) -> list[int]:
        """Positions each live row's attention layers hold."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers, free slots included (what the memory budget counts)."""
        ...

    def __len__(self) -> int: ...

    def extend(self, rows: list[list]) -> None:
        """These rows (each its own per-layer caches, consumed) take free slots."""
        ...

    def reserve(self, width: int) -> None:
        """Before a forward of ``width`` tokens per row: room for them."""
        ...

    def commit(self, kept: list[int]) -> None:
        """After a forward: row i keeps the first ``kept[i]`` positions it wrote."""
        ...

    def extract(self, i: int) -> list:
        """Row i's own per-layer caches (copies, over what it covers)."""
        ...

    def release(self, gone: list[int]) -> list[int]:
        """Free these rows' slots (the last rows fill the holes); the new row order, as old indices."""
        ...


def store_for(rows: list[list]) -> RaggedStore:
    """A store of these rows: ``HybridRagged`` when their layers include recurrent state, else ``RaggedKV``."""
    if any(is_state(c) for c in rows[0]):
        return HybridRagged.from_rows(rows)
    return RaggedKV.from_rows(rows)
