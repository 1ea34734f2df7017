"""The one shape of every decode mechanism: a ``Batch`` of ``Row``s that steps and hands back what each row made.

A decode mechanism holds rows (a sequence each, with its own caches) and advances all of them by one forward per
``step``. mlx-lane has five kinds, each a ``Batch``:

    solo         one row, mlx-lm's pipelined ``generate_step`` or the speculative walk (server.engine.batch.solo)
    mlx          mlx-lm's ``GenerationBatch``: left-padded batch caches of any class that merges (mlx.py)
    ragged       rows left-aligned in slots of preallocated KV, joining and leaving without copies (ragged.py)
    speculating  rows that each draft on their own, verified in one forward (speculating.py)

A ``Row`` is everything a batch needs of one sequence, frozen at the join: its caches (consumed: the batch owns them
until ``remove``), its history (the caches cover ``history[:-1]``; ``history[-1]`` is the row's next input), its
logits rules, its sampler and, when it speculates, its draft. ``step()`` returns ``Emitted`` records in row order (a
speculating row may bring several, in sequence order); ``remove(seqs)`` returns one ``Covered`` per sequence: its own
single-sequence caches and exactly the tokens they cover, ready for the prefix cache's ``put`` or for a join elsewhere.

Which kind a group of rows gets is decided in one place, ``server.engine.batch.choose``. A protocol test checks every
kind against this shape (tests/unit/test_batch_protocol.py). Only the lane thread touches a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable
from typing import Sequence as Seq

from server.engine.batch.rules import LogitsRules
from server.lane.seam import Covered, Emitted, GroupKey
from server.lane.sequence import Sequence
from spec.adaptive import DraftPolicy
from spec.source import DraftSource
from spec.stats import SpecStats

__all__ = ["Batch", "Row", "RowDraft", "RowList", "GroupKey", "Emitted", "Covered", "LogitsRules"]


@dataclass(frozen=True)
class RowDraft:
    """A speculating row's drafting: its source (spec.source.DraftSource), its draft-length policy
    (spec.adaptive), the most tokens it drafts per step, and the counters it reports."""

    source: DraftSource
    policy: DraftPolicy
    max_draft: int
    stats: Optional[SpecStats]


@dataclass(frozen=True, eq=False)
class Row:
    """One sequence as a batch holds it (see the module docstring). ``sampler`` None: greedy."""

    seq: Sequence  # the key of the row, and what it has generated (a batch reads its prompt and generated tokens)
    caches: list
    history: Seq[int]
    rules: LogitsRules = LogitsRules()
    sampler: Optional[Callable] = None
    draft: Optional[RowDraft] = None


class RowList:
    """What a batch that keeps its rows as records with a ``seq`` (in ``self._rows``, in row order) says of them."""

    _rows: list

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, seq) -> bool:
        return any(r.seq is seq for r in self._rows)

    @property
    def sequences(self) -> list:
        return [r.seq for r in self._rows]


@runtime_checkable
class Batch(Protocol):
    """Every decode mechanism (see the module docstring)."""

    kind: ClassVar[str]
    steps: int  # steps run
    row_steps: int  # rows over those steps (mean batch size = row_steps / steps)

    def __len__(self) -> int: ...

    @property
    def sequences(self) -> list: ...

    def accepts(self, row: Row) -> bool:
        """Can this row join (its caches, its draft, room)? ``add`` of a row it does not accept raises."""
        ...

    def add(self, rows: Seq[Row]) -> None:
        """These rows join in one step."""
        ...

    def step(self) -> list[Emitted]:
        """One forward for every row."""
        ...

    def remove(self, seqs: Seq[Any]) -> list[Covered]:
        """Take these rows out: one ``Covered`` each, in the order given."""
        ...

    def kv_nbytes(self) -> int:
        """Bytes its KV buffers hold now (free slots and padding included): what the memory budget counts."""
        ...
