"""Load one process's shard of a model with mlx-lm's `sharded_load`, after checking that the model splits.

mlx-lm splits a model two ways (`mlx_lm.utils.sharded_load`):
  * tensor-parallel (`model.shard(group)`): every layer's attention heads and MLP columns are divided among the
    ranks; each rank holds 1/N of every layer and of the KV cache (its KV heads). The head counts must divide by N
    (SmolLM2-135M's 9 query / 3 KV heads split over 3 processes, not over 2).
  * pipeline-parallel (`model.model.pipeline(group)`): each rank holds a contiguous run of layers and their KV.
    Only architectures with mlx-lm's PipelineMixin (qwen2, qwen3-moe, deepseek-v3, ...) support it, and the
    checkpoint needs a `model.safetensors.index.json` (each rank reads only its layers' files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.errors import ModelLoadError


def check_splits(config: dict, size: int, mode: str, model_dir: Path) -> None:
    """ModelLoadError, saying what to do, when `config`'s model cannot be split `size` ways in `mode`."""
    text = config.get("text_config") or {}
    if mode == "tensor":
        for key in ("num_attention_heads", "num_key_value_heads"):
            n = config.get(key, text.get(key))
            if isinstance(n, int) and n % size:
                raise ModelLoadError(
                    f"{model_dir.name} has {n} {key.replace('num_', '').replace('_', ' ')}, which do not split over "
                    f"{size} processes (tensor-parallel divides every layer's heads among them): launch a process "
                    f"count that divides the head counts, or shard by layers with --pipeline")
    elif not (model_dir / "model.safetensors.index.json").is_file():
        raise ModelLoadError(
            f"{model_dir} has no model.safetensors.index.json, which pipeline sharding needs (each process loads "
            "only its layers' files): re-save the model with mlx_lm.convert, or use tensor-parallel (no --pipeline)")


def load_shard(model_dir: Path, group: Any) -> tuple[Any, Any, dict]:
    """(model, tokenizer, config) of this rank's shard. `group`: server.engine.distributed.Group (its mode and size)."""
    from mlx_lm.utils import sharded_load

    config = json.loads((Path(model_dir) / "config.json").read_text())
    check_splits(config, group.size, group.mode, Path(model_dir))
    tensor = group.group if group.mode == "tensor" else None
    pipeline = group.group if group.mode == "pipeline" else None
    try:
        return sharded_load(str(model_dir), pipeline_group=pipeline, tensor_group=tensor, return_config=True)
    except ValueError as e:
        if "does not support" in str(e):
            raise ModelLoadError(f"mlx-lm cannot shard {model_dir.name} this way ({e}); "
                                 f"{'drop --pipeline' if pipeline is not None else 'try --pipeline'}") from e
        raise
