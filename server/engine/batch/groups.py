"""The decode batches by group: one ``Batch`` per ``GroupKey`` (rows of one forward share a model, an adapter, and
speculate or not), made on the first join by ``make(group)`` and dropped once its last row leaves (its arrays go).
Only the lane thread touches them."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from server.engine.batch.protocol import Batch, Covered, Emitted, GroupKey, Row

__all__ = ["BatchGroups"]


class BatchGroups:
    def __init__(self, make: Callable[[GroupKey], Batch]):
        self._make = make
        self._batches: dict[GroupKey, Batch] = {}

    def size(self) -> int:
        """Rows in all batches."""
        return sum(len(b) for b in list(self._batches.values()))

    def kv_nbytes(self) -> int:
        """Bytes all batches' KV buffers hold."""
        return sum(b.kv_nbytes() for b in list(self._batches.values()))

    def rows(self, group: GroupKey) -> int:
        batch = self._batches.get(group)
        return len(batch) if batch is not None else 0

    def get(self, group: GroupKey) -> Optional[Batch]:
        """The group's batch, or None."""
        return self._batches.get(group)

    def items(self) -> list[tuple[GroupKey, Batch]]:
        return list(self._batches.items())

    def join(self, group: GroupKey, rows: Sequence[Row]) -> None:
        """``rows`` join the group's batch, made now if the group has none."""
        batch = self._batches.get(group)
        if batch is None:
            batch = self._batches[group] = self._make(group)
        batch.add(rows)

    def step(self, group: GroupKey) -> list[Emitted]:
        batch = self._batches.get(group)
        return batch.step() if batch is not None else []

    def remove(self, group: GroupKey, seqs: Sequence, kept: Optional[Sequence[int]] = None) -> list[Covered]:
        """Take these rows out of the group's batch (``kept``: as ``Batch.remove``); a batch with no rows left goes."""
        batch = self._batches[group]
        out = batch.remove(seqs, kept)
        if not len(batch):
            del self._batches[group]
        return out

    def reset(self, group: GroupKey) -> None:
        """Forget a group's batch (its step raised; its rows were failed)."""
        self._batches.pop(group, None)
