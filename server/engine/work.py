"""The engine's state of one sequence, from ``admit`` to ``end``: the record the engine owns and the lane never reads.

The lane's ``Sequence`` (server.lane.sequence) is the request and its output; everything the model work needs beside
it lives here: which weights compute it, its caches while no batch holds them, its sampler (built once: a seeded
sampler's key chain goes on across moves between batches), its logits rules, its speculative setup, where it decodes
now (a group's batch, or a solo batch of its own), and what it has stored. The engine keys these records by the
sequence object (``server.engine.engine.Engine``); only the lane thread touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from server.engine.batch.protocol import LogitsRules
from server.engine.batch.solo import SoloBatch
from server.engine.speculation import SpecPlan
from server.lane.target import Slot

__all__ = ["SeqWork"]


@dataclass(eq=False)
class SeqWork:
    slot: Slot  # the model it runs on (its facts: models.facts.ModelFacts)
    model: Any  # what computes it: the slot's weights, or its adapter's model over them
    caches: Optional[list]  # its own caches while prefilling; None while a batch (or its solo batch) holds them
    sampler: Callable  # mlx-lm's sampler for its settings (greedy: ``greedy_sampler`` itself)
    greedy: bool  # temperature 0: the batches may sample it with every other greedy row in one call
    rules: LogitsRules  # bias, penalties, grammar
    spec: Optional[SpecPlan]  # its draft source and counters when it speculates
    covered: int = 0  # prompt tokens its caches cover (during prefill)
    cached: int = 0  # prompt tokens the prefix cache gave it
    prefill_cost_s: float = 0.0  # its share of the prefill forwards it was in (the SSD tier's rate, base model)
    stored: int = 0  # prompt tokens covered by what it has put in the prefix cache
    batched: bool = False  # a row of its group's batch
    solo: Optional[SoloBatch] = None  # decoding on its own: a solo batch (server.engine.batch.choose.make_solo)
    embeds: Optional[tuple] = None  # (start, stop, array) of a prompt with images: its input embeddings from
    # ``start`` (the first prefill chunk that holds image tokens computes them, server.engine.prefill)
    snapshots: dict = field(default_factory=dict)  # position -> {layer index: that layer's state there}: the
    # checkpoints of the layers that cannot be cut back (cache.checkpoints), taken while prefilling

    @property
    def row_sampler(self) -> Optional[Callable]:
        """The sampler a batch row carries: None for greedy (rows share one argmax)."""
        return None if self.greedy else self.sampler
