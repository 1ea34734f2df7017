"""The small read-only endpoints: ``/health``, ``/v1/models`` (and one model), ``/stats``, ``/metrics``."""

from __future__ import annotations

import functools
import importlib.metadata

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.errors import ModelNotFound
from server.http.metrics import prometheus_text
from server.http.wire import json_response

__all__ = ["router", "stats_body", "server_version"]

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state = request.app.state.lane_state
    lost = state.lane.executor.device_lost
    if lost is not None:  # the GPU is unusable (server.lane.device_loss): the server is on its way out
        return json_response({"status": "device_lost", "reason": lost, "lane": state.lane.state.value}, status=503)
    # the port opens once the lane thread serves (server.serve waits for lane.ready): "ok" means requests are
    # served; "warm": no warm-up step is left to run (with --warm-up behind they run after ready: server.lane.warm)
    return {"status": "ok", "warm": state.lane.warm.finished, "lane": state.lane.state.value,
            "api_key_required": bool(state.api_key)}  # the dashboard asks for the key before it polls


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.lane_state
    cards = [_model_card(state, name) for name in sorted(state.model_names)]
    if state.models is not None:
        state.models.refresh(max_age_s=0)  # models copied into --models-dir since start
        cards += [_on_demand_card(state, e) for e in state.models.entries()]
    cards += [_adapter_card(state, a) for a in state.adapters.all()]
    if state.embedder is not None:
        cards.append(_embedding_card(state))
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    state = request.app.state.lane_state
    adapter = state.adapters.get(model_id)
    if adapter is not None:
        return _adapter_card(state, adapter)
    if state.embedder is not None and model_id == state.embedder.model_id:
        return _embedding_card(state)
    if model_id in state.model_names:
        return _model_card(state, model_id)
    if state.models is not None and state.models.knows(model_id):
        return _on_demand_card(state, state.models.entry(model_id))
    raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")


@router.get("/stats")
async def stats(request: Request):
    return json_response(stats_body(request.app.state.lane_state))


@router.get("/metrics")
async def metrics(request: Request):
    return Response(prometheus_text(request.app.state.lane_state),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_card(state, name: str) -> dict:
    """The base model (always loaded)."""
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "context_length": state.loaded.context_length, "state": "loaded",
            "size_bytes": state.engine.weights_nbytes(), "adapters": state.adapters.names(),
            "vision": state.engine.base.vision is not None, **_source(state.loaded),
            **_defaults_fields(state, state.engine.base.sampling_defaults)}


def _on_demand_card(state, entry) -> dict:
    """An on-demand model (server.pool): its state (loaded / loading / not_loaded) and what is known of it."""
    slot = entry.slot
    return {"id": entry.name, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "context_length": slot.context_length if slot is not None else _configured_context(entry.spec),
            "state": entry.state, "size_bytes": entry.nbytes, "pinned": entry.pinned, "adapters": [],
            "vision": slot.vision is not None if slot is not None else _configured_vision(entry.spec),
            **_source(getattr(slot, "loaded", None), entry.spec),
            **_defaults_fields(state, slot.sampling_defaults if slot is not None else _configured_defaults(entry.spec))}


def _defaults_fields(state, defaults) -> dict:
    """The sampling a model's generation_config.json declares, and whether requests that leave those fields out get
    it (not under --ignore-model-defaults)."""
    return {"sampling_defaults": defaults.as_dict(), "sampling_defaults_applied": state.core.model_defaults}


def _configured_defaults(spec: str):
    """The sampling defaults a not-yet-loaded model declares."""
    from pathlib import Path

    from models.loading.generation_defaults import read_sampling_defaults

    return read_sampling_defaults(Path(spec).expanduser())


def _source(loaded, spec: str = "") -> dict:
    """Which architecture a model is and which library's classes compute it (models.loading.vlm_text): a loaded
    model's own record, else what its config.json says (empty when it cannot be read cheaply)."""
    if loaded is not None:
        return {"architecture": loaded.architecture, "source": getattr(loaded, "source", "mlx-lm")}
    import json
    from pathlib import Path

    from models.errors import ModelLoadError
    from models.loading.vlm_text import source

    try:
        config = json.loads((Path(spec).expanduser() / "config.json").read_text())
        return {"architecture": str(config.get("model_type")), "source": source(config)}
    except (OSError, ValueError, AttributeError, ModelLoadError):
        return {}


def _configured_context(spec: str):
    """The context length a not-yet-loaded model's config.json declares (None when it cannot be read cheaply)."""
    from pathlib import Path

    from models.loading.load import read_context_length

    return read_context_length(Path(spec).expanduser())


def _configured_vision(spec: str) -> bool:
    """Whether a not-yet-loaded model will take images: an image-text config of a family served with images, and
    mlx-vlm installed (models.loading.vision; a Qwen family's where it loads from mlx-vlm by default)."""
    import importlib.util
    import json
    from pathlib import Path

    from models.errors import ModelLoadError
    from models.loading.vision import FAMILIES, MROPE_FAMILIES, is_vision_config
    from models.loading.vlm_text import source

    try:
        config = json.loads((Path(spec).expanduser() / "config.json").read_text())
        # Qwen's multimodal positions: where its language model is mlx-vlm's (qwen4_exp; others by --model-source)
        families = FAMILIES + (MROPE_FAMILIES if source(config) == "mlx-vlm" else ())
    except (OSError, ValueError, AttributeError, ModelLoadError):
        return False
    return (isinstance(config, dict) and is_vision_config(config) and config.get("model_type") in families
            and importlib.util.find_spec("mlx_vlm") is not None)


