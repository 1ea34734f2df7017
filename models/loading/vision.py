"""The image side of a vision model, through mlx-vlm: its processor and its vision encoder, beside the mlx-lm
language model the engine already runs.

A model directory whose ``config.json`` has a ``vision_config`` is an image-text model. mlx-lm loads its language
model (mlx-lm's wrappers of those families drop the vision weights), and that model stays what the engine computes
with: batches, caches, attention paths are unchanged. ``load_vision`` adds a ``VisionTower`` from mlx-vlm
(``mlx_vlm.utils.load``, lazily): mlx-vlm's processor turns the chat template's text and the images into token ids
(each image's placeholder expanded to its soft tokens) and pixel values, and mlx-vlm's
``get_input_embeddings`` computes the prompt's input embeddings (text tokens embedded, image features at the image
tokens). The engine feeds those embeddings to the language model for the prompt chunks that hold image tokens
(mlx-lm's ``input_embeddings``); everything after is plain text decoding. mlx-vlm's copy of the language model
shares the mlx-lm model's arrays (``_share_language_weights``): the weights are in memory once.

Families: those whose language model takes plain 1-D positions, so that embeddings in place of tokens are the whole
difference (``FAMILIES``: gemma3). Families with multimodal rotary positions (``MROPE_FAMILIES``: Qwen2.5-VL,
Qwen3.5, Qwen3.8-Flash-Next: image tokens get (t, h, w) positions and the text after them a shifted offset) take
images where their language model is mlx-vlm's (the second source, models.loading.vlm_text: it reads explicit
positions): ``vlm_vision`` makes their tower over that same model (nothing to share), ``prepare`` also returns each
image's patch grid (``Prepared.grid``), and the engine computes a sequence with images through
``VlmTextModel.positioned`` (its prompt's positions from mlx-vlm's own ``get_rope_index``). Loaded through mlx-lm
(the default for a family mlx-lm has), such a model is served text-only and the log says how to send it images
(``--model-source mlx-vlm``). Without mlx-vlm installed (the ``vision`` extra) a vision model is served text-only
too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["VisionTower", "Prepared", "load_vision", "vlm_vision", "is_vision_config", "FAMILIES", "MROPE_FAMILIES"]

log = logging.getLogger("mlx_lane.models")

FAMILIES = ("gemma3",)  # model_type values whose images this server feeds (see the module docstring)
# multimodal rotary positions: images where the language model is mlx-vlm's (tests/unit/test_qwen_vision.py)
MROPE_FAMILIES = ("qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen4_exp")


def is_vision_config(config: dict) -> bool:
    """An image-text model's config (a ``vision_config`` beside the language model's)."""
    return isinstance(config.get("vision_config"), dict)


@dataclass(frozen=True)
class Prepared:
    """A prompt's text and images as the model reads them: the token ids (each image's placeholder expanded to its
    soft tokens) and the processor's pixel values (one row per image, in prompt order)."""

    input_ids: tuple[int, ...]
    pixel_values: Any  # numpy (images, channels, height, width); Qwen's: (patches of every image, patch size)
    grid: Any = None  # Qwen's (images, 3) patch grids (t, h, w): where each image's patches are, and its positions


class VisionTower:
    """mlx-vlm's processor and vision encoder of one model (see the module docstring). ``prepare`` runs on any
    thread (tokenizing, resizing: CPU work off the lane); ``embed`` runs on the lane's thread and stream."""

    def __init__(self, vlm_model, processor, model_type: str):
        self.model = vlm_model
        self.processor = processor
        self.model_type = model_type
        config = vlm_model.config
        self.image_token_id: int = int(getattr(config, "image_token_index", None)
                                       or getattr(config, "image_token_id"))

    def prepare(self, text: str, images: Sequence[Any]) -> Prepared:
        """``text`` (the chat template's rendering, one placeholder per image) and the decoded images (PIL) through
        mlx-vlm's ``prepare_inputs``, as ``mlx_vlm.generate`` calls it. Raises ValueError when the processor refuses
        them (e.g. placeholders and images that do not pair up)."""
        import numpy as np
        from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

        inputs = prepare_inputs(self.processor, images=list(images), prompts=text,
                                image_token_index=self.image_token_id,
                                add_special_tokens=should_add_special_tokens(self.model_type, self.processor))
        ids = np.array(inputs["input_ids"]).reshape(-1)
        grid = inputs.get("image_grid_thw")
        return Prepared(tuple(int(t) for t in ids), np.array(inputs["pixel_values"]),
                        None if grid is None else np.array(grid).reshape(-1, 3))

    def embed(self, input_ids: Sequence[int], pixel_values, grid=None) -> Any:
        """The input embeddings (len(input_ids), hidden) of a stretch of prompt holding whole images, whose pixel
        values are ``pixel_values`` (in order; Qwen's: their patches, with their ``grid``): mlx-vlm's
        ``get_input_embeddings`` (the family's own merge of text embeddings and projected image features). Lane
        thread."""
        import mlx.core as mx

        ids = mx.array(list(input_ids))[None]
        extra = {} if grid is None else {"image_grid_thw": mx.array(grid)}
        out = self.model.get_input_embeddings(ids, mx.array(pixel_values), mask=mx.ones(ids.shape, dtype=mx.int32),
                                              **extra)
        return out.inputs_embeds[0]


