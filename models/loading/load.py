"""`load_model(spec)`: one entry point for every way a user names a model.

Spec resolution, first match wins:

1. "default"                         -> the packaged SmolLM2-135M-Instruct (models.loading.default)
2. an existing `*.gguf` file         -> converted once to <home>/models/gguf-<sha256[:16]>/
3. an existing directory             -> an mlx-lm model directory (config.json + *.safetensors)
4. a packaged model name, fetched    -> its converted directory (fetch with `mlx-lane models fetch`)
5. "owner/name"                      -> a Hugging Face repo (local HF cache, then the hub)
6. anything else                     -> ModelLoadError

Weights are cast to the serving dtype after loading: float32 on the CPU, bfloat16 on a GPU
unless asked otherwise (models.runtime.default_dtype).

Two sources of model classes (``source``: ``--model-source``): mlx-lm first; where it has no class for the
directory's ``model_type`` (the newest families: qwen4_exp, deepseek_v4, glm5_next, ...), mlx-vlm's language model
(models.loading.vlm_text), computed by the same engine. ``LoadedModel.source`` says which, as does the start-up line
and ``/v1/models``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.attention.cpu import install as install_cpu_attention
from models.attention.gpu import install as install_gpu_attention
from models.kernels import install as install_kernels
from models.mamba_lengths import install as install_mamba_lengths
from models.loading.default import DEFAULT_MODEL, ensure_default_model
from models.errors import ModelLoadError
from models.loading.fingerprint import fingerprint
from models.loading.generation_defaults import NO_DEFAULTS, SamplingDefaults, read_sampling_defaults
from models.loading.gguf import SOURCE_FILE, convert_gguf
from models.loading.hashing import file_sha256_cached
from models.loading.home import file_lock, mlx_lane_home
from models.loading.packaged import PACKAGED_MODELS, canonical_name, is_converted, packaged_paths
from models.loading.vision import is_vision_config, load_vision, vlm_vision
from models.loading.vlm_text import cast as cast_vlm
from models.loading.vlm_text import load_vlm_text
from models.loading.vlm_text import source as source_of
from models.runtime import default_dtype, evaluate_all_arrays

__all__ = ["LoadedModel", "load_model", "DTYPES", "resolve_gguf", "read_context_length", "install_paths"]

DTYPES = ("float32", "bfloat16", "float16")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
_FALLBACK_CONTEXT = 4096


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve. `fingerprint` namespaces its KV caches; see models.loading.fingerprint."""

    model: Any  # mlx.nn.Module (mlx-lm model), weights in `dtype`
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    model_id: str
    path: Path
    fingerprint: str
    dtype: str
    context_length: int
    architecture: str
    model_fingerprint: str = ""  # the whole model's fingerprint when `fingerprint` is one shard's, else ""
    vision: Any = None  # models.loading.vision.VisionTower of an image-text model (None: text only)
    sampling_defaults: SamplingDefaults = NO_DEFAULTS  # what its generation_config.json declares
    source: str = "mlx-lm"  # the library whose classes compute it: mlx-lm, or mlx-vlm (models.loading.vlm_text)


def _check_dtype(dtype: str | None) -> str:
    if dtype is None:
        return default_dtype()
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return dtype


def resolve_gguf(path: Path, *, progress: bool = True) -> Path:
    """The converted directory of the GGUF at `path`, converting it on first use (keyed by sha256)."""
    home = mlx_lane_home()
    digest = file_sha256_cached(path, home / "hash-cache")
    out = home / "models" / f"gguf-{digest[:16]}"
    if is_converted(out, digest):
        return out
    with file_lock(f"gguf:{digest}"):
        if not is_converted(out, digest):
            convert_gguf(path, out, progress=progress, sha256=digest)
    return out


def _from_hub(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as e:  # hub errors are many classes (HTTP, offline, gated, missing); all end here
        raise ModelLoadError(
            f"could not get {repo!r} from the Hugging Face Hub ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
            "The hub is unreachable from this machine or the repo does not exist. Pass a local mlx-lm model "
            "directory, a .gguf file, or 'default' (the packaged SmolLM2-135M-Instruct) instead."
        ) from e


def _resolve(spec: str, progress: bool) -> tuple[Path, str]:
    """(mlx-lm model directory, served model id) for `spec`."""
    if spec == "default":
        return ensure_default_model(progress), DEFAULT_MODEL
    p = Path(spec).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; pass a .gguf file or an mlx-lm model directory")
        return resolve_gguf(p, progress=progress), p.stem
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} has no config.json; it is not an mlx-lm model directory")
        return p, p.resolve().name
    name = canonical_name(spec)
    if name is not None:
        model_dir = packaged_paths(name)[1]
        if is_converted(model_dir, PACKAGED_MODELS[name].sha256):
            return model_dir, name
        raise ModelLoadError(f"packaged model {spec!r} is not fetched yet; run `mlx-lane models fetch {spec}` first")
    if _REPO_ID.match(spec):
        return _from_hub(spec), spec
    raise ModelLoadError(
        f"{spec!r} is not an existing file or directory, a packaged model ({', '.join(PACKAGED_MODELS)}) "
        "or a Hugging Face repo id (owner/name); pass 'default', a .gguf file or an mlx-lm model directory"
    )


