"""Which ``model`` names a request may ask for: the served names, plus ``--model-alias`` glob patterns.

Agent clients send names of their own (Claude Code: ``claude-sonnet-4-5`` and a small fast model; Codex:
whatever its profile says). ``--model-alias 'claude-*'`` maps every matching name onto the one served
model; any other unknown name is a 404 (``ModelNotFound``), which each API shapes as its own error.
A loaded LoRA adapter's name (``--adapter NAME=PATH``) selects that adapter; it wins over an alias pattern.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Optional

from server.errors import ModelNotFound

__all__ = ["is_served", "check_model"]


def is_served(names, aliases, requested: str) -> bool:
    """True when ``requested`` is a served name or matches an alias pattern (case-sensitive glob)."""
    return requested in names or any(fnmatchcase(requested, pattern) for pattern in aliases)


def check_model(state, requested: Optional[str]):
    """The adapter (models.adapters.Adapter) that ``requested`` names, or None for the base model. Raise
    ``ModelNotFound`` for a name the server does not answer to (an absent name means the base model)."""
    adapter = state.adapters.get(requested) if requested else None
    if adapter is not None:
        return adapter
    if requested and not is_served(state.model_names, state.model_aliases, requested):
        hint = " (or start the server with --model-alias PATTERN)" if not state.model_aliases else ""
        raise ModelNotFound(
            f"The model '{requested}' does not exist on this server. Served: "
            f"{', '.join(sorted(state.model_names) + state.adapters.names())}{hint}",
            param="model",
        )
    return None
