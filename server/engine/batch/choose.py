"""Which batch kind a group of rows gets: the one place a kind is picked, from declared facts.

    plain rows       ``ragged`` where the layout is wanted (``--batch-layout``; ``auto``: the CPU, and CUDA where the
                     fused attention kernel reads each row's own columns) and every layer is a plain ``KVCache`` or a
                     hybrid's recurrent state (server.engine.batch.ragged_states); else ``mlx`` (mlx-lm's
                     GenerationBatch) where the caches merge (sliding windows); else none: each sequence decodes
                     ``solo`` (quantized KV cannot merge)
    speculating      ``speculating`` (drafts verified together) where every layer is a plain ``KVCache`` and
                     ``--no-spec-batch`` is not given; else ``solo``

Measured on the H200 (BENCHMARKS.md, "A decode batch's attention in one kernel"): with the kernel the agent workload
ran in 0.57-0.62x of the wall of mlx-lm's layout; with MLX's masked attention the ragged batch was 0.84-0.91x as fast
as mlx-lm's layout at 8-16 rows ("The decode batch's layout on the H200"): so ``auto`` is mlx on a GPU without the
kernel (Metal, or ``--attention mlx``).

Recurrent state cannot take a token back. Its solo decoder feeds each token when the next is asked for, so a row
joins its ragged batch from there exactly (``joins``); the ragged batch pipelines on a GPU like any other (the lane's
Python for 16 Qwen3.5-9B rows runs while the device computes), so a row leaves it only when it finishes: a pipelined
batch has fed every token it returned, which a state cannot give back (``moves``).

``place(layout, caches, drafting, company)`` is a request's kind and whether it drafts (a model whose caches a
speculating batch cannot hold speculates only alone). ``make(kind, model, layout, stream, caches)`` builds an empty
batch of the kind: the one builder of batches, so no other module names a kind's class. Only the lane thread touches
a batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

from models.facts import CacheFacts
from server.engine.batch.mlx import MlxBatch
from server.engine.batch.protocol import Batch
from server.engine.batch.ragged import RaggedBatch
from server.engine.batch.solo import SoloBatch
from server.engine.batch.speculating import PlainStepClock, SpeculatingBatch, VerifyStep

__all__ = ["BatchKind", "CacheFacts", "Layout", "Placement", "choose", "joins", "make", "moves", "pipelined", "place",
           "solo_pipelined"]


class BatchKind(str, enum.Enum):
    SOLO = "solo"
    MLX = "mlx"
    RAGGED = "ragged"
    SPECULATING = "speculating"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Layout:
    """The server's settings and device, decided once at start (server.cli flags)."""

    batch_layout: str = "auto"  # --batch-layout: auto | ragged | mlx
    gpu: bool = False
    fused_attention: bool = False  # models.attention's CUDA kernel reads each ragged row's own columns
    spec_in_batch: bool = True  # not --no-spec-batch
    draft_batch: bool = True  # a speculating batch runs its draft model's forwards for all rows together

    def wants_ragged(self) -> bool:
        if self.batch_layout != "auto":
            return self.batch_layout == "ragged"
        return not self.gpu or self.fused_attention


def choose(layout: Layout, caches: CacheFacts, speculating: bool) -> BatchKind:
    """The batch kind of a group (see the module docstring); SOLO: its sequences decode on their own."""
    if speculating:
        return BatchKind.SPECULATING if caches.plain_kv and layout.spec_in_batch else BatchKind.SOLO
    if caches.holds_ragged and layout.wants_ragged():
        return BatchKind.RAGGED
    return BatchKind.MLX if caches.mergeable else BatchKind.SOLO


@dataclass(frozen=True)
class Placement:
    """Where a request decodes: its group's batch kind, and whether it drafts."""

    kind: BatchKind
    drafting: bool
    yields: bool = False  # it speculates alone for want of company: it joins its plain batch when that forms


