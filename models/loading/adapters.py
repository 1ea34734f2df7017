"""LoRA adapters (the directories ``mlx_lm.lora`` writes) over a loaded base model.

``load_adapter(loaded, name, path) -> Adapter``: a second model object over the SAME base weight arrays (no copy:
mlx arrays are immutable and shared by reference), with mlx-lm's own LoRA layers (``mlx_lm.tuner.utils.
load_adapters``: ``linear_to_lora_layers`` + the adapter's weights) wrapped around the base layers. Serving an
adapter therefore costs its low-rank weights only. The adapter's ``identity`` is the sha256 of its config and
weights: the prefix cache namespaces entries by it (cache.prefix.namespace), so KV computed under one
adapter never seeds the base or another adapter, and a retrained adapter under the same name starts afresh.

Supported: ``fine_tune_type`` lora and dora (mlx-lm's ``LoRALinear`` / ``DoRALinear``). A "full" fine-tune is a
whole model: serve it with ``--model`` instead. Errors are ``ModelLoadError`` saying what to do.

Call from the thread that owns the model's MLX stream (the lane), or before the lane starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import ModelLoadError

__all__ = ["Adapter", "load_adapter", "adapter_identity", "ADAPTER_FILES"]

ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")
_ADAPTER_LEAVES = ("lora_a", "lora_b", "m")


@dataclass(frozen=True, eq=False)
class Adapter:
    """A served adapter: its model object shares every base weight with the base model."""

    name: str
    path: Path
    identity: str  # sha256 over adapter_config.json and adapters.safetensors
    model: Any  # mlx.nn.Module: the base model's structure with LoRA layers, in eval mode
    rank: int
    num_layers: int
    fine_tune_type: str


def adapter_identity(path: Path) -> str:
    """sha256 over the adapter's two files (config, then weights), each prefixed by its name."""
    h = hashlib.sha256()
    for fname in ADAPTER_FILES:
        h.update(fname.encode() + b"\0")
        with open(path / fname, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ModelLoadError(f"adapter path {path} is not a directory; give the directory mlx_lm.lora wrote "
                             "(--adapter-path), holding adapter_config.json and adapters.safetensors")
    missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    if missing:
        raise ModelLoadError(f"adapter directory {path} lacks {', '.join(missing)}; it must be what mlx_lm.lora "
                             "writes (adapter_config.json + adapters.safetensors)")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path / 'adapter_config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path / 'adapter_config.json'} is not a JSON object")
    return config


def load_adapter(loaded, name: str, path: str | Path) -> Adapter:
    """The adapter at ``path`` over ``loaded`` (a models.LoadedModel), under the served name ``name``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model as mlx_lm_load_model

    path = Path(path).expanduser().resolve()
    config = _read_config(path)
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise ModelLoadError(f"adapter {name!r} ({path}) is a {kind!r} fine-tune; only lora and dora adapters are "
                             "served over the base model (serve a full fine-tune with --model)")
    identity = adapter_identity(path)
    try:
        # the base model's structure, weights not read yet (lazy), then pointed at the base's own arrays
        model, _ = mlx_lm_load_model(Path(loaded.path), lazy=True)
        model.update(tree_unflatten(tree_flatten(loaded.model.parameters())))
        load_adapters(model, str(path))
    except (ValueError, KeyError, FileNotFoundError, OSError) as exc:
        raise ModelLoadError(f"adapter {name!r} ({path}) does not fit {loaded.model_id}: "
                             f"{str(exc).splitlines()[0][:300]}") from exc
    model.eval()  # LoRA dropout off
    dtype = getattr(mx, loaded.dtype)
    lora = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
            if k.rsplit(".", 1)[-1] in _ADAPTER_LEAVES]
    model.update(tree_unflatten(lora))
    mx.eval([v for _, v in lora])
    params = config.get("lora_parameters") or {}
    return Adapter(name=name, path=path, identity=identity, model=model, rank=int(params.get("rank", 0) or 0),
                   num_layers=int(config.get("num_layers", 0) or 0), fine_tune_type=kind)
