"""The second source of language models: mlx-vlm's classes, for the ``model_type``s mlx-lm has none for.

mlx-lm 0.32.2 lacks the newest families (qwen4_exp, deepseek_v4, glm5_next, hy_v4, step3p7, ...); mlx-vlm 0.7.10
carries each of them as an image-text ``Model`` whose ``language_model`` is the text model, with cache classes of its
own (models.vlm_caches declares what each of them allows). ``load_vlm_text`` loads the directory with mlx-vlm
(``mlx_vlm.utils.load_model``: its sanitizers, its quantization) and ``VlmTextModel`` wraps the loaded model so that
the engine computes with it as with an mlx-lm model: ``model(ids, cache=caches)`` returns logits,
``make_cache()`` the fresh caches, ``args`` its text config, ``layers`` its decoder layers. The whole mlx-vlm model
stays one object (its vision tower beside the text model): the weights are in memory once, and the image side
(models.loading.vision) shares them.

Positions: mlx-vlm's Qwen family (multimodal rotary positions) keeps the last prompt's positions and rope deltas on
the language model object between calls; a server interleaving sequences cannot rely on that state. For such a
family (``get_rope_index`` on its language model) the wrapper passes every forward's positions explicitly: each
row's cache offset plus the positions it feeds, plus the row's rope delta (``rope_deltas``: what an image before
these positions shifted them by; 0 for text). ``source(model_type, asked)`` says which library a model loads from;
``MLX_VLM_ONLY`` is what we checked mlx-vlm 0.7.10 serves that mlx-lm 0.32.2 lacks.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from models.errors import ModelLoadError

__all__ = ["VlmTextModel", "PositionedModel", "load_vlm_text", "cast", "cut_sensitive", "source", "mlx_lm_has",
           "mlx_vlm_has", "SOURCES", "MLX_VLM_ONLY", "CHECKED"]

log = logging.getLogger("mlx_lane.models")

SOURCES = ("auto", "mlx-lm", "mlx-vlm")  # --model-source

# mlx-vlm 0.7.10's language models that mlx-lm 0.32.2 lacks and that this server computes with (each in the zoo:
# tests/fixtures/zoo_vlm.py); another mlx-vlm-only model_type is tried the same way, with a warning
MLX_VLM_ONLY = ("qwen4_exp", "deepseek_v4", "glm5_next", "hy_v4", "step3p7")
# checked through this source too (tests/unit/test_qwen_vision.py, tests/integration/test_qwen_vision_live.py)
CHECKED = MLX_VLM_ONLY + ("qwen2_5_vl", "qwen3_5")


def mlx_lm_has(model_type: str) -> bool:
    """Does mlx-lm have a model class for ``model_type`` (after its own renames)?"""
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None


def mlx_vlm_has(model_type: str) -> bool:
    """Does the installed mlx-vlm have a model package for ``model_type``? (False without mlx-vlm.)"""
    if importlib.util.find_spec("mlx_vlm") is None:
        return False
    from mlx_vlm.utils import get_model_type

    name = get_model_type({"model_type": model_type}) or model_type
    return importlib.util.find_spec(f"mlx_vlm.models.{name}") is not None


def source(config: dict, asked: str = "auto") -> str:
    """Which library's classes compute this model: ``asked`` when it is mlx-lm or mlx-vlm, else mlx-lm where it has
    the ``model_type`` and mlx-vlm where only it does. ModelLoadError, with what to do, when neither has it."""
    if asked not in SOURCES:
        raise ModelLoadError(f"unknown model source {asked!r}; use one of {', '.join(SOURCES)}")
    model_type = str(config.get("model_type", ""))
    if asked != "auto":
        return asked
    if mlx_lm_has(model_type):
        return "mlx-lm"
    if mlx_vlm_has(model_type):
        return "mlx-vlm"
    hint = ("" if importlib.util.find_spec("mlx_vlm") is not None
            else "; mlx-vlm is not installed: install the vision extra (pip install 'mlx-lane[vision]'), which "
                 "serves the newest architectures (qwen4_exp, deepseek_v4, glm5_next, ...)")
    raise ModelLoadError(f"model_type {model_type!r} is supported by neither mlx-lm nor mlx-vlm{hint}")


class VlmTextModel(nn.Module):
    """An mlx-vlm model's language model, as the engine calls an mlx-lm model (see the module docstring)."""

    def __init__(self, vlm_model: Any):
        super().__init__()
        self.vlm = vlm_model  # the whole mlx-vlm model: its vision tower (if any) beside the language model
        self.source = "mlx-vlm"
        lm = vlm_model.language_model
        self._mrope = callable(getattr(lm, "get_rope_index", None))  # positions passed explicitly (module doc)
        self._fa = int(getattr(getattr(lm, "model", None), "fa_idx", 0) or 0)  # a layer whose cache has offsets

    @property
    def language_model(self) -> Any:
        return self.vlm.language_model

    @property
    def args(self) -> Any:
        """The text config (``model_type``, ``vocab_size``, ...), as mlx-lm models' ``args``."""
        lm = self.language_model
        return getattr(lm, "args", None) or getattr(lm, "config", None)

    @property
    def layers(self) -> list:
        lm = self.language_model
        layers = getattr(lm, "layers", None)
        return list(layers if layers is not None else lm.model.layers)

    def make_cache(self) -> list:
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.language_model)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, input_embeddings: Optional[mx.array] = None,
                 rope_deltas: Optional[mx.array] = None) -> mx.array:
        """The logits (B, L, vocab) of ``inputs`` (B, L) over ``cache`` (the text model's own caches);
        ``input_embeddings`` (B, L, hidden) in place of the tokens' (an image's features); ``rope_deltas`` (B,):
        each row's multimodal position shift (module docstring)."""
        kwargs: dict[str, Any] = {}
        if self._mrope:
            kwargs["position_ids"] = self._positions(inputs, cache, rope_deltas)
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, **kwargs)
        return out.logits

    def positioned(self, input_ids: Any, grid: Any) -> "PositionedModel":
        """This model as one prompt with images computes: its positions from mlx-vlm's own ``get_rope_index`` over
        the prompt's real token ids and its images' patch grids ((t, h, w) at image tokens, text after them shifted),
        and past the prompt each position shifted by the prompt's rope delta. Lane thread (mlx ops)."""
        positions, delta = self.language_model.get_rope_index(mx.array([list(input_ids)]), mx.array(grid), None,
                                                              None)
        return PositionedModel(self, positions[:, 0, :].astype(mx.int32), int(delta.reshape(-1)[0].item()))

    def _positions(self, inputs: mx.array, cache: Optional[list], rope_deltas: Optional[mx.array]) -> mx.array:
        """(3, B, L): every row's own positions (its cache offset onwards, shifted by its rope delta), the same on
        the three rotary axes (text after any image)."""
        batch, length = inputs.shape[0], inputs.shape[1]
        offset: Any = 0
        if cache:
            offset = getattr(cache[self._fa], "offset", 0)
        start = mx.maximum(offset, 0) if isinstance(offset, mx.array) else mx.array(int(offset))
        start = mx.broadcast_to(start.reshape(-1)[:batch] if start.ndim else start, (batch,)).astype(mx.int32)
        if rope_deltas is not None:
            start = start + rope_deltas.reshape(-1).astype(mx.int32)
        positions = start[:, None] + mx.arange(length, dtype=mx.int32)[None]
        return mx.broadcast_to(positions[None], (3, batch, length))


