"""Kernel warmers: helper processes that compile the CUDA kernels of the warm-up while the server starts (issue 45:
from launch to the first answer). Off by default (``--kernel-warmers 0``): measured, they did not bring the first
answer sooner (below).

On a GPU a fresh server's first requests wait for MLX to compile kernels (NVRTC, one at a time on the thread that
evaluates): on an H100, gpt-oss-20b's first tiny request took 15.9 s with an empty kernel cache against 0.55 s with the
kernels of an earlier start (BENCHMARKS.md, 2026-12-07, twelfth session); the kernel cache then keeps them across
restarts (models.loading.home). Those compiles depend on the kinds of layers a forward runs, not on the weights nor on
how many layers there are. So with ``--kernel-warmers N|auto`` the server starts, first thing (``start_early``:
server.cli, before its own imports), up to N processes ('auto' on a CUDA GPU: one per chain of warm-up steps missing
from the kernel cache, at most one per 4 CPU cores and as many as half the card's room beside the weights holds:
``card_room``); each loads the model's thinnest prefix of layers (models.loading.thin), runs its chains of the warm-up
steps (server.engine.warmup, ``server.lane.seam.WARMER_CHAINS``: a prompt's chunks, sampling, a batched step, a batched prefill, chunks
past a cache) and publishes each compiled module into the kernel cache whole (models.loading.kernel_files). The
server's own warm-up (server.lane.warm) waits for them, then finds their kernels on disk. Requests never wait for
them: MLX looks a kernel up in the kernel cache once, when it first needs it, and compiles it itself if it is not
there.

Measured on an H100 with a Llama-3-8B shape (BENCHMARKS.md, 2026-12-07, fifteenth session): a fresh start answered
its first tiny request after 14.7 s without warmers; the warmers' own start (imports, the thin model) took as long as
the server's imports and weights, so the one chain a first request needs was published no sooner than the server
compiled it itself, and a first request made to wait for the warmers (a form since removed) answered after 39.8 s,
the sampling chain alone compiling 9 modules for 33 s. What the warmers do move off the server is the batched
kernels (18.8 s for the batched step's chain), which its warm-up would compile behind the requests: not measured.

A chain once warmed leaves a marker (``<kernel cache>/warmed/<key>/<chain>``, the key: the model's config, dtype and
the settings and sources that shape its kernels), so a restart starts no warmer. A warmer that fails or outlives
``DEADLINE_S`` costs nothing but its kernels: the first requests compile what is missing, as without warmers. /stats
``startup.kernel_warmers`` says what each did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

log = logging.getLogger("mlx_lane.warmers")

__all__ = ["KernelWarmers", "start_kernel_warmers", "start_early", "early", "stop_all", "warm_key", "split_chains",
           "CORES_PER_WARMER", "DEADLINE_S"]

CORES_PER_WARMER = 4  # NVRTC takes a core a compile; the server's own load and the warmers' imports want the rest
DEADLINE_S = 600.0  # a warmer still running after this is stopped (its kernels so far are published)
# the sources whose changes change the kernels a warm-up compiles (with mlx's version, in the kernel cache's path)
_KERNEL_SOURCES = ("models/attention", "models/kernels", "server/engine/warmup.py", "server/engine/batch")


def _sources_digest() -> str:
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in _KERNEL_SOURCES:
        path = root / rel
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            try:
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
            except OSError:
                continue
    return h.hexdigest()


def warm_key(cfg, model_dir: Path, dtype: str) -> str:
    """What the kernels a warm-up compiles depend on: the model's config, the dtype, the settings that choose its
    paths (layout, attention, kernels, KV bits, the prompt chunk) and mlx-lane's kernel sources."""
    chosen = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k in ("batch_layout", "attention", "kernels", "kv_bits", "kv_group_size", "prefill_chunk",
                       "debug_copy_hits", "no_spec_batch", "debug_no_draft_batch")
              or k.startswith("debug_gpu_attention") or k in ("debug_cudnn_buckets", "debug_no_conv_kernel",
                                                               "debug_moe_sort_min", "debug_moe_dense_max")}
    try:
        config = (Path(model_dir) / "config.json").read_bytes()
    except OSError:
        config = b""
    h = hashlib.sha256()
    h.update(config)
    h.update(json.dumps({"dtype": dtype, **chosen}, sort_keys=True, default=str).encode())
    h.update(_sources_digest().encode())
    return h.hexdigest()[:24]


def split_chains(chains: list[str], processes: int) -> list[list[str]]:
    """``chains`` dealt over ``processes`` warmers (the first chain, a prompt's, which every request needs, first)."""
    processes = max(0, min(processes, len(chains)))
    out: list[list[str]] = [[] for _ in range(processes)]
    for i, chain in enumerate(chains):
        if processes:
            out[i % processes].append(chain)
    return out


@dataclass
class _Warmer:
    chains: list[str]
    proc: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    ended: Optional[float] = None
    result: dict = field(default_factory=dict)


