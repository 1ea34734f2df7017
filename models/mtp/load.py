"""A checkpoint's multi-token-prediction heads, loaded from its own safetensors: ``load_heads(path, model)``.

mlx-lm drops MTP weights when it loads a model (qwen3_5's and nemotron_h's ``sanitize`` filter ``mtp.*``,
deepseek_v3's and glm4_moe_lite's drop the layers past ``num_hidden_layers``) and when it converts one, so the heads
are read here, from the model directory's files, beside the target mlx-lm loaded:

    family        model types                          weights                      module (models.mtp.heads)
    qwen          qwen3_5, qwen3_5_moe, qwen3_next      ``mtp.*``                    mlx-vlm's Qwen3_5MTPDraftModel
    nemotron      nemotron_h                           ``mtp.*``                    mlx-vlm's NemotronHMTPDraftModel
    deepseek      deepseek_v3, glm4_moe_lite           ``model.layers.<N>.*``       DeepseekStyleMtp (mlx-lm layer)

For qwen and nemotron mlx-vlm's own splitter (``mlx_vlm.speculative.drafters.mtp_split``) selects, converts
(fp8, quantized, Hugging Face vs MLX layout) and loads the tensors; the deepseek family is read here and converted by
the target class's own ``sanitize`` (expert stacking, MLA's split ``kv_b_proj``, fp8). A checkpoint of another family,
or one that ships no MTP tensors (every mlx-lm conversion), is a ``ModelLoadError`` that says what to do.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from models.errors import ModelLoadError
from models.runtime import evaluate_all_arrays
from models.facts import DraftHeads
from models.mtp.heads import DEEPSEEK, NEMOTRON, QWEN, DeepseekStyleMtp, MtpHead, target_embed_and_head

__all__ = ["load_heads", "FAMILIES", "facts_of", "mtp_config", "checkpoint_tensors"]

FAMILIES: dict[str, str] = {"qwen3_5": QWEN, "qwen3_5_moe": QWEN, "qwen3_next": QWEN, "nemotron_h": NEMOTRON,
                            "deepseek_v3": DEEPSEEK, "glm4_moe_lite": DEEPSEEK}


def mtp_config(path: Path) -> dict:
    """The model directory's config.json."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"--draft-kind mtp: cannot read {path}/config.json ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"--draft-kind mtp: {path}/config.json is not a JSON object")
    return config


def load_heads(path: Path, model, dtype: str = "float32") -> MtpHead:
    """The MTP heads of the checkpoint at ``path`` (whose target mlx-lm loaded as ``model``), their weights in
    ``dtype``. ModelLoadError when the checkpoint has none this server can run (see the module docstring)."""
    path = Path(path)
    config = mtp_config(path)
    model_type = str((config.get("text_config") or {}).get("model_type") or config.get("model_type"))
    family = FAMILIES.get(model_type) or FAMILIES.get(str(config.get("model_type")))
    if family is None:
        raise ModelLoadError(
            f"--draft-kind mtp: {path.name} is a {model_type} model, and mlx-lane runs multi-token-prediction heads "
            f"only for {', '.join(sorted(FAMILIES))}; use --draft-kind ngram or --draft-model instead")
    head = _load_deepseek(path, config, model) if family == DEEPSEEK else _load_vlm(path, config, model, family)
    head.module.set_dtype(getattr(mx, dtype))
    evaluate_all_arrays(head.module)  # its RoPE frequencies too: the lane thread runs it
    return head


def facts_of(head: MtpHead, model_type: str) -> DraftHeads:
    """What the server records of the heads (models.facts.ModelFacts.draft_heads)."""
    return DraftHeads(kind="mtp", family=head.family, model_type=model_type, layers=head.layers, params=head.params)


def _no_tensors(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"--draft-kind mtp: {path} ships no multi-token-prediction weights ({what}); mlx-lm's conversion drops them. "
        "Serve the original checkpoint (its safetensors keep them) or one converted by mlx-vlm, or use "
        "--draft-kind ngram / --draft-model")


def _load_vlm(path: Path, config: dict, model, family: str) -> MtpHead:
    """qwen and nemotron: mlx-vlm's splitter loads its drafter class from the checkpoint's ``mtp.*`` tensors."""
    try:
        from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter
    except ImportError as exc:
        raise ModelLoadError(
            f"--draft-kind mtp: the {family} heads run on mlx-vlm's drafter classes, and mlx-vlm is not installed "
            f"({exc}); install the vision extra (pip install -e '.[vision]', or: pip install --no-deps "
            "mlx-vlm==0.7.10 && pip install Pillow requests)") from exc

    splitter = get_mtp_splitter(source_config=config)
    if splitter is None:
        raise _no_tensors(path, "mlx-vlm has no MTP splitter for its config")
    text_config = splitter.read_text_config(config)
    if next(iter(splitter.iter_selected(path, text_config)), None) is None:
        raise _no_tensors(path, "no mtp.* tensors")
    try:
        draft = splitter.load(path)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"--draft-kind mtp: mlx-vlm could not load the MTP heads of {path}: {exc}") from exc
    embed, head = target_embed_and_head(model)
    inner = getattr(model, "model", None) or getattr(model, "backbone", None)
    hidden = int(text_config.get("hidden_size") or embed.weight.shape[-1])
    layers = len(draft.make_cache())
    return MtpHead(family=family, module=draft, embed=embed, head=head, layers=layers, hidden_size=hidden,
                   embed_scale=float(getattr(inner, "embed_scale", 1.0)))