def load_vision(model_dir: Path, config: dict, lm_model, dtype: str) -> Optional[VisionTower]:
    """The vision side of an image-text model directory, or None (served text-only, the log says why): mlx-vlm
    missing, or a family whose images this server does not feed (``FAMILIES``)."""
    model_type = str(config.get("model_type"))
    if model_type in MROPE_FAMILIES:
        log.warning("%s is a %s image-text model loaded through mlx-lm, whose %s takes no multimodal positions: "
                    "serving it text-only; to send it images, start the server with --model-source mlx-vlm (its "
                    "requests then decode alone)", model_dir, model_type, model_type)
        return None
    if model_type not in FAMILIES:
        log.warning("%s is a %s image-text model: images are not supported for this family yet (supported: %s); "
                    "serving it text-only", model_dir, model_type, ", ".join(FAMILIES + MROPE_FAMILIES))
        return None
    try:
        import mlx.core as mx
        from mlx_vlm.utils import load as vlm_load
    except ImportError as exc:
        log.warning("%s is an image-text model, but mlx-vlm is not installed (%s): serving it text-only; "
                    "install the vision extra (pip install 'mlx-lane[vision]') to send it images", model_dir, exc)
        return None
    vlm_model, processor = vlm_load(str(model_dir), lazy=True)
    _share_language_weights(vlm_model, lm_model)
    vlm_model.set_dtype(getattr(mx, dtype))
    _share_language_weights(vlm_model, lm_model)  # set_dtype made new arrays of the shared ones: share them again
    from models.runtime import evaluate_all_arrays

    evaluate_all_arrays(vlm_model)  # its private arrays too: the lane thread runs it
    return VisionTower(vlm_model, processor, model_type)


def vlm_vision(model_dir: Path, config: dict, vlm_model) -> Optional[VisionTower]:
    """The image side of a model whose language model is mlx-vlm's (models.loading.vlm_text): its processor beside
    the same model (its vision tower is already there), for a family whose images this server feeds
    (``MROPE_FAMILIES``); None otherwise, and the log says so."""
    model_type = str(config.get("model_type"))
    if model_type not in MROPE_FAMILIES:
        log.warning("%s is a %s image-text model: images are not supported for this family yet (supported: %s); "
                    "serving it text-only", model_dir, model_type, ", ".join(FAMILIES + MROPE_FAMILIES))
        return None
    from mlx_vlm.utils import load_processor

    try:
        processor = load_processor(Path(model_dir))
    except Exception as exc:  # a checkpoint without its processor files: the text model still serves
        log.warning("%s: mlx-vlm could not load its image processor (%s: %s): serving it text-only", model_dir,
                    type(exc).__name__, str(exc)[:200])
        return None
    return VisionTower(vlm_model, processor, model_type)


def _share_language_weights(vlm_model, lm_model) -> int:
    """Point mlx-vlm's language model at the mlx-lm model's arrays wherever a parameter has the same path (under
    ``language_model``) and shape: one copy of the weights in memory. Returns how many arrays are shared."""
    from mlx.utils import tree_flatten, tree_unflatten

    theirs = dict(tree_flatten(lm_model.parameters()))
    shared = []
    for name, value in tree_flatten(vlm_model.language_model.parameters()):
        mine = theirs.get(f"language_model.{name}", theirs.get(name))
        if mine is None and name == "lm_head.weight":  # a tied head: mlx-lm reads the embeddings instead
            mine = theirs.get("language_model.model.embed_tokens.weight", theirs.get("model.embed_tokens.weight"))
        if mine is not None and mine.shape == value.shape:
            shared.append((name, mine))
    vlm_model.language_model.update(tree_unflatten(shared))
    return len(shared)
