"""The one shape of every decode mechanism: a ``Batch`` of ``Row``s that steps and hands back what each row made.

A decode mechanism holds rows (a request each, with its own caches) and advances all of them by one forward per
``step``. mlx-lane has four kinds, each a ``Batch``, built only by ``server.engine.batch.choose.make``:

    solo         one row, mlx-lm's pipelined ``generate_step`` or the speculative walk (solo.py)
    mlx          mlx-lm's ``GenerationBatch``: left-padded batch caches of any class that merges (mlx.py)
    ragged       rows left-aligned in slots of preallocated KV, joining and leaving without copies (ragged.py)
    speculating  rows that each draft on their own, verified in one forward (speculating.py)

A ``Row`` is everything a batch needs of one request, frozen at the join: its key (``seq``: the lane's sequence,
handed back in ``Emitted`` and asked for in ``remove``; a batch never reads it), its caches (consumed: the batch owns
them until ``remove``), its history (the caches cover ``history[:-1]``; ``history[-1]`` is the row's next input), how
many of those tokens the request generated already and the most it may (``max_tokens``), its logits rules, its
sampler and, when it speculates, its draft. From the join on a batch keeps its own account of the row
(``RowState``), as vLLM's model runner keeps its per-request state and never reads the scheduler's request.

``step()`` returns ``Emitted`` records in row order (a speculating row may bring several, in sequence order);
``remove(seqs, kept)`` is told how many tokens each request kept of what it generated (the lane drops what a step
made past a stop) and returns one ``Covered`` per sequence: its own single-sequence caches and exactly the tokens
they cover, ready for the prefix cache's ``put`` or for a join elsewhere. ``paying`` False: the batch no longer pays
for its kind (a speculating batch whose drafts are not accepted often enough): the engine moves its rows to their
group's plain batch.

Which kind a group of rows gets is decided in one place, ``server.engine.batch.choose``. A protocol test checks every
kind against this shape (tests/unit/test_batch_protocol.py). Only the lane thread touches a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable
from typing import Sequence as Seq

from server.engine.batch.rules import LogitsRules
from server.lane.seam import Covered, Emitted, GroupKey
from spec.adaptive import DraftPolicy
from spec.source import DraftSource
from spec.stats import SpecStats

__all__ = ["Batch", "Row", "RowDraft", "RowList", "RowState", "GroupKey", "Emitted", "Covered", "LogitsRules",
           "NO_LIMIT"]

NO_LIMIT = 1 << 62  # a row without a max_tokens of its own (the lane stops it)


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
    """One request as a batch takes it in (see the module docstring). ``sampler`` None: greedy."""

    seq: object  # the lane's key of the row: handed back in Emitted, asked for in remove, never read
    caches: list
    history: Seq[int]
    rules: LogitsRules = LogitsRules()
    sampler: Optional[Callable] = None
    draft: Optional[RowDraft] = None
    max_tokens: Optional[int] = None  # the most tokens its request generates in all (None: no limit of the batch's)
    generated: int = 0  # of ``history``, the tokens its request generated (its tail); the rest is the prompt

    def state(self) -> "RowState":
        """The batch's own account of the row, from its join on."""
        return RowState(self.seq, NO_LIMIT if self.max_tokens is None else self.max_tokens, self.generated,
                        len(self.history) - self.generated)


@dataclass(eq=False)
class RowState:
    """A batch's own account of one row (vLLM's ``CachedRequestState``): its key, its request's limit, and the tokens
    generated for it as the engine counts them (at the join what its history holds, then every token a step
    emitted). While it decodes that is what the lane kept: a row that stopped inside a step leaves before the next."""

    key: object
    max_tokens: int
    generated: int
    prompt: int  # its prompt's length (the history at the join, less what was generated)

    def left(self) -> int:
        """Tokens it may still make."""
        return self.max_tokens - self.generated

    def covered(self, kept: Optional[int]) -> int:
        """Tokens of prompt and output its request kept in all: ``kept`` generated (the lane's count), or, None,
        every one the batch emitted."""
        return self.prompt + (self.generated if kept is None else kept)


class RowList:
    """What a batch that keeps its rows as records with a ``seq`` (in ``self._rows``, in row order) says of them."""

    _rows: list

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, seq: object) -> bool:
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

    @property
    def paying(self) -> bool:
        """Does it still pay for its kind? Only a speculating batch may say no (server.engine.batch.speculating)."""
        ...

    def accepts(self, row: Row) -> bool:
        """Can this row join (its caches, its draft, room)? ``add`` of a row it does not accept raises."""
        ...

    def add(self, rows: Seq[Row]) -> None:
        """These rows join in one step."""
        ...

    def step(self) -> list[Emitted]:
        """One forward for every row."""
        ...

    def remove(self, seqs: Seq[Any], kept: Optional[Seq[int]] = None) -> list[Covered]:
        """Take these rows out: one ``Covered`` each, in the order given. ``kept[i]``: the tokens ``seqs[i]``'s
        request kept of what it generated, in all (None: every one the batch emitted for it)."""
        ...

    def kv_nbytes(self) -> int:
        """Bytes its KV buffers hold now (free slots and padding included): what the memory budget counts."""
        ...