def _adapter_card(state, adapter) -> dict:
    return {"id": adapter.name, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "context_length": state.loaded.context_length, "parent": state.loaded.model_id,
            **_defaults_fields(state, state.engine.base.sampling_defaults),
            "adapter": {"identity": adapter.identity[:16], "rank": adapter.rank, "num_layers": adapter.num_layers,
                        "fine_tune_type": adapter.fine_tune_type}}


def _embedding_card(state) -> dict:
    e = state.embedder
    return {"id": e.model_id, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "type": "embedding", "dimensions": e.dims, "max_input_tokens": e.max_tokens}


def stats_body(state) -> dict:
    from server.startup import TIMELINE

    lane = state.stats.lane_block()
    lane.update(state.stats.batch_block())
    batches = state.engine.batch_stats()  # which batch kind and attention path run (server.engine.batch.choose)
    lane.update({"queue_depth": state.lane.queue_depth, "active_request": state.lane.active_job_id,
                 "running_requests": list(state.lane.running_ids), "max_batch": state.lane.scheduler.limits.max_batch,
                 "prefill_batch": state.lane.scheduler.limits.prefill_batch,
                 "batch_layout": batches["layout"], "attention": batches["attention"],
                 "recurrent": batches["recurrent"], "experts": batches["experts"], "batches": batches["groups"],
                 "state": state.lane.state.value,
                 "prefill_parts": state.engine.prefill_stats(),  # forwards, tokens, forward/checkpoint/store seconds
                 "leave_parts": state.engine.leave_stats(),  # rows ended: out of their batch, entries stored (s)
                 "warm_up": state.lane.warm.as_dict()})  # --warm-up: its mode, state and steps (server.lane.warm)
    return {
        "version": server_version(),
        "model": state.loaded.model_id,
        "fingerprint": state.loaded.fingerprint,
        "device": state.device,
        "dtype": state.loaded.dtype,
        "blas": state.blas,
        "lane": lane,
        "prompt_cache": state.prompt_cache.stats(),
        "kv_cache": state.engine.kv_stats(),  # KV scheme + bytes per cached token (issue 8)
        # MLX's allocator: what arrays hold, its high-water mark, its buffer cache; what admission found unaccounted
        "memory": {**memory_block(), "unaccounted_bytes": state.lane.scheduler.budget.unaccounted,
                   "over_limit": state.engine.over_limit_stats()},  # forwards begun above MLX's limit: unpipelined
        "vision": state.engine.vision_stats(),  # images in (issue 36): encoder runs and their time
        # one model over several processes: the group, and cache hits dropped because a rank lacked its shard
        **({"distributed": {**state.distributed, **state.prompt_cache.shard_stats(), **state.lane.replay.describe()}}
           if state.distributed else {}),
        "ssd_cache": state.ssd.ssd_stats() if state.ssd is not None else {"enabled": False},
        "speculative": state.stats.spec.as_dict() if state.stats.spec is not None else {"enabled": False},
        "adapters": state.adapters.stats_block(),
        "models": _models_block(state),  # the on-demand models
        "embeddings": state.stats.embeddings.as_dict(state.embedder),
        "http": state.stats.http_block(),
        # the next turn's cache entries computed ahead (server.core.next_turn)
        "next_turn": state.core.next_turns.stats() if state.core.next_turns is not None else {"enabled": False},
        "startup": TIMELINE.as_dict(),  # where the seconds before ready went (server.startup)
        "prompt_tokens": _prompt_tokens_block(state),  # chat prompts tokenized from cached pieces (token_cache)
    }


def _prompt_tokens_block(state) -> dict:
    """The base model's tokenizer's piece cache (server.core.token_cache): whether it is on, the pieces and tokens
    it holds, and how many pieces (and their tokens) later prompts found there instead of tokenizing them again."""
    from server.core.token_cache import encoder_for

    enc = encoder_for(state.loaded.tokenizer)
    return enc.stats() if enc is not None else {"enabled": False}


def memory_block() -> dict:
    """MLX's allocator in bytes: ``active`` (arrays alive: weights, the RAM tier, the batch, snapshots the SSD writer
    still holds), ``peak`` (the high-water mark since start), ``cache`` (freed buffers MLX keeps for reuse), ``limit``
    (where MLX starts giving its cache back) and ``cache_limit`` (the cache's own cap: set on a CUDA GPU by
    ``server.sizes.apply_allocator_limits``, else None); ``device``: on a CUDA GPU, the card as the driver counts it
    (server.device_memory.snapshot: the whole card's use, the memory pool MLX allocates from, what lies outside it),
    else None."""
    import mlx.core as mx

    from server.device_memory import snapshot
    from server.sizes import CACHE_LIMIT_SET

    return {"active_bytes": int(mx.get_active_memory()), "peak_bytes": int(mx.get_peak_memory()),
            "cache_bytes": int(mx.get_cache_memory()), "limit_bytes": int(mx.get_memory_limit()),
            "cache_limit_bytes": CACHE_LIMIT_SET, "device": snapshot()}


def _models_block(state) -> dict:
    if state.models is None:
        return {}
    counts = getattr(state.prompt_cache, "entries_by_namespace", dict)()
    return state.models.stats_block(counts)


@functools.lru_cache(maxsize=1)
def server_version() -> str:
    """mlx-lane's installed version (the package metadata), or 'unknown' when run from a bare checkout."""
    try:
        return importlib.metadata.version("mlx-lane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