class PositionedModel:
    """A ``VlmTextModel`` computing one sequence whose prompt holds images (``VlmTextModel.positioned``): a forward
    over ``inputs`` at the sequence's cache offset ``o`` reads positions ``o..o+L-1`` of the prompt's own table, and
    beyond the prompt ``o + delta`` on the three rotary axes. Everything else is the model's (attributes pass
    through). One sequence: the engine decodes such a model's requests each alone."""

    def __init__(self, model: VlmTextModel, positions: mx.array, delta: int):
        self.model, self.positions, self.delta = model, positions, delta  # positions: (3, prompt length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None,
                 input_embeddings: Optional[mx.array] = None) -> mx.array:
        start = int(getattr(cache[self.model._fa], "offset", 0)) if cache else 0
        length = inputs.shape[1]
        known = self.positions[:, start: start + length]
        beyond = mx.arange(start + known.shape[1], start + length, dtype=mx.int32) + self.delta
        table = mx.concatenate([known, mx.broadcast_to(beyond[None], (3, beyond.shape[0]))], axis=1)
        position_ids = mx.broadcast_to(table[:, None, :], (3, inputs.shape[0], length))
        out = self.model.language_model(inputs, inputs_embeds=input_embeddings, cache=cache,
                                        position_ids=position_ids)
        return out.logits


