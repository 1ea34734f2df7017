"""One loaded model as the engine computes with it: weights, tokenizer, cache namespace and its KV-layout facts.

The engine serves its **base** model (``--model``: the one adapters, the draft model and model-less requests use)
through its own slot, and every other model of the server (``--model NAME=PATH``, ``--models-dir``; loaded on
demand by server.pool) through one slot each; a request carries its slot in its ``server.lane.target.Target`` (a
``ModelSlot`` is the lane's ``Slot``). A sequence takes everything model-specific from its slot: the forward, the
fresh KV caches, the detokenizer and EOS ids, the namespace its KV is cached under (the model's fingerprint, KV
scheme included), and its facts (``facts``: models.facts.ModelFacts, measured once here by ``measure``).
``release()`` drops the references to the weights (the pool's unload): sequences still running keep the model through
the engine's own reference (``server.engine.work.SeqWork.model``) and finish with it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from models.attention import attention_path, reads_segments
from models.errors import ModelLoadError
from models.facts import CacheFacts, DraftHeads, ModelFacts
from models.kernels import expert_path, kernel_path
from models.mamba_lengths import lengths_reach_state
from models.loading.generation_defaults import NO_DEFAULTS, SamplingDefaults
from models.mlx_compat import keep_leading_space as keep_leading_space_of
from models.vlm_caches import is_vlm_cache
from models.vlm_caches import measure as measure_vlm
from server.engine.batch.mlx import can_batch
from server.engine.batch.ragged_kv import is_window
from server.engine.kv_layout import quantize_fresh, state_nbytes
from server.lane.budget import KVPrice
from spec.rewind import can_rewind

__all__ = ["ModelSlot", "measure"]

log = logging.getLogger("mlx_lane.engine")

# architectures with recurrent layers whose batched prompt forward keeps the right padding out of their state, as the
# zoo checks (tests/unit/test_zoo_models.py: the GPU layout's prompts, prefilled together, give mlx-lm's alone
# tokens). nemotron_h's Mamba-2 mixer does once models.mamba_lengths hands it its rows' lengths (mlx-lm 0.32 does
# not); an architecture the zoo has not checked is not trusted with it and prefills one prompt per forward.
_PADDED_STATE_EXACT = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "granitemoehybrid", "nemotron_h"})
_PRICE_TOKENS = 8  # tokens of the second forward that prices one token (fewer than any sliding window)


def traced_price(feed: Callable[[Optional[list], int], Optional[list]]) -> KVPrice:
    """The price of the caches ``feed`` grows: ``feed(None, 1)`` returns fresh caches holding one token (None: it
    keeps none, free), ``feed(caches, n)`` n tokens more, both only traced (lazy: shapes are known, nothing runs).
    The bytes added by the second call are per token; what one token left beyond that, per sequence."""
    caches = feed(None, 1)
    if caches is None:
        return KVPrice(0.0)
    one = float(state_nbytes(caches))
    feed(caches, _PRICE_TOKENS)
    per_token = (float(state_nbytes(caches)) - one) / _PRICE_TOKENS
    return KVPrice(per_token, max(0.0, one - per_token))


def measure(model, *, base: bool, kv_bits: Optional[int] = None, kv_group_size: int = 64,
            read_shared_prefix: bool = True, draft_heads: Optional[DraftHeads] = None) -> ModelFacts:
    """A model's facts (models.facts), from its fresh caches and its modules: the one place they are measured.
    ``base``: the server's base model (the draft model drafts for it); ``kv_bits``: its KV is quantized (nothing then
    merges, nor takes the ragged layout); ``read_shared_prefix`` False (--debug-copy-hits): every hit copies;
    ``draft_heads``: its own MTP heads, loaded from its checkpoint for --draft-kind mtp (models.mtp)."""
    layers = make_prompt_cache(model)
    if any(is_vlm_cache(c) for c in layers):  # mlx-vlm's classes: their facts are declared in models.vlm_caches
        return _measure_vlm(model, layers, base=base, kv_bits=kv_bits)
    plain_kv = kv_bits is None and all(type(c) is KVCache for c in layers)  # the ragged/prefill layouts
    # mlx-lm's batched prompt forward (PromptProcessingBatch) merges plain and sliding-window layers exactly, and
    # recurrent ones where the architecture keeps the padding out of its state (_PADDED_STATE_EXACT); quantized KV
    # does not merge
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    exact_state = model_type in _PADDED_STATE_EXACT and lengths_reach_state(model)
    fresh = layers if kv_bits is None else quantize_fresh(make_prompt_cache(model), kv_bits, kv_group_size)
    # the ragged layout holds plain and sliding-window attention layers (and recurrent state beside them)
    attends = [type(c) is KVCache or is_window(c) for c in layers]
    ragged = kv_bits is None and any(attends) and all(a or isinstance(c, ArraysCache) for a, c in zip(attends, layers))
    caches = CacheFacts(plain_kv=plain_kv, mergeable=can_batch(fresh),  # its rows may join a decode batch
                        recurrent=any(isinstance(c, ArraysCache) for c in layers),
                        windowed=any(isinstance(c, RotatingKVCache) for c in layers), ragged=ragged)
    windows = [c.max_size for c in layers if isinstance(c, RotatingKVCache)]
    return ModelFacts(
        caches=caches, layers=len(layers),
        # the layers whose state the prefix cache keeps at checkpoints (cache.checkpoints): they cannot be cut back
        checkpointed_layers=tuple(i for i, c in enumerate(layers) if isinstance(c, (ArraysCache, RotatingKVCache))),
        window=min(windows) if windows else None,
        rewinds=can_rewind(layers),  # drafts can be verified (rejected ones taken back: spec.rewind)
        draft_model=base,
        prefills_together=kv_bits is None and all(
            type(c) in (KVCache, RotatingKVCache) or (isinstance(c, ArraysCache) and exact_state) for c in layers),
        # a hit's caches may read the cached entry where it lies (models.attention.shared_prefix): plain KV layers,
        # and every attention of the model through a wrapper that reads segments (models.attention.cpu, .gpu)
        reads_shared_prefix=read_shared_prefix and plain_kv and reads_segments(model),
        attention=attention_path(model),
        recurrent_path=kernel_path(model),
        expert_path=expert_path(model),
        draft_heads=draft_heads if base else None,
    )


def _measure_vlm(model, layers: list, *, base: bool, kv_bits: Optional[int]) -> ModelFacts:
    """The facts of a model of mlx-vlm's cache classes (models.vlm_caches): its requests decode alone, interleaved
    with the batch (this engine's batch kinds hold mlx-lm's classes); checkpoints for every layer that is not plain
    KV; speculation where its layers can take a draft back. ``--kv-bits`` is refused (mlx-lm's quantized cache is
    not a class these models read)."""
    if kv_bits is not None:
        raise ModelLoadError(f"--kv-bits {kv_bits} is not supported for this model: it computes with mlx-vlm's "
                             "cache classes (models.vlm_caches); start the server without --kv-bits")
    facts = measure_vlm(layers)
    if facts.unknown:
        log.warning("cache classes %s are not declared in models.vlm_caches: this model decodes alone and never "
                    "speculates", ", ".join(facts.unknown))
    return ModelFacts(
        caches=CacheFacts(plain_kv=False, mergeable=False, recurrent=facts.recurrent, windowed=facts.windowed,
                          ragged=False),
        layers=len(layers), checkpointed_layers=facts.checkpointed_layers, window=facts.window,
        rewinds=facts.rewinds and not facts.unknown, draft_model=base, prefills_together=False,
        reads_shared_prefix=False, attention="mlx", recurrent_path="mlx" if facts.recurrent else "none",
    )


class ModelSlot:
    """One model of the server (see the module docstring); ``facts`` (models.facts.ModelFacts) measured once here."""

    def __init__(self, loaded, *, name: Optional[str] = None, base: bool = True, kv_bits: Optional[int] = None,
                 kv_group_size: int = 64, read_shared_prefix: bool = True, draft_heads: Optional[DraftHeads] = None):
        self.loaded = loaded  # models.loading.load.LoadedModel
        self.name: str = name or getattr(loaded, "model_id", None) or "default"  # what requests call it
        self.base = base  # the server's base model: adapters, the draft model and batched prefill apply to it
        self.model: Any = loaded.model
        self.tokenizer: Any = loaded.tokenizer
        self.vision: Any = getattr(loaded, "vision", None)  # models.loading.vision.VisionTower (None: text only)
        # the sampling its generation_config.json declares (models.loading.generation_defaults)
        self.sampling_defaults: SamplingDefaults = getattr(loaded, "sampling_defaults", NO_DEFAULTS)
        self.namespace: str = loaded.fingerprint
        self.context_length: int = getattr(loaded, "context_length", 0)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.eos = frozenset(self.tokenizer.eos_token_ids or [])
        self.facts: ModelFacts = measure(self.model, base=base, kv_bits=kv_bits, kv_group_size=kv_group_size,
                                         read_shared_prefix=read_shared_prefix, draft_heads=draft_heads)
        args = getattr(self.model, "args", None)
        self.vocab_size: int = getattr(args, "vocab_size", None) or len(getattr(self.tokenizer, "vocab", ()))
        self.kv_price: Optional[KVPrice] = None  # measured by measure_kv (the memory budget's price)
        self.counters: Any = None  # server.catalog.AdapterCounters of an on-demand model (its pool entry's)

    def new_caches(self) -> list:
        caches = make_prompt_cache(self.model)
        return caches if self.kv_bits is None else quantize_fresh(caches, self.kv_bits, self.kv_group_size)

    def measure_kv(self) -> KVPrice:
        """What this model's caches cost (all layers), from the bytes they hold after a 1-token and a 9-token
        forward: the difference is per token (attention layers' KV), the rest per sequence (recurrent state, which
        does not grow with the prompt).

        The forwards are only traced, never evaluated: MLX knows every array's shape and dtype when the graph is
        built, so the bytes are exact and the device runs nothing. (Evaluated, they compiled the model's kernels
        before the server could answer: 22-51 s of the H200's start-up, issue 45.)"""
        import mlx.core as mx

        def feed(caches: Optional[list], n: int) -> list:
            caches = self.new_caches() if caches is None else caches
            self.model(mx.array([[1] * n]), cache=caches)
            return caches

        self.kv_price = traced_price(feed)
        return self.kv_price

    def detokenizer(self, keep_leading_space: bool = False):
        """A fresh streaming detokenizer (mlx-lm's). mlx-lm's BPE and SentencePiece detokenizers drop the first
        token's leading space (right for a chat reply); ``keep_leading_space``: a raw completion keeps it, so that
        prompt + text reads as the model wrote it."""
        detokenizer = self.tokenizer.detokenizer
        if keep_leading_space:
            keep_leading_space_of(detokenizer)
        return detokenizer

    def decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def release(self) -> None:
        """Forget the weights (unloaded); running sequences keep their own reference."""
        self.model = None
        self.loaded = None