def _safetensor_keys(path: Path, prefix: str) -> dict[str, list[str]]:
    """{file: [keys under prefix]} from the index when there is one, else by opening every file."""
    index = path / "model.safetensors.index.json"
    out: dict[str, list[str]] = {}
    if index.exists():
        for key, file in json.loads(index.read_text()).get("weight_map", {}).items():
            if key.startswith(prefix):
                out.setdefault(str(path / file), []).append(key)
        return out
    for file in sorted(glob.glob(str(path / "*.safetensors"))):
        keys = [k for k in _tensors(file) if k.startswith(prefix)]
        if keys:
            out[file] = keys
    return out


def _tensors(file: str) -> dict[str, Any]:
    """A safetensors file's tensors, lazily (mlx maps them; only those used are read)."""
    loaded: Any = mx.load(file)
    return loaded


def _decoder_layer_class(model) -> type:
    module = sys.modules[type(model).__module__]
    names = [n for n in dir(module) if n.endswith("DecoderLayer")]
    if len(names) != 1:
        raise ModelLoadError(f"--draft-kind mtp: no single decoder layer class in {module.__name__} ({names})")
    return getattr(module, names[0])


def _load_deepseek(path: Path, config: dict, model) -> MtpHead:
    """DeepSeek-V3 / GLM-4.7-Flash: the layer past the target's last (``model.layers.<N>.*``), converted by the
    target class's ``sanitize`` as a one-layer model's layer 0, without its copies of the embedding and the head."""
    args: Any = model.args
    n = int(args.num_hidden_layers)
    prefix = f"model.layers.{n}."
    files = _safetensor_keys(path, prefix)
    if not files:
        raise _no_tensors(path, f"no {prefix}* tensors")
    raw: dict[str, mx.array] = {}
    for file, keys in files.items():
        tensors = _tensors(file)
        raw.update({"model.layers.0." + k[len(prefix):]: tensors[k] for k in keys})
    one = dataclasses.replace(args, num_hidden_layers=1)
    weights = type(model).sanitize(SimpleNamespace(args=one), raw)
    mapped: dict[str, mx.array] = {}
    for key, value in weights.items():
        rest = key[len("model.layers.0."):]
        if rest.startswith(("embed_tokens.", "shared_head.head.")):
            continue  # copies of the target's own: the target's are used
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            mapped[rest] = value
        elif rest.startswith("shared_head.norm."):
            mapped["norm." + rest[len("shared_head.norm."):]] = value
        else:
            mapped["block." + rest] = value
    eps = float(getattr(args, "rms_norm_eps", 1e-6))
    module = DeepseekStyleMtp(_decoder_layer_class(model)(args, n), int(args.hidden_size), eps)
    quantization = config.get("quantization")
    if quantization and any(k.endswith(".scales") for k in mapped):
        nn.quantize(module, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in mapped)
    try:
        module.load_weights(list(mapped.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"--draft-kind mtp: the MTP layer of {path} does not fit {type(model).__module__}'s "
                             f"decoder layer: {exc}") from exc
    embed, head = target_embed_and_head(model)
    return MtpHead(family=DEEPSEEK, module=module, embed=embed, head=head, layers=1,
                   hidden_size=int(args.hidden_size))


def checkpoint_tensors(head: MtpHead, model) -> dict[str, mx.array]:
    """The head's weights named as its family's checkpoints name them (what ``load_heads`` reads back): ``mtp.*``
    (qwen, nemotron: mlx-vlm's module names, an MLX-format file) or ``model.layers.<N>.*`` (deepseek, N the target's
    layer count: the block's own names, the final norm as ``shared_head.norm``). Unquantized heads only."""
    from mlx.utils import tree_flatten

    own = dict(tree_flatten(head.module.parameters()))
    if head.family != DEEPSEEK:
        return {f"mtp.{k}": v for k, v in own.items()}
    n = int(model.args.num_hidden_layers)
    out = {}
    for k, v in own.items():
        if k.startswith("block."):
            k = k[len("block."):]
        elif k.startswith("norm."):
            k = "shared_head." + k
        out[f"model.layers.{n}.{k}"] = v
    return out
