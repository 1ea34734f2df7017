"""Images with multimodal rotary positions on the real engine and lane (issue 46), for every family of
models.loading.vision.MROPE_FAMILIES that builds here at tiny size (mlx-vlm's own classes, random weights): a prompt
with an image (its soft tokens at (t, h, w) positions, the text after it shifted) prefilled in chunks of 16 and decoded
gives mlx-vlm's own greedy tokens (its ``generate_step`` with the same pixels and grid); the next turn, resending the
image, is served from the prefix cache past the image and gives mlx-vlm's tokens for the whole conversation.

The processor is left out (the prompt's ids are written here, the pixels are random patches): the live test
(tests/integration/test_qwen_vision_live.py) runs the whole path with Qwen3.5's processor and the three doors."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from models.loading.vision import MROPE_FAMILIES, VisionTower  # noqa: E402
from models.loading.vlm_text import VlmTextModel  # noqa: E402
from tests.fixtures import zoo, zoo_vlm  # noqa: E402
from tests.unit.test_zoo_models import NoEosTokenizer, finished  # noqa: E402

VOCAB = 256
IMAGE, VIDEO, START, END = 4, 5, 6, 7  # the tiny vocabularies' vision tokens (tests.fixtures.zoo_vlm)
GRID = (1, 4, 6)  # one image: 4x6 patches of 8x8, merged 2x2: 6 soft tokens at (t, h, w) positions
_TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
_IDS = {"image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": START,
        "vision_end_token_id": END, "eos_token_id": 2}


def _qwen3_5():
    from mlx_vlm.models import qwen3_5

    text = {"model_type": "qwen3_5", **zoo.ZOO["qwen3_5"], "vocab_size": VOCAB}
    vision = {"model_type": "qwen3_5", **_TINY_VISION, "out_hidden_size": text["hidden_size"],
              "num_position_embeddings": 16}
    return qwen3_5, {"model_type": "qwen3_5", "text_config": text, "vision_config": vision, "vocab_size": VOCAB,
                     **_IDS}


def _qwen2_5_vl():
    from mlx_vlm.models import qwen2_5_vl

    text = {"model_type": "qwen2_5_vl", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
            "rope_theta": 10000.0, "tie_word_embeddings": False,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    vision = {"model_type": "qwen2_5_vl", **_TINY_VISION, "out_hidden_size": 64, "window_size": 32,
              "fullatt_block_indexes": [0]}
    # a flat config, as Qwen2.5-VL's checkpoints have it: the text model's fields at the top
    return qwen2_5_vl, {**text, "vision_config": vision, **_IDS}


def _build(family: str) -> VlmTextModel:
    if family == "qwen4_exp":
        return zoo_vlm.build("qwen4_exp", VOCAB)
    module, cfg = {"qwen3_5": _qwen3_5, "qwen2_5_vl": _qwen2_5_vl}[family]()
    config = module.ModelConfig.from_dict(cfg)
    for field, cls in (("text_config", "TextConfig"), ("vision_config", "VisionConfig")):
        if isinstance(getattr(config, field), dict):
            setattr(config, field, getattr(module, cls).from_dict(cfg[field]))
    mx.random.seed(0)
    model = module.Model(config)
    model.load_weights(list(zoo._scaled(model, 0).items()))
    mx.eval(model.parameters())
    return VlmTextModel(model)


FAMILIES = ["qwen2_5_vl", "qwen3_5", "qwen4_exp"]  # qwen3_5_moe: qwen3_5's classes with MoE layers


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    assert request.param in MROPE_FAMILIES
    return request.param, _build(request.param)


def _pixels(seed: int) -> np.ndarray:
    t, h, w = GRID
    return np.random.default_rng(seed).normal(size=(t * h * w, 3 * 2 * 8 * 8)).astype(np.float32)


def _prompt(before: list[int], after: list[int]) -> list[int]:
    tokens = GRID[1] * GRID[2] // 4
    return before + [START] + [IMAGE] * tokens + [END] + after


def oracle(model: VlmTextModel, ids: list[int], pixels: np.ndarray, n: int) -> list[int]:
    """mlx-vlm's own greedy tokens: ``generate_step`` with the image's pixels and grid."""
    from mlx_vlm.generate import generate_step

    for name in ("_position_ids", "_rope_deltas"):
        setattr(model.language_model, name, None)
    steps = generate_step(mx.array([ids]), model.vlm, mx.array(pixels), None, max_tokens=n, temperature=0.0,
                          image_grid_thw=mx.array([GRID]))
    return [int(t) for t, _ in steps]


def served(lane, ids: list[int], pixels: np.ndarray, n: int):
    """The lane's tokens for ``ids`` with the image, and what the prefix cache gave it."""
    from server.core.media import PromptMedia, cache_key, image_spans
    from server.lane.events import SamplingParams
    from server.lane.sequence import Sequence

    spans = image_spans(ids, IMAGE)
    digest = b"picture-" + pixels.tobytes()[:8]
    media = PromptMedia(tuple(ids), tuple(spans), pixels, (digest,), np.array([GRID]))
    target = lane.engine.base_target()
    params = SamplingParams(max_tokens=n, temperature=0.0)
    events: list = []
    seq = Sequence(prompt=cache_key(ids, spans, [digest]), params=params, sink=events.append, id=str(id(events)),
                   target=target, ns=lane.engine.namespace_for(target, params), media=media)
    lane.submit(seq)
    while not lane.idle():
        lane.tick()
    return list(seq.generated), finished(events).cached_tokens


def test_an_image_prompt_and_its_next_turn_from_the_cache_give_mlx_vlm_tokens(family):
    from cache.prompt_cache import PromptCache
    from server.engine.engine import Engine, EngineConfig
    from server.lane.lane import Lane
    from server.stats import ServingStats

    name, model = family
    vision = VisionTower(model.vlm, None, name)
    cache = PromptCache(1 << 28)
    loaded = SimpleNamespace(model=model, tokenizer=NoEosTokenizer(), fingerprint="q" * 16, vision=vision)
    stats = ServingStats()
    engine = Engine(loaded, cache, stats, EngineConfig(prefill_chunk=16))
    engine.bind_stream()
    lane = Lane(engine, cache, stats, max_batch=8)

    pixels = _pixels(1)
    turn1 = _prompt([20 + i for i in range(12)], [40 + (5 * i) % 90 for i in range(20)])
    want = oracle(model, turn1, pixels, 8)
    got, cached = served(lane, turn1, pixels, 8)
    assert got == want, name
    assert cached == 0
    turn2 = turn1 + got + [50, 51, 52, 53]
    got2, cached2 = served(lane, turn2, pixels, 6)
    assert cached2 > turn1.index(END), (name, cached2)  # past the image: its positions went on from the cache
    assert got2 == oracle(model, turn2, pixels, 6), name
