"""Where mlx-lane puts its own attention into an mlx-lm model: the ``scaled_dot_product_attention`` each model module
imports by name from ``mlx_lm.models.base``.

``switch(model, wrap)`` replaces that name in every module of the model's layers with ``wrap(original)`` (a function
of the same signature that keeps the original as ``mlx_lane_original`` and hands it what it does not take itself).
The CPU path (``models.attention.cpu``) and the CUDA path (``models.attention.gpu``) use it; only one applies on a
given device. A module that defines its own attention function is left alone.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["switch", "switched_functions", "attention_path"]


def _modules(model) -> list:
    """The Python modules that define the classes of ``model``'s layers (none for an object that is not an
    ``mlx.nn.Module``, e.g. a wrapper around one: then nothing is switched, and ``routes`` says no)."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return []
    return [sys.modules.get(name) for name in {type(m).__module__ for m in modules()}]


def switch(model, wrap: Callable) -> int:
    """Route ``model``'s attention through ``wrap(original)``; returns how many model modules use it (modules
    switched now or by an earlier load of a model of the same architecture)."""
    from mlx_lm.models import base

    switched = 0
    for module in _modules(model):
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = wrap(fn)
            switched += 1
        elif getattr(fn, "mlx_lane_original", None) is not None:
            switched += 1  # already switched
    return switched


def switched_functions(model) -> list:
    """The attention functions ``model``'s modules call (those that import one by name)."""
    return [fn for fn in (getattr(m, "scaled_dot_product_attention", None) for m in _modules(model)) if fn is not None]


def attention_path(model) -> str:
    """Which attention ``model``'s layers run: ``cpu`` (models.attention.cpu), ``cuda`` (models.attention.gpu's fused
    kernel), ``mlx`` (MLX's own, everywhere else), or ``mixed`` when its modules differ (for /stats)."""
    paths = {getattr(fn, "mlx_lane_path", "mlx") for fn in switched_functions(model)}
    if not paths:
        return "mlx"
    return paths.pop() if len(paths) == 1 else "mixed"
