"""Errors raised by the `spec` package.

Hierarchy::

    ValueError
     └── SpecError            anything that makes speculative decoding unusable as configured
          ├── DraftMismatch   the draft model does not speak the target's vocabulary / tokenizer
          └── UnsupportedDraft a model whose KV caches cannot be rewound (sliding window, SSM layers)

Both are raised at start-up (when a ``DraftProvider`` is built), never in the middle of a
request; the message says what differs and what the user can do about it. The CLI shows it
verbatim as a start-up failure.
"""

from __future__ import annotations

__all__ = ["SpecError", "DraftMismatch", "UnsupportedDraft"]


class SpecError(ValueError):
    """Speculative decoding cannot run with this configuration; the message says how to fix it."""


class DraftMismatch(SpecError):
    """The draft model's vocabulary size or tokenizer differs from the target's."""


class UnsupportedDraft(SpecError):
    """A model's caches cannot be trimmed, so rejected draft tokens could not be rolled back."""
