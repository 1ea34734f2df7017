"""A model's thinnest prefix of layers that still holds every kind of layer it has: what a kernel warmer computes.

A kernel warmer (server.startup.warmers) compiles, in a process of its own, the CUDA kernels the server's first
requests will use, while the server reads its weights. Which kernels a forward compiles depends on the kinds of
layers it runs (plain or sliding-window attention, a gated delta-net, a Mamba-2 mixer, dense or expert MLPs), their
shapes and dtypes, never on how many layers of each there are. So the warmer loads only the first ``k`` layers, ``k``
the shortest prefix that holds one layer of every kind the whole model has: one layer of Llama-3-8B, 4 of
Qwen3.5-9B (three gated delta-nets, then full attention), 2 of gpt-oss-20b (a sliding window, then full attention).

A layer's kind (``layer_signature``): its modules' classes, their scalar attributes (``is_sliding``, ``sliding_window``,
... but not the layer's own index) and its parameters' shapes and dtypes; and, for every per-layer list in the config
(``layer_types``, Nemotron-H's ``hybrid_override_pattern``), the value at that layer, because some models keep a
layer's kind only there (gpt-oss's sliding layers are built like its full ones). ``thin_config`` returns the config
overrides (``num_hidden_layers`` and those lists cut to ``k``) or None where the thin model would not hold every kind
(it builds both models, lazily: nothing is computed); ``load_thin`` loads it with mlx-lm, reading only the kept
layers' weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

__all__ = ["layer_signature", "thin_config", "load_thin"]

_SCALARS = (bool, int, float, str, type(None))
# attributes that number a layer (gemma3's ``layer_idx``, lfm2's): not part of its kind
_INDEX = re.compile(r"(^|_)(idx|index|id|number|num)$|^layer$")


def _layers(model) -> Optional[list]:
    for owner in (model, getattr(model, "model", None), getattr(model, "language_model", None),
                  getattr(getattr(model, "language_model", None), "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, list) and layers:
            return layers
    return None


def layer_signature(layer) -> tuple:
    """What makes a layer compute with other kernels than another: its modules' classes and scalar attributes (its
    index left out) and its parameters' shapes and dtypes."""
    from mlx.utils import tree_flatten

    modules = []
    for name, module in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                             if not k.startswith("_") and isinstance(v, _SCALARS) and not _INDEX.search(k)))
        modules.append((name, type(module).__name__, attrs))
    flat: Any = tree_flatten(layer.parameters())
    params = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in flat))
    return tuple(sorted(modules)), params


def _per_layer_lists(config: dict, n: int) -> dict[str, Any]:
    """The config's values that say something per layer: lists and strings of exactly ``n`` items."""
    return {k: v for k, v in config.items()
            if k != "model_type" and isinstance(v, (list, str)) and len(v) == n and n > 1}


def _kinds(model, per_layer: dict[str, Any]) -> Optional[list[tuple]]:
    layers = _layers(model)
    if layers is None:
        return None
    return [(layer_signature(layer), tuple(str(v[i]) for v in per_layer.values())) for i, layer in enumerate(layers)]


def thin_config(config: dict, get_classes=None) -> Optional[dict]:
    """The overrides that make ``config``'s model its shortest prefix of layers holding every kind of layer
    (``num_hidden_layers`` and the per-layer lists cut; inside ``text_config`` where the layers are counted there, as
    in Qwen3.5's checkpoints), ``{}`` when that is the whole model, or None when it cannot be said (no
    ``num_hidden_layers``, no layer list to read, or the thin model's kinds differ from the whole one's).
    ``get_classes``: mlx-lm's ``_get_classes`` (the default) or a test's."""
    import mlx.core as mx

    if get_classes is None:
        from mlx_lm.utils import _get_classes as get_classes
    nested = not isinstance(config.get("num_hidden_layers"), int) and isinstance(config.get("text_config"), dict)
    layered = config["text_config"] if nested else config
    n = layered.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        return None

    def kinds_of(whole: dict, layers_config: dict, count: int) -> Optional[list[tuple]]:
        try:
            model_class, args_class = get_classes(config=whole)
            with mx.stream(mx.cpu):  # the random initial weights stay lazy: nothing is computed, nothing allocated
                return _kinds(model_class(args_class.from_dict(whole)), _per_layer_lists(layers_config, count))
        except Exception:
            return None

    kinds = kinds_of(config, layered, n)
    if kinds is None or len(kinds) != n:
        return None
    wanted = set(kinds)
    seen: set = set()
    k = 0
    while seen != wanted:
        seen.add(kinds[k])
        k += 1
    if k == n:
        return {}
    cut: dict[str, Any] = {"num_hidden_layers": k}
    cut.update({key: value[:k] for key, value in _per_layer_lists(layered, n).items()})
    overrides = {"text_config": {**layered, **cut}} if nested else cut
    thin = {**config, **overrides}
    thin_kinds = kinds_of(thin, thin["text_config"] if nested else thin, k)
    # the per-layer lists were cut with the layers: compare the modules' kinds alone
    if thin_kinds is None or {s for s, _ in thin_kinds} != {s for s, _ in kinds}:
        return None
    return overrides


def load_thin(model_dir: Path, dtype: str, overrides: dict):
    """The model of ``model_dir`` with ``overrides`` (``thin_config``'s) applied, its kept layers' weights read from
    the checkpoint, cast to ``dtype`` and evaluated, and mlx-lane's attention paths and kernels installed as
    ``load_model`` installs them. Returns ``(model, config)``."""
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from models.loading.load import install_paths
    from models.runtime import evaluate_all_arrays

    model, config = mlx_lm_load_model(Path(model_dir), lazy=True, strict=False, model_config=dict(overrides))
    model.set_dtype(getattr(mx, dtype))
    evaluate_all_arrays(model)
    install_paths(model)
    return model, config
