"""Speculative decoding as the lane sees it: which requests speculate, how caches split, what is counted.

``Speculation`` wraps a ``spec.DraftProvider`` built once at start-up. For a request it decides whether to
speculate, from its model's facts alone (models.facts.ModelFacts: its caches can take a rejected draft back; a draft
model drafts only for the base model, whose vocabulary it shares) and the request (``num_draft_tokens: 0`` turns it
off); it splits a cache hit into the target's and the draft's layers (the draft's identity joins the namespace when
the draft keeps KV of its own: ``cache.prefix.namespace``), and opens the per-request ``DraftSource``.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from models.facts import DraftHeads, ModelFacts
from spec import SpecStats, speculative_decode
from spec.adaptive import DraftPolicy

__all__ = ["Speculation", "SpecPlan", "SpecTotals", "speculative_decode"]


@dataclass
class SpecPlan:
    """One request's speculative setup; ``source`` is None when it decodes plainly."""

    source: Any = None  # spec.source.DraftSource
    num_draft_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    policy: Optional[DraftPolicy] = None  # the draft-length policy of its batch rows (kept across batch joins)


class Speculation:
    def __init__(self, provider, *, num_draft_tokens: int, kind: str):
        self.provider = provider
        self.kind = kind
        self.num_draft_tokens = num_draft_tokens

    @property
    def draft_heads(self) -> Optional[DraftHeads]:
        """The base model's own MTP heads when they draft (--draft-kind mtp), else None."""
        return getattr(self.provider, "facts", None)

    @property
    def drafts_under_adapters(self) -> bool:
        """May a request under a LoRA adapter speculate? Not with MTP heads: they read the hidden states of the base
        model's forward (its tapped final norm), which an adapter's model does not run."""
        return self.provider.kind != "mtp"

    def supports(self, facts: ModelFacts) -> bool:
        """May requests on a model of these facts speculate? Its caches must take back a rejected draft (recurrent
        layers beside untrimmable ones cannot; sliding windows can, also once wrapped: spec.rewind); a draft model
        drafts only for the base model, MTP heads only for the model they were loaded with (n-gram drafting for every
        model)."""
        if self.provider.kind == "mtp":
            return facts.rewinds and facts.draft_heads is not None
        return facts.rewinds and (self.provider.identity is None or facts.draft_model)

    def wanted(self, requested: Optional[int], facts: ModelFacts) -> int:
        """Draft length cap for a request on a model of these facts (0 = decode plainly)."""
        if not self.supports(facts) or requested == 0:
            return 0
        return self.num_draft_tokens if requested is None else min(requested, self.num_draft_tokens)

    def split(self, caches: Optional[list], facts: ModelFacts) -> tuple[Optional[list], Optional[list]]:
        """(target caches, draft caches) of a cache-hit entry of a model of these facts; draft part None when
        absent."""
        if caches is None:
            return None, None
        if self.provider.identity is None:  # n-gram: entries hold the target's layers only (of whichever model)
            return caches, None
        n = facts.layers
        return caches[:n], (caches[n:] if len(caches) > n else None)

    def open(self, draft_caches: Optional[list], covered: Sequence[int], n: int) -> SpecPlan:
        # a draft that keeps KV of its own starts from the entry's draft layers, or from nothing (the two-model
        # draft prefills the prefix; MTP heads, which need the target's hidden states, start at the hit: blind)
        source = self.provider.open(draft_caches, covered if draft_caches is not None or self.provider.kind == "mtp"
                                    else ())
        plan = SpecPlan(source=source, num_draft_tokens=n)
        plan.stats.blind = int(bool(getattr(source, "blind", False)))
        return plan

    def policy(self, n: int, facts: Optional[ModelFacts] = None):
        """A request's draft-length policy. MTP heads over recurrent state pause rather than stop (they keep hearing
        the target and cannot catch up later: spec.mtp)."""
        if self.provider.kind == "mtp":
            return self.provider.policy(n, recurrent=facts is not None and facts.caches.recurrent)
        return self.provider.policy(n)


class SpecTotals:
    """Server-wide speculative counters for /stats and /metrics (thread-safe)."""

    def __init__(self, kind: Optional[str] = None, max_draft: int = 0, heads: Optional[DraftHeads] = None):
        self._lock = threading.Lock()
        self.kind = kind
        self.max_draft = max_draft
        self.heads = heads  # the checkpoint's own MTP heads (--draft-kind mtp)
        self.requests = 0
        self.total = SpecStats()
        # verify steps of speculating batches (server.engine.batch.speculating): steps, rows over them, tokens
        self.batch = dict(steps=0, row_steps=0, drafted=0, accepted=0, emitted=0, handed_to_plain=0)
        self.plain_cannot_rewind = 0  # requests that asked to speculate on a model whose caches cannot rewind
        # requests that speculated alone (their model's caches cannot speculate in a batch) and joined their plain
        # batch, drafting no more, when others arrived (server.engine.decode.Decoder.join)
        self.solo_joined_batch = 0

    def add(self, stats: SpecStats) -> None:
        with self._lock:
            self.requests += 1
            self.total += stats

    def on_batch_step(self, rows: int, drafted: int, accepted: int, emitted: int) -> None:
        with self._lock:
            b = self.batch
            b["steps"] += 1
            b["row_steps"] += rows
            b["drafted"] += drafted
            b["accepted"] += accepted
            b["emitted"] += emitted

    def on_cannot_rewind(self) -> None:
        """A request decoded plainly: its model's caches cannot take back a rejected draft (recurrent state)."""
        with self._lock:
            self.plain_cannot_rewind += 1

    def on_dissolved(self, rows: int) -> None:
        """Rows of a speculating batch whose drafts did not pay went on in the plain batch."""
        with self._lock:
            self.batch["handed_to_plain"] += rows

    def on_yielded(self, rows: int) -> None:
        """Requests that speculated alone joined their plain batch, drafting no more, when company came."""
        with self._lock:
            self.solo_joined_batch += rows

    def as_dict(self) -> dict:
        with self._lock:
            d = self.total.as_dict()
            d.update({"enabled": self.kind is not None, "kind": self.kind, "num_draft_tokens": self.max_draft,
                      "requests": self.requests,
                      "plain_cannot_rewind": self.plain_cannot_rewind + d.get("cannot_rewind", 0),
                      "solo_joined_batch": self.solo_joined_batch,
                      "heads": asdict(self.heads) if self.heads is not None else None})
            b: dict[str, Any] = dict(self.batch)
            b["mean_rows"] = round(b["row_steps"] / b["steps"], 3) if b["steps"] else None
            b["acceptance_rate"] = round(b["accepted"] / b["drafted"], 4) if b["drafted"] else None
            b["tokens_per_row_step"] = round(b["emitted"] / b["row_steps"], 3) if b["row_steps"] else None
            d["in_batch"] = b
            return d