def cast(model: VlmTextModel, dtype: Any) -> None:
    """The model's float weights in ``dtype``, but those its family keeps in their own precision (mlx-vlm's
    ``cast_predicate``: e.g. gated delta-net's ``A_log``, DeepSeek V4's attention sinks and hyper-connections)."""
    from mlx.utils import tree_flatten, tree_unflatten

    keep = getattr(model.vlm, "cast_predicate", None) or getattr(model.language_model, "cast_predicate", None)
    weights: Any = tree_flatten(model.parameters())
    cast_ = [(k, v.astype(dtype)) for k, v in weights
             if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype
             and (keep is None or keep(k.split("vlm.", 1)[-1]))]
    if cast_:
        model.update(tree_unflatten(cast_))


def cut_sensitive(vlm_model: Any) -> Optional[str]:
    """Why this model's text depends on where a prompt is cut into forwards in mlx-vlm itself (None: it does not,
    as far as the zoo found). mlx-vlm 0.7.10's DeepSeek V4 compresses the first window of each call of a 4:1 layer
    without its overlap with the previous window (``_overlap_compress_kv`` pads it), so prefill chunks, a cache hit
    and every decode step give other text than one pass over the same tokens; its Hy4 gives other tokens for other
    prefill steps once its sparse indexer selects (past ``index_topk`` keys). Such a model is served, with this
    warning at load: the prefix cache cannot promise mlx-vlm's one-pass text for it."""
    args = getattr(vlm_model.language_model, "args", None)
    model_type = getattr(args, "model_type", None)
    if model_type == "deepseek_v4" and 4 in (getattr(args, "compress_ratios", None) or ()):
        return ("mlx-vlm 0.7.10's deepseek_v4 drops the overlap of each call's first 4:1 compressed window: its text "
                "depends on where a prompt is cut into forwards (prefill chunks, cache hits), in mlx-vlm's own "
                "server too; a cache hit may change a greedy reply")
    if model_type == "hy_v4":
        return (f"mlx-vlm 0.7.10's hy_v4 selects keys sparsely once a sequence holds more than index_topk "
                f"({getattr(args, 'index_topk', '?')}) of them, and that selection depends on where a prompt is cut "
                "into forwards (prefill chunks, cache hits), in mlx-vlm's own server too; past that length a cache "
                "hit may change a greedy reply")
    return None


def load_vlm_text(model_dir: Path) -> tuple[VlmTextModel, Any, dict]:
    """(the wrapped model, mlx-lm's tokenizer of the directory, its config) for an mlx-vlm model directory.
    ModelLoadError, with what to do, when mlx-vlm is missing or cannot load it."""
    try:
        from mlx_vlm.utils import load_config, load_model
    except ImportError as e:
        raise ModelLoadError(f"{model_dir} needs mlx-vlm (its model_type is not in mlx-lm): install the vision "
                             f"extra (pip install 'mlx-lane[vision]') ({e})") from e
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    try:
        config = load_config(model_dir)
        vlm_model = load_model(Path(model_dir), lazy=True)
        tokenizer = load_tokenizer(Path(model_dir), eos_token_ids=_eos(config))
    except ImportError as e:  # a family whose mlx-vlm module needs an extra mlx-vlm was installed without
        raise ModelLoadError(f"mlx-vlm cannot import the {config.get('model_type')!r} family here ({e}); install "
                             "the package it names, or serve another model") from e
    except Exception as e:  # mlx-vlm, transformers' config validation and the hub raise many classes: all end here
        raise ModelLoadError(f"mlx-vlm could not load {model_dir} ({type(e).__name__}: {str(e)[:300]}); check that "
                             "it is a complete mlx-vlm model directory (config.json, *.safetensors, tokenizer)") from e
    if not hasattr(vlm_model, "language_model"):
        raise ModelLoadError(f"{model_dir} is a {config.get('model_type')!r} model of mlx-vlm's without a language "
                             "model (an encoder, a detector, an image generator): this server serves text generation")
    why = cut_sensitive(vlm_model)
    if why is not None:
        log.warning("%s: %s", model_dir, why)
    if config.get("model_type") not in CHECKED:
        log.warning("%s: mlx-lane has not checked mlx-vlm's %r against its own greedy text (checked: %s); it is "
                    "served the same way, its requests decoding alone", model_dir, config.get("model_type"),
                    ", ".join(CHECKED))
    return VlmTextModel(vlm_model), tokenizer, config


def _eos(config: dict) -> Optional[list]:
    eos = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    if eos is None:
        return None
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
