"""Which model computes a request: a ``Target``, resolved once at the door and carried to its last token.

A request's ``model`` name selects one of the server's models (the base model, or an on-demand one of
``--model NAME=PATH`` / ``--models-dir``), possibly with one of its LoRA adapters on top. The door resolves the name
once (server.http.target), into a ``Target``: the model's ``Slot`` (never None: the base model is a slot like any
other), the adapter (None: the model's own weights), the pool lease that keeps an on-demand model loaded while the
request runs, and the counters the request's end is added to. The request, its sequence and the engine read
everything model-specific from it: the tokenizer that renders and counts its prompt, the cache namespace, the KV
price the memory budget charges, the weights that compute it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from models.facts import ModelFacts
from models.loading.adapters import Adapter

__all__ = ["Slot", "Lease", "Counters", "Target"]


class Slot(Protocol):
    """A loaded model as the server computes with it: what the doors, the lane and the engine read of it
    (server.engine.slot.ModelSlot is the implementation)."""

    name: str  # what requests call it (and responses echo)
    base: bool  # the server's base model: adapters and the draft model apply to it
    namespace: str  # its cache namespace (its fingerprint, KV scheme included)
    tokenizer: Any
    vocab_size: int
    context_length: int
    kv_price: Any  # server.lane.budget.KVPrice: what its caches cost the memory budget (None: not measured yet)
    vision: Any  # models.loading.vision.VisionTower of a model that takes images (None: text only)
    sampling_defaults: Any  # models.loading.generation_defaults.SamplingDefaults: what its generation_config declares
    facts: ModelFacts  # what its caches and architecture allow, measured once at load (models.facts)
    model: Any  # its weights' forward: model(tokens, cache=caches) -> logits (None once released)
    eos: frozenset[int]  # its end-of-sequence ids
    kv_bits: Optional[int]  # --kv-bits: its KV cache is quantized

    def new_caches(self) -> list[Any]:
        """Fresh per-layer caches for one sequence (quantized when ``kv_bits``)."""
        ...

    def detokenizer(self, keep_leading_space: bool = False) -> Any:
        """A fresh streaming detokenizer."""
        ...

    def decode_one(self, token: int) -> str: ...


class Lease(Protocol):
    """A hold on an on-demand model (server.pool.pool.Lease)."""

    def release(self) -> None: ...


class Counters(Protocol):
    """Per-model or per-adapter request counters (server.catalog.AdapterCounters)."""

    def add(self, finished) -> None: ...


@dataclass(frozen=True, eq=False)
class Target:
    slot: Slot
    adapter: Optional[Adapter] = None  # LoRA layers over the slot's weights (None: the model's own)
    lease: Optional[Lease] = None  # an on-demand model's hold, released when the request ends
    counters: Optional[Counters] = None  # where the request's end is counted beside the server's totals

    @property
    def name(self) -> str:
        """The model name responses echo: the adapter's, else the model's."""
        return self.adapter.name if self.adapter is not None else self.slot.name

    @property
    def tokenizer(self):
        return self.slot.tokenizer

    @property
    def adapter_identity(self) -> Optional[str]:
        return self.adapter.identity if self.adapter is not None else None

    def release(self) -> None:
        """Give an on-demand model back (idempotent; nothing for the base model)."""
        if self.lease is not None:
            self.lease.release()
