"""What a loaded model's caches and architecture allow: ``ModelFacts``, one frozen record per model.

Everything that decides how a model's requests are computed reads this record and nothing else: the decode batch's
kind (server.engine.batch.choose reads ``caches``), whether a request may speculate and where a draft's layers start
in a cache entry (server.engine.speculation: ``rewinds``, ``draft_model``, ``layers``), batched prefill
(``prefills_together``), the checkpoints of layers that cannot be cut back (``checkpointed_layers``), the lane's
window rule (``window``), /stats (``attention``, ``recurrent_path``) and whether its own heads draft
(``draft_heads``). It is measured once, from the model's fresh caches, when the model is loaded
(``server.engine.slot.measure``); a new source of facts (a GPU kernel, MTP heads, an mlx-vlm model class) adds its
field here and its measurement there, so no reader guesses from class names.

Pure data: nothing here imports mlx or mlx-lm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["CacheFacts", "DraftHeads", "ModelFacts"]


@dataclass(frozen=True)
class CacheFacts:
    """A model's cache layers, as the choice of a decode batch's kind needs them (server.engine.batch.choose)."""

    plain_kv: bool  # every layer a plain KVCache, not quantized
    mergeable: bool  # every layer's class merges into mlx-lm's batch caches
    recurrent: bool = False  # some layers hold recurrent state (linear attention, SSM): nothing can be taken back
    windowed: bool = False  # some layers are sliding windows (RotatingKVCache): once wrapped, nothing can be taken back
    ragged: Optional[bool] = None  # the ragged layout holds its layers (None: plain_kv)

    @property
    def holds_ragged(self) -> bool:
        return self.plain_kv if self.ragged is None else self.ragged


@dataclass(frozen=True)
class DraftHeads:
    """The checkpoint's own draft heads, when the server drafts with them (``--draft-kind mtp``: models.mtp)."""

    kind: str  # "mtp": multi-token prediction, fed the target's last hidden state
    family: str  # the module shape that computes them (models.mtp.heads: qwen, nemotron, deepseek)
    model_type: str  # the checkpoint's architecture
    layers: int  # their attention layers: each keeps a KV cache, stored after the target's in a cache entry
    params: int  # their own parameters (the target's embedding and output head are shared)


@dataclass(frozen=True)
class ModelFacts:
    """One model's facts (see the module docstring)."""

    caches: CacheFacts
    layers: int  # cache layers of one sequence (an entry of a two-model speculating request holds the draft's after)
    checkpointed_layers: tuple[int, ...] = ()  # layers whose state the prefix cache keeps at checkpoints
    window: Optional[int] = None  # its smallest sliding window (None: no sliding-window layer)
    rewinds: bool = True  # every layer can take back what a verify forward wrote (spec.rewind): it may speculate
    draft_model: bool = False  # the server's draft model may draft for it (the base model: it shares the vocabulary)
    prefills_together: bool = False  # its prompt chunks may share one batched forward with other sequences'
    reads_shared_prefix: bool = False  # a RAM hit's caches read the cached entry where it lies (shared_prefix)
    attention: str = "mlx"  # which attention its layers run: cpu, cuda or mlx (/stats batch.attention)
    recurrent_path: str = "none"  # what its recurrent layers run: cuda, chunked, mlx or none (/stats batch.recurrent)
    expert_path: str = "none"  # how its MoE layers read their experts: none, mlx, sort>=N, dense<=D,sort>=N
    draft_heads: Optional[DraftHeads] = None  # its own MTP heads, loaded for --draft-kind mtp (None: none loaded)

    @property
    def needs_checkpoints(self) -> bool:
        """Its caches cannot be cut back (recurrent state, sliding windows): keep their state at checkpoints."""
        return bool(self.checkpointed_layers)
