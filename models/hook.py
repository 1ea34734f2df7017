"""Where mlx-lane puts its own function into an mlx-lm model in place of one that the model's modules import by name:
``scaled_dot_product_attention`` from ``mlx_lm.models.base`` (models.attention), ``gated_delta_update`` from
``mlx_lm.models.gated_delta`` and ``ssm_update`` from ``mlx_lm.models.ssm`` (models.kernels).

``switch(model, wrap, name=..., original=...)`` replaces ``name`` in every module of the model's layers that imported
``original`` with ``wrap(original)``: a function of the same signature that keeps the original as
``mlx_lane_original`` and hands it what it does not take itself. A module that defines its own function of that name
is left alone. The switch is per module, so it holds for every model of that architecture in the process.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["switch", "switched_functions", "attention_path", "restore"]

ATTENTION = "scaled_dot_product_attention"


def _modules(model) -> list:
    """The Python modules that define the classes of ``model``'s layers (none for an object that is not an
    ``mlx.nn.Module``, e.g. a wrapper around one: then nothing is switched, and ``routes`` says no)."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return []
    return [m for m in (sys.modules.get(name) for name in {type(m).__module__ for m in modules()}) if m is not None]


def _base_attention():
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


def switch(model, wrap: Callable, name: str = ATTENTION, original: Callable | None = None) -> int:
    """Route ``model``'s calls of ``name`` through ``wrap(original)`` (``original``: mlx-lm's function of that name,
    by default its attention); returns how many model modules use it (switched now or by an earlier load of a model
    of the same architecture)."""
    original = _base_attention() if original is None else original
    switched = 0
    for module in _modules(model):
        fn = getattr(module, name, None)
        if fn is original:
            setattr(module, name, wrap(fn))
            switched += 1
        elif getattr(fn, "mlx_lane_original", None) is not None:
            switched += 1  # already switched
    return switched


def restore(model, name: str) -> list[tuple[object, Callable]]:
    """Put mlx-lm's own ``name`` back in ``model``'s switched modules; returns (module, ours) pairs to switch back
    with ``setattr`` (the oracle of a test computes with mlx-lm's functions this way)."""
    undone = []
    for module in _modules(model):
        fn = getattr(module, name, None)
        original = getattr(fn, "mlx_lane_original", None)
        if original is not None:
            setattr(module, name, original)
            undone.append((module, fn))
    return undone


def switched_functions(model, name: str = ATTENTION) -> list:
    """The functions of that ``name`` that ``model``'s modules call (those that import one by name)."""
    return [fn for fn in (getattr(m, name, None) for m in _modules(model)) if fn is not None]


def attention_path(model) -> str:
    """Which attention ``model``'s layers run: ``cpu`` (models.attention.cpu), ``cuda`` (models.attention.gpu's fused
    kernel), ``mlx`` (MLX's own, everywhere else), or ``mixed`` when its modules differ (for /stats)."""
    paths = {getattr(fn, "mlx_lane_path", "mlx") for fn in switched_functions(model)}
    if not paths:
        return "mlx"
    return paths.pop() if len(paths) == 1 else "mixed"
