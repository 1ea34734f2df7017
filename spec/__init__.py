"""Speculative decoding for mlx-lane: draft sources, the verify loop, the adaptive policy.

Public API::

    DraftProvider / DraftSource           spec.source (the protocol)
    TwoModelProvider(target, draft, identity=..., target_tokenizer=..., draft_tokenizer=...)
    TwoModelProvider.from_loaded(target: LoadedModel, draft: LoadedModel)
    NgramProvider(max_ngram=3, min_ngram=1)
    speculative_decode(model, caches, first_token_input, source, *, sampler, logits_processors,
                       max_tokens, num_draft_tokens, stream, policy, stats, pipelined)
        -> yields (token, logprobs, from_draft); HandOver thrown in at a yield leaves the last token unfed
    AdaptiveDraftLength, FixedDraftLength, BatchVerifyCost, break_even_rate
    SpecStats
    SpecError, DraftMismatch, UnsupportedDraft (ValueError)

Layering: imports mlx / mlx-lm (and may import `models`); never `server` or `cache`.
"""

from spec.adaptive import AdaptiveDraftLength, BatchVerifyCost, FixedDraftLength, break_even_rate
from spec.errors import DraftMismatch, SpecError, UnsupportedDraft
from spec.ngram import NgramProvider, NgramSource
from spec.source import DraftProvider, DraftSource
from spec.stats import SpecStats
from spec.two_model import TwoModelProvider, TwoModelSource
from spec.verify import HandOver, speculative_decode

__all__ = [
    "DraftProvider",
    "DraftSource",
    "TwoModelProvider",
    "TwoModelSource",
    "NgramProvider",
    "NgramSource",
    "speculative_decode",
    "HandOver",
    "AdaptiveDraftLength",
    "BatchVerifyCost",
    "FixedDraftLength",
    "break_even_rate",
    "SpecStats",
    "SpecError",
    "DraftMismatch",
    "UnsupportedDraft",
]