class KernelWarmers:
    """The warmers of this start (possibly none, with the reason); ``busy()`` while any runs (the lane's warm-up
    holds its steps meanwhile: server.lane.warm)."""

    def __init__(self, warmers: list[_Warmer], why: str, deadline_s: float = DEADLINE_S):
        self._warmers = warmers
        self.why = why
        self._deadline = time.monotonic() + deadline_s
        self._lock = threading.Lock()
        _STARTED.append(self)
        for w in warmers:
            threading.Thread(target=self._watch, args=(w,), name="mlx-lane-warmer-watch", daemon=True).start()

    def _watch(self, w: _Warmer) -> None:
        out, _ = w.proc.communicate()
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        try:
            result = json.loads(lines[-1]) if lines else {}
        except ValueError:
            result = {}
        with self._lock:
            w.ended = time.monotonic()
            w.result = result if isinstance(result, dict) else {}
        seconds = w.ended - w.started
        if w.proc.returncode == 0:
            log.info("kernel warmer (%s) done in %.1fs: %d modules compiled and published", ", ".join(w.chains),
                     seconds, int(w.result.get("published", 0)))
        else:
            log.warning("kernel warmer (%s) stopped after %.1fs (exit %s): %s; the first requests compile what it did "
                        "not (its log: %s)", ", ".join(w.chains), seconds, w.proc.returncode,
                        w.result.get("error", "no result"), w.log_path)

    def busy(self) -> bool:
        """Any warmer still running; past the deadline every one is stopped and this is False."""
        running = [w for w in self._warmers if w.proc.poll() is None]
        if running and time.monotonic() > self._deadline:
            log.warning("kernel warmers still running after %.0fs: stopped", DEADLINE_S)
            self.stop()
            return False
        return bool(running)

    def stop(self) -> None:
        """Terminate the warmers still running (the server's shutdown)."""
        for w in self._warmers:
            if w.proc.poll() is None:
                try:
                    w.proc.terminate()
                except OSError:
                    pass

    def as_dict(self) -> dict:
        """/stats ``startup.kernel_warmers``."""
        now = time.monotonic()
        with self._lock:
            rows = [{"chains": w.chains, "state": ("running" if w.proc.poll() is None else
                                                   "done" if w.proc.returncode == 0 else "failed"),
                     "seconds": round((w.ended or now) - w.started, 2), "pid": w.proc.pid,
                     **{k: w.result[k] for k in ("published", "staged", "layers", "steps", "error") if k in w.result}}
                    for w in self._warmers]
        return {"processes": len(rows), "why": self.why, "warmers": rows}


_STARTED: list[KernelWarmers] = []


def stop_all() -> None:
    """Terminate every warmer this process started that still runs (the server's exit skips atexit hooks)."""
    for warmers in _STARTED:
        warmers.stop()


def _forget_old_runs(folder: Path) -> None:
    """Remove the folders (settings, logs, staging) of earlier servers' warmers whose server no longer runs."""
    import shutil

    try:
        runs = list(folder.iterdir())
    except OSError:
        return
    for run in runs:
        try:
            os.kill(int(run.name), 0)
            continue  # that server still runs
        except (ValueError, ProcessLookupError):
            shutil.rmtree(run, ignore_errors=True)
        except OSError:
            continue


def _on_cuda() -> bool:
    import mlx.core as mx

    try:
        return mx.default_device() == mx.gpu and bool(mx.cuda.is_available())
    except AttributeError:
        return False


def _local_model_dir(spec: str) -> Optional[Path]:
    """The mlx-lm directory ``spec`` names, found without importing mlx-lm (a warmer starts before the server's
    imports): a directory with a config.json whose ``model_type`` mlx-lm has a module for, or a fetched packaged
    model ('default' included); None otherwise (a GGUF to convert, a hub repo, a model only mlx-vlm computes)."""
    import importlib.util

    from models.loading.default import DEFAULT_MODEL
    from models.loading.packaged import PACKAGED_MODELS, canonical_name, is_converted, packaged_paths

    name = DEFAULT_MODEL if spec == "default" else canonical_name(spec)
    if name is not None and name in PACKAGED_MODELS:
        path = packaged_paths(name)[1]
        if not is_converted(path, PACKAGED_MODELS[name].sha256):
            return None
    else:
        path = Path(spec).expanduser()
    try:
        config = json.loads((path / "config.json").read_text())
        found = importlib.util.find_spec("mlx_lm")
    except (OSError, ValueError, ImportError):
        return None
    model_type = str(config.get("model_type") or "") if isinstance(config, dict) else ""
    places = list(found.submodule_search_locations or []) if found is not None else []
    if not model_type or not any((Path(p) / "models" / f"{model_type.replace('-', '_')}.py").is_file() for p in places):
        return None
    return path


