"""A request's ``model`` name, resolved once into the ``Target`` that computes it (server.lane.target).

``resolve(state, requested) -> Resolution`` decides what the name means, without loading anything; names resolve in
this order: a LoRA adapter of the base model, the base model's own names (its id, the NAME it was given and
``default``, whatever the base model is), an on-demand model's (server.pool), then
the ``--model-alias`` patterns in the order given (``PATTERN=NAME`` onto the on-demand model NAME, a bare ``PATTERN``
onto the base model). A name the server does not answer to is a 404 (``ModelNotFound``, shaped by each API); an
absent name is the base model. ``await acquire(state, resolution)`` makes it a ``Target``: for an on-demand model,
with a lease (loading it first when it is not loaded; a model that can never fit is a 400, a failed load a 500).
The pipeline (server.http.pipeline) and every endpoint that renders or counts a prompt go through here, so a prompt
is always rendered with its own model's tokenizer and template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from server.catalog import is_served
from server.errors import APIError, InvalidRequest, ModelNotFound
from server.lane.target import Target

__all__ = ["Resolution", "resolve", "acquire", "resolve_target"]


@dataclass(frozen=True)
class Resolution:
    adapter: Optional[object] = None  # models.loading.adapters.Adapter over the base model
    on_demand: Optional[str] = None  # the name of an on-demand model (server.pool)

    def must_load(self, state) -> bool:
        """An on-demand model that is not loaded now (a stream keeps its client alive while it loads)."""
        if self.on_demand is None:
            return False
        entry = state.models.entry(self.on_demand)
        return entry is not None and entry.slot is None


def resolve(state, requested: Optional[str]) -> Resolution:
    """What ``requested`` names (see the module docstring); raises ``ModelNotFound``."""
    if not requested:
        return Resolution()
    adapter = state.adapters.get(requested)
    if adapter is not None:
        return Resolution(adapter=adapter)
    if requested in state.model_names or requested == "default":  # "default" names the base model, whatever it is
        return Resolution()
    pool = state.models
    if pool is not None and pool.knows(requested):
        return Resolution(on_demand=requested)
    from fnmatch import fnmatchcase

    for pattern, name in state.alias_rules:  # the first matching --model-alias wins
        if fnmatchcase(requested, pattern):
            return Resolution(on_demand=name)  # None: the base model's alias
    if is_served(state.model_names, state.model_aliases, requested):
        return Resolution()
    hint = " (or start the server with --model-alias PATTERN)" if not state.model_aliases else ""
    served = sorted(state.model_names) + (pool.names() if pool is not None else []) + state.adapters.names()
    raise ModelNotFound(f"The model '{requested}' does not exist on this server. Served: {', '.join(served)}{hint}",
                        param="model")


async def acquire(state, resolution: Resolution) -> Target:
    """The ``Target`` of a resolution; release it (``Target.release``) when the request ends."""
    if resolution.adapter is not None:
        adapter = resolution.adapter
        return Target(state.engine.base, adapter, counters=state.adapters.counters(adapter.name))
    if resolution.on_demand is None:
        return Target(state.engine.base)
    from server.pool.pool import ModelLoadFailed, ModelWontFit

    try:
        lease = await state.models.acquire(resolution.on_demand)
    except ModelWontFit as exc:
        raise InvalidRequest(str(exc), param="model", code="model_too_large") from None
    except ModelLoadFailed as exc:
        raise APIError(f"{exc}. Check the model's files (see the server log), then retry.",
                       code="model_load_failed") from None
    return Target(lease.slot, None, lease, counters=lease.entry.counters)


async def resolve_target(state, requested: Optional[str]) -> Target:
    """``acquire(state, resolve(state, requested))``."""
    return await acquire(state, resolve(state, requested))