def _context_length(config: dict[str, Any], model_dir: Path) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return int(cfg[key])
    try:
        return int(json.loads((model_dir / SOURCE_FILE).read_text())["context_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return _FALLBACK_CONTEXT


def _read_config(model_dir: Path) -> dict:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{model_dir}/config.json is unreadable ({e}); pass an mlx-lm model directory") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{model_dir}/config.json is not a JSON object")
    return config


def _load_from_mlx_vlm(model_dir: Path, model_id: str, dtype: str) -> LoadedModel:
    """A model whose classes come from mlx-vlm (models.loading.vlm_text): weights in memory once, cast to
    ``dtype``; mlx-lane's attention paths and kernels are mlx-lm's layers' and do not apply."""
    import mlx.core as mx

    model, tokenizer, config = load_vlm_text(Path(model_dir))
    cast_vlm(model, getattr(mx, dtype))
    evaluate_all_arrays(model)
    text = config.get("text_config") or {}
    vision = vlm_vision(Path(model_dir), config, model.vlm) if is_vision_config(config) else None
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=model_id, path=Path(model_dir),
        fingerprint=fingerprint(model_dir, dtype), dtype=dtype, context_length=_context_length(config, Path(model_dir)),
        architecture=str(config.get("model_type") or text.get("model_type") or "unknown"), vision=vision,
        sampling_defaults=read_sampling_defaults(model_dir), source="mlx-vlm")


def read_context_length(model_dir: Path) -> int | None:
    """The context length an mlx-lm directory's config.json declares, without loading it (None: unreadable)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _context_length(config, Path(model_dir)) if isinstance(config, dict) else None


def _load_overlapped(model_dir: Path, dtype) -> tuple[Any, Any, dict]:
    """mlx-lm's ``load``, with its two halves overlapped: the tokenizer is read on a second thread while this one reads
    the weights, casts them to ``dtype`` and evaluates them (``evaluate_all_arrays``: on this thread, whose stream the
    lane's requires). MLX's evaluation releases the GIL, so the tokenizer's seconds (a 200k-entry vocabulary on
    gpt-oss) hide behind the weights' instead of following them (issue 45: ready first). The cast is part of the read
    (the arrays are lazy until then), so a checkpoint of another dtype never sits in memory twice."""
    from concurrent.futures import ThreadPoolExecutor

    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    model, config = mlx_lm_load_model(model_dir, lazy=True)
    with ThreadPoolExecutor(1, thread_name_prefix="mlx-lane-tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, model_dir, eos_token_ids=config.get("eos_token_id"))
        model.set_dtype(dtype)
        evaluate_all_arrays(model)
        return model, tokenizer.result(), config


def install_paths(model) -> None:
    """mlx-lane's computing paths into an mlx-lm model's modules (each a no-op where it does not apply)."""
    install_cpu_attention(model)  # on the CPU only: grouped-query attention without copying K/V per query head
    install_gpu_attention(model)  # on CUDA only: a decode batch's attention in one kernel, rows of their own lengths
    install_kernels(model)  # off Metal: the gated delta rule and Mamba-2's step as kernels / the chunked form
    install_mamba_lengths(model)  # nemotron_h's batched prompts stop each row's state at its end


def load_model(spec: str, dtype: str | None = None, *, progress: bool = True, group: Any = None,
               source: str = "auto") -> LoadedModel:
    """Resolve `spec` (see module doc), load it with mlx-lm (or mlx-vlm: `source`, see the module doc) and cast its
    weights to `dtype`.

    `dtype` None means `default_dtype()`. `group` (server.engine.distributed.Group): load only this process's shard
    with mlx-lm's `sharded_load` (tensor- or pipeline-parallel, `group.mode`); the fingerprint is then the
    shard's (`group.shard_fingerprint`) and `model_fingerprint` the whole model's. Raises ModelLoadError, with what to do, for every failure: bad dtype, unknown spec, unreachable hub,
    unsupported GGUF or mlx-lm architecture, a model that does not split over the group.
    """
    dtype = _check_dtype(dtype)
    model_dir, model_id = _resolve(spec, progress)
    import mlx.core as mx

    if source_of(_read_config(model_dir), source) == "mlx-vlm":
        if group is not None:
            raise ModelLoadError(f"{model_dir} loads through mlx-vlm, which this server does not shard over "
                                 "processes; serve it in one process")
        return _load_from_mlx_vlm(model_dir, model_id, dtype)
    try:
        if group is None:
            model, tokenizer, config = _load_overlapped(Path(model_dir), getattr(mx, dtype))
        else:
            from models.loading.sharding import load_shard

            model, tokenizer, config = load_shard(model_dir, group)
            model.set_dtype(getattr(mx, dtype))
            evaluate_all_arrays(model)
    except (ValueError, FileNotFoundError, OSError, KeyError) as e:
        raise ModelLoadError(f"mlx-lm could not load {model_dir}: {e}") from e
    install_paths(model)
    fp = fingerprint(model_dir, dtype)
    vision = None
    if is_vision_config(config) and group is None:  # a model sharded over processes is served text-only
        vision = load_vision(Path(model_dir), config, model, dtype)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        path=Path(model_dir),
        fingerprint=fp if group is None else group.shard_fingerprint(fp),
        dtype=dtype,
        context_length=_context_length(config, Path(model_dir)),
        architecture=str(config.get("model_type", "unknown")),
        model_fingerprint=fp if group is not None else "",
        vision=vision,
        sampling_defaults=read_sampling_defaults(model_dir),
    )
