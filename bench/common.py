"""Shared helpers of the benchmark scripts (not tests): machine facts, timing, servers."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.serverproc import ServerProc, free_port  # noqa: E402,F401


def sse_chunks(client, url: str, body: dict, timeout: float = 1200):
    """POST a streaming request; yield (seconds since sent, parsed chunk) for every `data: {...}` event."""
    import json
    import time

    t0 = time.perf_counter()
    with client.stream("POST", url, json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield time.perf_counter() - t0, json.loads(line[6:])


def machine_facts() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    import mlx.core as mx
    import mlx_lm

    from models import blas_info

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_gib, 1),
        "blas": blas_info(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
    }


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def ensure_blas_here() -> None:
    """Re-exec this script with OpenBLAS preloaded (same rule as the server)."""
    from models.runtime import ensure_blas

    ensure_blas(sys.argv)


def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
