"""Runtime facts of this process: which BLAS MLX runs on, which device, which dtype by default, whether float32 stays
float32 on a CUDA GPU (``full_float32``).

On Linux the mlx-cpu wheel bundles the reference Netlib BLAS, ~48x slower for float32 matmuls than
OpenBLAS. The dynamic loader only lets a library win symbol lookup when it is loaded first, so the
fix is `LD_PRELOAD`; it must be in the environment before the process starts, hence `ensure_blas`
re-executes the process once with it set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["ensure_blas", "blas_info", "device_name", "default_dtype", "full_float32", "hide_torch",
           "evaluate_all_arrays", "OPENBLAS_CANDIDATES"]

OPENBLAS_CANDIDATES: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)
_REEXEC_MARKER = "MLX_LANE_BLAS_REEXEC"


def find_openblas(candidates: tuple[str, ...] = OPENBLAS_CANDIDATES) -> str | None:
    """The first existing OpenBLAS library among `candidates`, or None."""
    for path in candidates:
        if Path(path).is_file():
            return path
    return None


def _preloaded(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def blas_preload_env(env: dict[str, str], lib: str) -> dict[str, str]:
    """A copy of `env` with `lib` first in LD_PRELOAD and the re-exec marker set."""
    new = dict(env)
    new["LD_PRELOAD"] = " ".join([lib] + [p for p in _preloaded(env) if p != lib])
    new[_REEXEC_MARKER] = "1"
    return new


def ensure_blas(argv: list[str] | None = None) -> None:
    """Make this process run MLX on OpenBLAS when it is installed (Linux only).

    If an OpenBLAS library exists at a known path and is not yet in LD_PRELOAD, replace the
    process with `sys.executable + argv` (default: `sys.argv`) with LD_PRELOAD set. Call it first
    thing in `main()`, before threads or sockets exist. Does nothing on other systems, when the
    library is missing (see `blas_info` for the log line), or when a previous re-exec already
    happened (env marker), so it can never loop. Returns only when no re-exec happens.
    """
    if not sys.platform.startswith("linux") or os.environ.get(_REEXEC_MARKER):
        return
    lib = find_openblas()
    if lib is None or lib in _preloaded(dict(os.environ)):
        return
    args = list(sys.argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + args, blas_preload_env(dict(os.environ), lib))


def _mapped_openblas(maps_path: str = "/proc/self/maps") -> str | None:
    try:
        text = Path(maps_path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and _is_system_openblas(parts[5].strip()):
            return parts[5].strip()
    return None


def _is_system_openblas(path: str) -> bool:
    """An OpenBLAS exporting the standard BLAS symbols MLX calls. numpy's bundled
    `libscipy_openblas64_` uses suffixed symbols, so its presence proves nothing."""
    low = path.lower()
    return "openblas" in low and "scipy_openblas" not in low and "numpy" not in low


def blas_info() -> str:
    """One log line naming the BLAS that MLX's CPU matmuls use in this process."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    mapped = _mapped_openblas()
    if mapped is not None:
        return f"OpenBLAS (preloaded: {mapped})"
    if find_openblas() is None:
        return "reference BLAS bundled with mlx (slow: install libopenblas0-pthread)"
    return "reference BLAS bundled with mlx (slow: OpenBLAS is installed but not preloaded; call ensure_blas())"


def device_name() -> str:
    """MLX's default device type as a word: "cpu" or "gpu"."""
    import mlx.core as mx

    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def default_dtype() -> str:
    """The dtype models load in when none is asked for: float32 on the CPU, bfloat16 on a GPU.

    On the CPU, 16-bit matmuls have no BLAS path and run ~40x slower than float32.
    """
    return "float32" if device_name() == "cpu" else "bfloat16"


class _PathFinderWithoutTorch:
    """Python's path finder, except that the ``torch`` package is not found."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        from importlib.machinery import PathFinder

        if name == "torch" or name.startswith("torch."):
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        from importlib.machinery import PathFinder

        PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args, **kwargs):
        from importlib.machinery import PathFinder

        return PathFinder.find_distributions(*args, **kwargs)


def hide_torch() -> bool:
    """Make ``torch`` unimportable in this process, before anything imports it; returns whether it was hidden now.

    The server never uses torch, but transformers imports it whenever it is installed, while mlx-lm loads a
    tokenizer: 2.6 s of a 4.2 s import on this 2-core CPU (torch 2.13, CPU build), and most of the 24-36 s that a
    start spent importing on the H200's image, whose torch is a CUDA build. Machines that run an MLX server often
    have torch for other work (a GPU image, a dev venv: `make test` installs it for one oracle test). Call it first
    thing in a server process (server.cli does, unless MLX_LANE_IMPORT_TORCH=1); nothing changes for a process that
    imported torch already."""
    from importlib.machinery import PathFinder

    if "torch" in sys.modules or os.environ.get("MLX_LANE_IMPORT_TORCH") == "1":
        return False
    sys.meta_path[:] = [_PathFinderWithoutTorch if f is PathFinder else f for f in sys.meta_path]
    return any(f is _PathFinderWithoutTorch for f in sys.meta_path)


def evaluate_all_arrays(model) -> None:
    """Evaluate the weights and the model's private arrays (RoPE frequencies such as Llama-3's and YaRN's
    ``_freqs``, which ``parameters()`` leaves out) on the loading thread.

    A private array left lazy belongs to the stream of the thread that built it, and the lane's thread cannot evaluate
    it: on the H200 every request failed with "There is no Stream(gpu, 0) in current thread" once nothing on the
    loading thread ran a forward any more (the KV price is traced, not run: server.engine.slot)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    every = model.filter_and_map(lambda _m, _k, v: isinstance(v, (mx.array, dict, list)))
    leaves = (pair[1] for pair in tree_flatten(every))
    mx.eval([v for v in leaves if isinstance(v, mx.array)])


def full_float32(dtype, environ) -> bool:
    """``--dtype float32``: float32 matmuls stay float32 on a CUDA GPU. MLX's CUDA backend runs them as TF32 unless
    ``MLX_ENABLE_TF32=0`` (its default is 1): ~1e-3 relative error, which flipped a random 9B model's greedy near-ties
    between a one-token step and a verify forward on the H200 (bench/mtp_fit.py, BENCHMARKS.md 2026-12-07), where a
    user asking for float32 asks for its precision. MLX reads the variable at its first float32 matmul, after this.
    One the environment sets is the user's and stays. True when it was set here."""
    if dtype != "float32" or "MLX_ENABLE_TF32" in environ:
        return False
    environ["MLX_ENABLE_TF32"] = "0"
    return True