def place(layout: Layout, caches: CacheFacts, drafting: bool, company: bool) -> Placement:
    """A request's kind (``choose``) and whether it drafts. A model whose caches a speculating batch cannot hold
    (recurrent state, sliding windows) speculates only on its own: a request that arrives with ``company`` (others
    running or waiting) decodes plainly instead, in its group's plain batch, since every speculating request of such
    a model decoding alone made 4 concurrent requests on a tiny qwen3.5 take 4x the wall of the plain batch. One that
    arrives alone speculates until company comes (``yields``): then it joins the plain batch for the same reason (on a
    GPU each of its steps costs about what the whole batch's step does, ``server.engine.decode.Decoder.join``),
    where its solo decoder can hand its caches over exactly (``joins``; it runs nothing ahead: ``solo_pipelined``)."""
    kind = choose(layout, caches, drafting)
    if drafting and kind == BatchKind.SOLO and layout.spec_in_batch:
        plain = choose(layout, caches, False)
        if company:
            return Placement(plain, False)
        yields = plain != BatchKind.SOLO and joins(plain, caches) and not solo_pipelined(layout, caches)
        return Placement(kind, drafting, yields)
    return Placement(kind, drafting)


def pipelined(layout: Layout, caches: CacheFacts) -> bool:
    """Does a batch run a forward ahead of the tokens it returned (the GPU's overlap)? On a GPU, every cache kind:
    a row over recurrent state then leaves only when it finishes (``moves``)."""
    return layout.gpu


def solo_pipelined(layout: Layout, caches: CacheFacts) -> bool:
    """Does a sequence decoding on its own run a forward ahead? Not over recurrent state (see ``moves``), nor over
    sliding windows: a wrapped window cannot take the token fed ahead back, so such a row could never join its
    group's batch when others arrive (on a GPU every gpt-oss agent, its prompt past the 128-token window, decoded by
    itself: 0.52-0.65x raw BatchGenerator's tokens/s). The overlap is worth little there: one gpt-oss-20b request
    alone on the H200 decoded at 59.1 tok/s ahead, 59.2 not (bench/gpu_window_solo.py, BENCHMARKS.md)."""
    return not caches.recurrent and not caches.windowed


def moves(kind: BatchKind, caches: CacheFacts, layout: Layout = Layout()) -> bool:
    """May a row leave its group's batch for decoding on its own? The move hands over caches that cover the row's
    history but its next input: caches that can take a token back always can; recurrent state only from a ragged
    batch that is not pipelined (a pipelined one, like mlx-lm's batch, has fed every token it returned)."""
    return not caches.recurrent or (kind == BatchKind.RAGGED and not pipelined(layout, caches))


def joins(kind: BatchKind, caches: CacheFacts) -> bool:
    """May a row join its group's batch from decoding on its own? Caches that can take a token back always can;
    recurrent state into the ragged batch, from a solo decoder that ran nothing ahead (``solo_pipelined``)."""
    return not caches.recurrent or kind == BatchKind.RAGGED


def make(kind: BatchKind, model: Any, layout: Layout, stream: Optional[Any] = None,
         caches: CacheFacts = CacheFacts(plain_kv=True, mergeable=True), *,
         plain_steps: Optional[PlainStepClock] = None,
         on_verify: Optional[Callable[[VerifyStep], None]] = None) -> Batch:
    """An empty batch of ``kind`` for ``model`` (whose caches are ``caches``). A speculating batch judges whether its
    drafts pay against ``plain_steps`` (the plain batches' measured steps) and reports each verify step to
    ``on_verify`` (/stats)."""
    if kind == BatchKind.SPECULATING:
        return SpeculatingBatch(model, draft_batch=layout.draft_batch, plain_steps=plain_steps, on_verify=on_verify)
    if kind == BatchKind.RAGGED:  # on a GPU the lane's Python runs during the forward
        return RaggedBatch(model, pipelined=pipelined(layout, caches))
    if kind == BatchKind.MLX:
        return MlxBatch(model, clear_cache=layout.gpu)
    return make_solo(model, layout, stream, caches)


def make_solo(model: Any, layout: Layout, stream: Optional[Any] = None,
              caches: CacheFacts = CacheFacts(plain_kv=True, mergeable=True)) -> SoloBatch:
    """``make(BatchKind.SOLO, ...)``, typed as what it is: a solo batch can also ``hand_over`` its row."""
    return SoloBatch(model, stream, pipelined=solo_pipelined(layout, caches), one_buffer=layout.gpu)