def start_kernel_warmers(cfg, model_spec: str) -> KernelWarmers:
    """Start this server's warmers (see the module docstring) for the model ``model_spec`` names; returns them, or
    none with the reason. Light: it imports neither mlx-lm nor the server, so that ``server.cli`` calls it first
    (``start_early``) and the warmers' own imports and compiles overlap the server's imports and weights. It sets
    ``MLX_PTX_CACHE_DIR`` (unless set) as the server's kernel settings do."""
    wanted = cfg.kernel_warmers
    if wanted == 0:
        return KernelWarmers([], "--kernel-warmers 0")
    if cfg.warm_up == "off":
        return KernelWarmers([], "--warm-up off")
    if os.environ.get("MLX_RANK") is not None:
        return KernelWarmers([], "a model sharded over processes (its ranks warm up together)")
    if wanted is None and not _on_cuda():
        return KernelWarmers([], "not a CUDA GPU (nothing to compile ahead)")
    from models.loading.home import kernel_cache_dir, mlx_lane_home
    from models.runtime import default_dtype
    from server.lane.seam import WARMER_CHAINS

    model_dir = _local_model_dir(model_spec)
    if model_dir is None:
        return KernelWarmers([], "the model is not a local mlx-lm directory")
    shared = os.environ.setdefault("MLX_PTX_CACHE_DIR", str(kernel_cache_dir(mlx_lane_home())))
    dtype = cfg.dtype if cfg.dtype in ("float32", "bfloat16", "float16") else default_dtype()
    markers = Path(shared) / "warmed" / warm_key(cfg, model_dir, dtype)
    missing = [c for c in WARMER_CHAINS if not (markers / c).exists()]
    if not missing:
        return KernelWarmers([], "every chain warmed by an earlier start (the kernel cache holds its kernels)")
    count = wanted if wanted is not None else max(1, (os.cpu_count() or 1) // CORES_PER_WARMER)
    room = card_room(model_dir)
    if room is not None:
        count = min(count, room)
        if count < 1:
            return KernelWarmers([], "no room on the card beside the weights for a warmer's thin model")
    from server.sizes import remember_memory_of_others

    remember_memory_of_others()  # the device's other users, asked before the warmers hold memory of their own
    run_dir = Path(shared) / "warmers" / str(os.getpid())
    _forget_old_runs(run_dir.parent)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), default=list))
    warmers = []
    for i, chains in enumerate(split_chains(missing, count)):
        log_path = run_dir / f"warmer-{i}.log"
        cmd = [sys.executable, "-m", "server.startup.warmer", "--config", str(run_dir / "config.json"),
               "--model-dir", str(model_dir), "--dtype", dtype, "--chains", ",".join(chains), "--shared", shared,
               "--staging", str(run_dir / f"staging-{i}"), "--markers", str(markers)]
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                    text=True, cwd=str(Path(__file__).resolve().parents[2]))
        warmers.append(_Warmer(chains, proc, log_path))
    log.info("kernel warmers: %d processes compiling %s ahead", len(warmers), ", ".join(missing))
    return KernelWarmers(warmers, f"{len(missing)} chains not in the kernel cache")


WARMER_CONTEXT_BYTES = 1 << 30  # a warmer's CUDA context, libraries and buffers beside its thin model
THIN_LAYERS_AT_MOST = 4  # layers a thin model keeps in the zoo and the bench's shapes (Qwen3.5: 4, most: 1-2)


def card_room(model_dir: Path) -> Optional[int]:
    """How many warmers the card holds beside the model's weights (None where the driver does not say: the CPU).
    A warmer holds the embedding, the head and a few layers: at most ``THIN_LAYERS_AT_MOST + 2`` layers' share of the
    checkpoint's bytes, and ``WARMER_CONTEXT_BYTES``; the server's own weights and half of what is left stay free."""
    if not _on_cuda():
        return None
    from server.device_memory import driver

    dm = driver()
    card = dm.card() if dm is not None else None
    if card is None:
        return None
    used, total = card
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        layers = int(config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
                     or THIN_LAYERS_AT_MOST)
    except (OSError, ValueError, TypeError, AttributeError):
        layers = THIN_LAYERS_AT_MOST
    per_warmer = weights * min(1.0, (THIN_LAYERS_AT_MOST + 2) / max(1, layers)) + WARMER_CONTEXT_BYTES
    spare = (total - used - weights) / 2
    return max(0, int(spare // per_warmer))


_EARLY: list[KernelWarmers] = []


def start_early(cfg) -> None:
    """``server.cli``'s call, first thing for ``serve``: the warmers of the base model (``--model``), kept for
    ``early()``. A failure here never stops the server: it starts without warmers."""
    from server.pool.flags import parse_model_flags

    try:
        _EARLY.append(start_kernel_warmers(cfg, parse_model_flags(cfg.model).base))
    except Exception as exc:  # noqa: BLE001 - the warmers are an optimisation; the server starts without them
        _EARLY.append(KernelWarmers([], f"could not start: {type(exc).__name__}: {exc}"))


def early() -> Optional[KernelWarmers]:
    """The warmers ``start_early`` started (or decided against), or None where it was not called."""
    return _EARLY[-1] if _EARLY else None
