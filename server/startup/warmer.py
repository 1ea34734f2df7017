"""One kernel warmer's process (server.startup.warmers starts it; ``python -m server.startup.warmer --help``).

It compiles into a staging directory of its own (``MLX_PTX_CACHE_DIR``, set before MLX compiles anything), which
starts with the shared kernel cache's modules (models.loading.kernel_files.stage); loads the model's thin prefix of
layers (models.loading.thin: it finds them itself) with the server's own settings (the ``ServerConfig`` the server wrote) and paths; runs the
warm-up steps of its chains (server.engine.warmup) on a stream of its own; after each step publishes the modules it
compiled into the shared cache; marks each chain warmed; prints one JSON line (what it did, or the error) and exits.
It exits when the server does (Linux: the parent's death signal), and never writes into the shared directory but
through ``publish``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace


def _exit_with_parent() -> None:
    """Linux: SIGTERM this process when the server that started it dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass


def _config(path: Path):
    """The server's settings as it wrote them (``dataclasses.asdict`` of its ``ServerConfig``)."""
    from server.config import ServerConfig

    return ServerConfig.from_args(argparse.Namespace(**json.loads(path.read_text())))


def warm(args: argparse.Namespace) -> dict:
    """Load the thin model and run the chains' steps, publishing after each; returns what it did."""
    started = time.monotonic()
    from models.loading.kernel_files import publish, stage

    shared, staging = Path(args.shared), Path(args.staging)
    staged = stage(shared, staging)
    cfg = _config(Path(args.config))

    import mlx.core as mx

    from models.loading.generation_defaults import NO_DEFAULTS
    from models.loading.thin import load_thin, thin_config
    from server.engine.slot import ModelSlot
    from server.engine.warmup import warm_up_steps
    from server.serve import configure_kernels, engine_config

    configure_kernels(cfg)  # the server's paths and knobs (MLX_PTX_CACHE_DIR stays the staging directory)
    overrides = thin_config(json.loads((Path(args.model_dir) / "config.json").read_text()))
    if overrides is None:
        raise RuntimeError("no thin prefix of this model's layers could be built (models.loading.thin)")
    model, _ = load_thin(Path(args.model_dir), args.dtype, overrides)
    loaded = SimpleNamespace(model=model, tokenizer=SimpleNamespace(eos_token_ids=[], vocab={}),
                             model_id="kernel-warmer", fingerprint="kernel-warmer", context_length=0, vision=None,
                             sampling_defaults=NO_DEFAULTS)
    slot = ModelSlot(loaded, kv_bits=cfg.kv_bits, kv_group_size=cfg.kv_group_size,
                     read_shared_prefix=not cfg.debug_copy_hits)
    engine = engine_config(cfg)
    stream = mx.new_stream(mx.default_device())
    chains = [c for c in args.chains.split(",") if c]
    steps = [s for s in warm_up_steps(slot, engine.layout, engine.prefill_chunk, stream) if s.chain in chains]
    published = 0
    for step in steps:
        step.run()
        published += publish(staging, shared)
    markers = Path(args.markers)
    markers.mkdir(parents=True, exist_ok=True)
    for chain in chains:  # a chain this model has no step of (a lone sequence's model: no batched step) is warm too
        (markers / chain).touch()
    layers = overrides.get("num_hidden_layers", (overrides.get("text_config") or {}).get("num_hidden_layers"))
    return {"published": published, "staged": staged, "steps": [s.name for s in steps], "layers": layers,
            "seconds": round(time.monotonic() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.startup.warmer",
                                 description="compile a model's kernels ahead into a shared kernel cache (started "
                                             "by mlx-lane serve: --kernel-warmers)")
    ap.add_argument("--config", required=True, help="the server's settings (ServerConfig as JSON)")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--chains", required=True, help="comma list of warm-up chains to run")
    ap.add_argument("--shared", required=True, help="the kernel cache directory the server reads")
    ap.add_argument("--staging", required=True, help="this warmer's own directory (removed at exit)")
    ap.add_argument("--markers", required=True, help="where each warmed chain leaves a marker")
    args = ap.parse_args(argv)
    _exit_with_parent()
    os.environ["MLX_PTX_CACHE_DIR"] = args.staging  # before MLX compiles anything (it reads it once)
    code = 0
    try:
        result = warm(args)
    except Exception as exc:  # reported to the server, which serves on without this warmer's kernels
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        code = 1
    shutil.rmtree(args.staging, ignore_errors=True)
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: MLX's static destructors can abort with streams alive (server.serve)


if __name__ == "__main__":
    main()
