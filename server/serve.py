"""Assemble model, cache, lane and app from parsed CLI arguments, then run uvicorn."""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

log = logging.getLogger("mlx_lane")


def build_state(args):
    """Load the model and start the lane; returns a ready ``ServerState``."""
    from cache.prompt_cache import make_prompt_cache
    from models import blas_info, device_name, load_model
    from server.app import ServerState
    from server.cli import default_cache_bytes
    from server.engine import Engine
    from server.lane import Lane
    from server.stats import ServingStats

    loaded = load_model(args.model, args.dtype, progress=True)
    cache_bytes = default_cache_bytes() if args.cache_bytes is None else args.cache_bytes
    prompt_cache = make_prompt_cache(cache_bytes)
    stats = ServingStats()
    engine = Engine(loaded, prompt_cache, stats, prefill_chunk=args.prefill_chunk)
    engine.fault_hook = _fault_hook_from_env(loaded.tokenizer)
    lane = Lane(engine, max_queue=args.max_queue)
    lane.start()
    lane.ready.wait()
    blas = blas_info()
    log.info(
        "model %s (%s) | device %s | dtype %s | BLAS %s | prefix cache %.2f GiB | fingerprint %s",
        loaded.model_id, loaded.architecture, device_name(), loaded.dtype, blas,
        cache_bytes / (1 << 30), loaded.fingerprint[:16],
    )
    return ServerState(
        loaded=loaded, lane=lane, stats=stats, prompt_cache=prompt_cache, device=device_name(), blas=blas,
        api_key=args.api_key, keepalive_s=args.keepalive, default_max_tokens=args.default_max_tokens,
        max_body_bytes=args.max_body_bytes, model_names={"default"} if args.model == "default" else set(),
    )


def _fault_hook_from_env(tokenizer):
    """Test seam: with MLX_LANE_FAULT_MARKER set, a prompt containing that text makes the
    generation raise inside the lane (to prove a failure is a 500 and the lane lives on)."""
    marker = os.environ.get("MLX_LANE_FAULT_MARKER")
    if not marker:
        return None
    log.warning("fault injection armed for prompts containing %r", marker)

    def hook(job):
        if marker in tokenizer.decode(job.prompt):
            raise RuntimeError("injected fault (MLX_LANE_FAULT_MARKER)")

    return hook


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown (exit status -15); a
    shutdown that was asked for and completed cleanly exits 0 instead."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve(args) -> int:
    from models import ModelLoadError
    from server.app import create_app

    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        state = build_state(args)
    except ModelLoadError as exc:
        log.error("%s", exc)
        return 2
    app = create_app(state)
    log.info("serving on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "debug",
    )
    GracefulServer(config).run()
    return 0
