"""Model loading for mlx-lane: specs -> ready mlx-lm models, GGUF conversion, the default model.

Public API (everything else is internal)::

    load_model(spec, dtype=None, *, progress=True) -> LoadedModel
    convert_gguf(path, outdir, *, progress=True) -> Path
    ensure_default_model(progress=True) -> Path;  list_models();  mlx_lane_home()
    ensure_blas(argv=None);  blas_info();  device_name();  default_dtype()
    ModelLoadError (ValueError)
"""

from models.loading.default import ensure_default_model, list_models, mlx_lane_home
from models.errors import ModelLoadError
from models.loading.gguf import convert_gguf
from models.loading.load import LoadedModel, load_model
from models.loading.packaged import PACKAGED_MODELS, ensure_packaged
from models.runtime import blas_info, default_dtype, device_name, ensure_blas

__all__ = [
    "ModelLoadError",
    "LoadedModel",
    "load_model",
    "convert_gguf",
    "ensure_default_model",
    "ensure_packaged",
    "PACKAGED_MODELS",
    "list_models",
    "mlx_lane_home",
    "ensure_blas",
    "blas_info",
    "device_name",
    "default_dtype",
]
