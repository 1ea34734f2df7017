"""The decode batch: mlx-lm's ``GenerationBatch`` (continuous batching), wrapped for the lane.

mlx-lm does the work: ``_merge_caches`` turns a sequence's own per-layer caches into batch caches
(``BatchKVCache`` / ``BatchRotatingKVCache``, left-padded), ``GenerationBatch`` runs one forward for all rows per
step with per-row samplers and logits processors (pipelined: the step that returns token k has already fed k and
started computing k+1), ``extend`` merges a new row in, ``extract_cache(i)`` / ``filter`` take a finished row out.

What this wrapper adds, and why:
- rows are keyed by our sequences, not uids; stopping is ours (stop strings, cancellation, max_tokens live in
  ``server.lane.sequence.Sequence``), so rows are given an unreachable max_tokens and no stop sequences, and leave
  through ``remove``;
- ``add(seq, caches, history)``: the caches cover ``history[:-1]`` and ``history[-1]`` is the next input (the last
  prompt token for a fresh sequence, the last generated token for one that migrates from solo decoding);
- ``remove(seq)`` returns ``(tokens, caches)``: the row's own single-sequence caches and exactly the tokens they
  cover (``GenerationBatch.tokens[i]``), ready for the prefix cache's ``put``.

``BatchGroups`` keeps one batch per group (the base model's, and one per LoRA adapter in use: rows of one forward
share a model); an adapter's batch goes once its last row leaves.

Only the lane thread touches a batch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, StopSequences, _merge_caches
from mlx_lm.sample_utils import greedy_sampler

from models.shared_prefix import flatten

_NO_LIMIT = 1 << 62


def can_batch(caches: list) -> bool:
    """True when every layer's cache class can join a batch (mlx-lm's ``merge``; QuantizedKVCache cannot)."""
    return all(hasattr(type(c), "merge") for c in caches)


class DecodeBatch:
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
    def kv_nbytes(self) -> int:
        """Bytes of the batch's KV (``BatchKVCache`` left-pads every row to the longest and grows in steps)."""
        return sum(_cache_nbytes(c) for c in (self._gen.prompt_cache or []))

    def add(self, seq, caches: list, history: list, sampler=None, processors: Optional[list] = None, **_) -> None:
        """Join ``seq``; ``caches`` (its own, consumed) cover ``history[:-1]``; ``sampler`` None means greedy (other
        keywords are for other batch kinds)."""
        self.add_many([(seq, caches, history, {"sampler": sampler, "processors": processors})])

    def add_many(self, rows: list) -> None:
        """Join several sequences at once: ``[(seq, caches, history, {"sampler", "processors"}), ...]``. One
        GenerationBatch for all of them: one first step and one merge into the batch, not one per sequence. A hit's
        ``SharedPrefixKVCache`` layers are made plain first (mlx-lm merges plain caches)."""
        if not rows:
            return
        group = GenerationBatch(
            self.model, [id(seq) for seq, *_ in rows], mx.array([h[-1] for _, _, h, _ in rows]),
            _merge_caches([flatten(c) for _, c, _, _ in rows]), [list(h[:-1]) for _, _, h, _ in rows],
            [o.get("sampler") for *_, o in rows], greedy_sampler,
            [tuple(o.get("processors") or ()) for *_, o in rows], [StopSequences() for _ in rows],
            [_NO_LIMIT] * len(rows),
        )
        self._gen.extend(group)
        self._rows.extend(seq for seq, *_ in rows)

    def step(self) -> list:
        """One decode step for every row: ``[(seq, token, logprobs), ...]`` in row order."""
        if not self._rows:
            return []
        responses = self._gen.next()
        self.steps += 1
        self.row_steps += len(self._rows)
        return [(seq, r.token, r.logprobs) for seq, r in zip(self._rows, responses)]

    def remove(self, seqs: list) -> list:
        """Take these rows out; returns ``[(tokens, caches), ...]`` in the order given."""
        index = {id(s): i for i, s in enumerate(self._rows)}
        out = []
        for seq in seqs:
            i = index[id(seq)]
            caches = self._gen.extract_cache(i)
            out.append((list(self._gen.tokens[i]), caches))
        gone = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self._rows) if id(s) not in gone]
        if out:
            mx.eval([c.state for _, caches in out for c in caches])
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


class BatchGroups:
    """The decode batches by group (None: the base model). ``make(model, group)`` builds an empty batch for a
    model (a ``server.engine.spec_batch.SpecBatch`` for a speculating group)."""

    def __init__(self, make: Callable[[Any, Any], Any]):
        self._make = make
        self._batches: dict = {}

    def size(self) -> int:
        """Rows in all batches."""
        return sum(len(b) for b in list(self._batches.values()))

    def kv_nbytes(self) -> int:
        """Bytes all batches' KV buffers hold (a batch kind that does not say counts 0)."""
        return sum(int(getattr(b, "kv_nbytes", 0)) for b in list(self._batches.values()))

    def rows(self, group) -> int:
        batch = self._batches.get(group)
        return len(batch) if batch is not None else 0

    def join(self, group, model, rows: list) -> None:
        """``rows`` (see ``DecodeBatch.add_many``) join the group's batch, made now if the group has none."""
        batch = self._batches.get(group)
        if batch is None:
            batch = self._batches[group] = self._make(model, group)
        batch.add_many(rows)

    def step(self, group) -> list:
        batch = self._batches.get(group)
        return batch.step() if batch is not None else []

    def get(self, group):
        """The group's batch, or None."""
        return self._batches.get(group)

    def remove(self, group, seqs: list) -> list:
        """Take these rows out of the group's batch: ``[(tokens, caches), ...]``; an empty adapter batch goes."""
        batch = self._batches[group]
        out = batch.remove(seqs)
        if group is not None and not len(batch):
            del self._batches[group]  # an adapter group with no rows left: its batch arrays go
        return out

    def reset(self, group) -> None:
        """Forget a group's batch (its step raised; its rows were failed)."""
        self._batches.pop(group, None)
