"""The ``mlx`` batch kind: mlx-lm's ``GenerationBatch`` (continuous batching), wrapped in the ``Batch`` protocol.

mlx-lm does the work: its ``_merge_caches`` (models.mlx_compat) turns a sequence's own per-layer caches into batch
caches (``BatchKVCache`` / ``BatchRotatingKVCache`` / ``ArraysCache``, left-padded), ``GenerationBatch`` runs one
forward for all rows per step with per-row samplers and logits processors (pipelined: the step that returns token k
has already fed k and started computing k+1), ``extend`` merges a new row in, ``extract_cache(i)`` / ``filter`` take
a finished row out. The kind for caches the ragged layout cannot hold (sliding windows, recurrent state) and for
Metal.

What this wrapper adds, and why:
- rows are keyed by our sequences, not uids; stopping is ours (stop strings, cancellation, max_tokens live in
  ``server.lane.sequence.Sequence``), so rows are given an unreachable max_tokens and no stop sequences, and leave
  through ``remove``;
- a row's logits rules are ``LogitsRules.processors()`` (server.engine.batch.rules: the same arithmetic as the other
  batches'), its sampler its own (None: greedy);
- ``remove(seqs)`` returns each row's own single-sequence caches and exactly the tokens they cover
  (``GenerationBatch.tokens[i]``), ready for the prefix cache's ``put``.

Only the lane thread touches a batch.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.sample_utils import greedy_sampler

from models.attention.shared_prefix import flatten
from models.mlx_compat import merge_caches
from server.engine.batch.protocol import Covered, Emitted, Row

_NO_LIMIT = 1 << 62


def can_batch(caches: list) -> bool:
    """True when every layer's cache class can join a batch (mlx-lm's ``merge``; QuantizedKVCache cannot)."""
    return all(hasattr(type(c), "merge") for c in caches)


class MlxBatch:
    kind: ClassVar[str] = "mlx"

    def __init__(self, model, clear_cache: bool = True):
        self.model = model
        self.clear_cache = clear_cache  # give freed batch arrays back to the device after a row leaves (GPU)
        self._gen = GenerationBatch.empty(model, greedy_sampler)
        self._rows: list = []  # sequences, in the batch's row order
        self.steps = 0
        self.row_steps = 0  # sum of batch sizes over steps (mean batch size = row_steps / steps)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, seq) -> bool:
        return any(s is seq for s in self._rows)

    @property
    def sequences(self) -> list:
        return list(self._rows)

    @property
    def paying(self) -> bool:
        return True

    def kv_nbytes(self) -> int:
        """Bytes of the batch's KV (``BatchKVCache`` left-pads every row to the longest and grows in steps)."""
        return sum(_cache_nbytes(c) for c in (self._gen.prompt_cache or []))

    def accepts(self, row: Row) -> bool:
        """Rows that do not speculate, whose every layer's cache class merges into mlx-lm's batch caches."""
        return row.draft is None and can_batch(row.caches)

    def add(self, rows: Sequence[Row]) -> None:
        """These rows join at once: one GenerationBatch for all of them (one first step and one merge into the
        batch, not one per sequence). A hit's ``SharedPrefixKVCache`` layers are made plain first (mlx-lm merges
        plain caches)."""
        if not rows:
            return
        for row in rows:
            if not self.accepts(row):
                raise ValueError(f"an mlx batch cannot hold this row ({_describe(row)})")
        group = GenerationBatch(
            self.model, [id(r.seq) for r in rows], mx.array([r.history[-1] for r in rows]),
            merge_caches([flatten(r.caches) for r in rows]), [list(r.history[:-1]) for r in rows],
            [r.sampler for r in rows], greedy_sampler,
            [tuple(r.rules.processors()) for r in rows], [StopSequences() for _ in rows],
            [_NO_LIMIT] * len(rows),
        )
        self._gen.extend(group)
        self._rows.extend(r.seq for r in rows)

    def step(self) -> list[Emitted]:
        """One decode step for every row, in row order."""
        if not self._rows:
            return []
        responses = self._gen.next()
        self.steps += 1
        self.row_steps += len(self._rows)
        return [Emitted(seq, r.token, r.logprobs) for seq, r in zip(self._rows, responses)]

    def remove(self, seqs: Sequence, kept: Optional[Sequence[int]] = None) -> list[Covered]:
        """Take these rows out, in the order given (``kept`` changes nothing: a row makes one token per step, and a
        stop ends it before the next)."""
        index = {id(s): i for i, s in enumerate(self._rows)}
        out = []
        for seq in seqs:
            i = index[id(seq)]
            caches = self._gen.extract_cache(i)
            out.append(Covered(list(self._gen.tokens[i]), caches))
        gone = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self._rows) if id(s) not in gone]
        if out:
            mx.eval([c.state for cov in out for c in cov.caches])
        self._gen.filter(keep)
        self._rows = [self._rows[i] for i in keep]
        if self.clear_cache:  # the old batch arrays: give them back rather than grow MLX's buffer cache
            mx.clear_cache()
        return out


def _cache_nbytes(cache) -> int:
    """One layer's bytes; 0 for a cache class without its own ``nbytes`` (mlx-lm's base class raises
    NotImplementedError there): the budget then counts the rows' needs alone, never a failed tick."""
    try:
        return int(cache.nbytes)
    except (NotImplementedError, AttributeError):
        return 0


def _describe(row: Row) -> str:
    if row.draft is not None:
        return "it speculates"
    return "its caches do not merge: " + ", ".join(sorted({type(c).__name__ for c in row.caches}))
