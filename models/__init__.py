"""Model loading for mlx-lane: specs -> ready mlx-lm models, GGUF conversion, the default model.

Public API (everything else is internal)::

    load_model(spec, dtype=None, *, progress=True) -> LoadedModel
    convert_gguf(path, outdir, *, progress=True) -> Path
    ensure_default_model(progress=True) -> Path;  list_models();  mlx_lane_home()
    ensure_blas(argv=None);  blas_info();  device_name();  default_dtype()
    ModelLoadError (ValueError)

The names are imported when first used (PEP 562), not with this package: ``models.runtime`` must run before mlx-lm
is imported (it re-executes the process with OpenBLAS preloaded and hides torch from transformers), and a process
that only converts or lists models never pays for mlx-lm's imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ModelLoadError": "models.errors",
    "LoadedModel": "models.loading.load",
    "load_model": "models.loading.load",
    "convert_gguf": "models.loading.gguf",
    "ensure_default_model": "models.loading.default",
    "list_models": "models.loading.default",
    "mlx_lane_home": "models.loading.default",
    "ensure_packaged": "models.loading.packaged",
    "PACKAGED_MODELS": "models.loading.packaged",
    "ensure_blas": "models.runtime",
    "blas_info": "models.runtime",
    "device_name": "models.runtime",
    "default_dtype": "models.runtime",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # once
    return value
