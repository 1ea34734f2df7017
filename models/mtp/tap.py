"""The target's hidden state at every position a forward computes: what a multi-token-prediction head reads.

An MTP head predicts the token after next from the target's last hidden state: the final norm's output, what the
target's own output head reads (as mlx-vlm's and vLLM's MTP drafters take it). mlx-lm's models return logits only, so
``tap(model)`` swaps the class of the model's final norm (that one instance) for a subclass that keeps its latest
output: every forward of the model, whoever runs it (a prompt chunk, a verify step, a plain decode step), leaves its
hidden states in ``HiddenTap.last``, a lazy (B, L, hidden) array. A reader takes them right after the forward it
issued: the lane runs one forward at a time, on one thread. Nothing else changes: the norm keeps its parameters and
their names (adapters, quantization and fingerprints see the same model), the forward its output.

    t = tap(model)        # idempotent: the same HiddenTap for the same model
    model(x, cache=c)
    h = t.last            # (B, L, hidden) of that forward
    untap(model)          # the norm's own class again (tests)
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

__all__ = ["HiddenTap", "tap", "untap", "final_norm"]

_TAPS = "_mlx_lane_tap"


class HiddenTap:
    """Holds the latest forward's hidden states (``last``; None before the first forward)."""

    def __init__(self) -> None:
        self.last: Optional[mx.array] = None


def final_norm(model) -> Any:
    """The norm whose output the model's head reads: ``model.model.norm`` (llama-like, DeepSeek, GLM, Qwen3.5 through
    its ``model`` property) or ``model.backbone.norm_f`` (Nemotron-H). ValueError when there is none."""
    for inner_name, norm_name in (("model", "norm"), ("backbone", "norm_f")):
        inner = getattr(model, inner_name, None)
        norm = getattr(inner, norm_name, None) if inner is not None else None
        if norm is not None and callable(norm):
            return norm
    raise ValueError(f"{type(model).__name__} has no final norm (model.norm, backbone.norm_f) to read hidden states "
                     "from")


def _tapped_class(cls: type) -> type:
    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        t = getattr(self, _TAPS)
        t.last = out
        return out

    return type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__, "mlx_lane_untapped": cls})


def tap(model) -> HiddenTap:
    """The model's tap, installed on its final norm the first time (see the module docstring)."""
    norm = final_norm(model)
    existing = getattr(norm, _TAPS, None)
    if isinstance(existing, HiddenTap):
        return existing
    t = HiddenTap()
    norm.__class__ = _tapped_class(type(norm))
    object.__setattr__(norm, _TAPS, t)
    return t


def untap(model) -> None:
    """Give the final norm its own class back (nothing is recorded after)."""
    norm = final_norm(model)
    original = getattr(type(norm), "mlx_lane_untapped", None)
    if original is not None:
        norm.__class__ = original
        object.__delattr__(norm, _TAPS)
