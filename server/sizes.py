"""Byte sizes on the command line and the defaults derived from this machine (RAM, disk, device memory)."""

from __future__ import annotations

import argparse
import os
import re
from typing import Optional

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'512M', '8GiB', '1073741824' -> bytes (binary units)."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 0, 512M, 8G)")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def physical_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def default_cache_bytes(weights_bytes: int = 0, budget_bytes: Optional[int] = None) -> int:
    """RAM prefix-cache cap. On the CPU (and Apple's unified memory): min(8 GiB, 25% of RAM), leaving the rest to
    the OS, the running requests and the SSD tier's buffers. On a GPU, whose own memory holds the cached KV: half
    of what the default memory budget (``gpu_budget_share``) leaves beside the weights, so the running sequences keep
    the other half (the cache yields to them under admission anyway): ~41 GiB for an 8B bf16 model on an H200, where a
    fixed 8 GiB held 10 agents' entries of 5k tokens. A --memory-budget (``budget_bytes``) caps it at half of what
    that budget leaves beside the weights, on any device (on an H100 a 60G budget left the cache at 31 GB before)."""
    total, source = device_memory()
    if source == "physical RAM":
        size = min(8 << 30, physical_ram() // 4)
    else:
        size = max(1 << 30, int(((total - memory_of_others()) * gpu_budget_share() - weights_bytes) / 2))
    if budget_bytes:
        size = min(size, max(1 << 30, int((budget_bytes - weights_bytes) / 2)))
    return size


def default_ssd_cache_bytes(path: str) -> int:
    """min(32 GiB, 25% of the free space on the file system that holds `path` (or its nearest existing parent))."""
    import shutil

    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = 0
    return min(32 << 30, free // 4)


def device_memory() -> tuple[int, str]:
    """(bytes, where from) of the memory the model's arrays live in: the GPU's own memory on CUDA / Metal when MLX
    reports it, else this machine's RAM (CPU, and Apple's unified memory)."""
    try:
        import mlx.core as mx

        if mx.default_device() != mx.cpu:
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
                if info.get(key):
                    return int(info[key]), f"device {key}"
    except Exception:  # noqa: BLE001 - an introspection failure falls back to RAM
        pass
    return physical_ram(), "physical RAM"


CUDA_BUDGET_SHARE = 0.60
OTHER_GPU_BUDGET_SHARE = 0.90


def gpu_budget_share() -> float:
    """The share of a GPU's memory the default budget gives MLX's arrays: 60% on CUDA, 90% elsewhere (Metal).

    Why less on CUDA: the card holds more than MLX counts. MLX allocates from the driver's stream-ordered memory pool
    (``cudaMallocAsync``), and that pool fragments: in-process, prefills of many shapes beside 45 GB of kept KV
    caches left it 80.8 GB reserved for 62.4 GB in use on an H100 80GB (85.0 GB), and the next prefill ran out of
    memory (``bench/gpu_memory_probe.py``). 16 Llama-3-8B agents with the SSD tier lost 30-32 of 64 requests to
    out-of-memory at a 70% budget and none at 50 GiB (63%); Qwen3.5-9B's ran whole at 60% (BENCHMARKS.md,
    2026-12-06, fourth session). But in those runs the benchmark's own process held the model it had built, 17-39 GB
    of the card (the "outside the pool" figure then read; 1.8-8.8 GB on a card the benchmark did not share, eighth
    session): the 70% failures are not evidence against 70%. The share stays at 60% until it is measured on a card
    the server has to itself."""
    return CUDA_BUDGET_SHARE if on_cuda() else OTHER_GPU_BUDGET_SHARE


def on_cuda() -> bool:
    """MLX computes on a CUDA GPU."""
    try:
        import mlx.core as mx

        cuda = getattr(mx, "cuda", None)
        return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)
    except Exception:  # noqa: BLE001 - no MLX backend to ask: not CUDA
        return False


def default_memory_budget() -> tuple[int, str]:
    """--memory-budget default: ``gpu_budget_share`` of a GPU's memory (60% on CUDA, 90% on Metal), 75% of RAM on a
    CPU (the OS, the HTTP layer and the SSD tier's write-behind buffers need the rest; an OOM kill loses every
    stream at once). On CUDA, of the card's memory less what other processes hold when it is asked
    (``memory_of_others``): a budget of the whole card beside another process's 17-39 GB ran out of device memory
    (BENCHMARKS.md, 2026-12-06, eighth session)."""
    total, source = device_memory()
    share = 0.75 if source == "physical RAM" else gpu_budget_share()
    why = f"{int(round(share * 100))}% of {source}"
    others = 0 if source == "physical RAM" else memory_of_others()
    if others:
        why += f" less {others / (1 << 30):.1f} GiB other processes hold on the card"
    return int((total - others) * share), why


# What a CUDA card holds for this process outside MLX's memory pool: its context, cuBLAS / cuDNN workspaces and
# kernels. 1.1-1.5 GB in-process on an H100 (BENCHMARKS.md, 2026-12-06, fourth session).
OWN_OUTSIDE_POOL = 2 << 30


def memory_of_others() -> int:
    """Bytes of the CUDA card that other processes hold now, as far as the driver tells: the card's use outside the
    memory pool MLX allocates from (``server.device_memory.snapshot``) beyond ``OWN_OUTSIDE_POOL``. 0 on the CPU, on
    Metal, and where the driver does not say. An estimate: arrays this process's host has read (moved to managed
    memory by MLX) count as others' too, so it is asked once, at start, before any request. 0 in a process of
    ``mlx.launch`` (``MLX_RANK`` set): its NCCL ranks compute on device ``rank % devices`` while the driver is read
    on device 0, whose memory is the other ranks'."""
    if not on_cuda() or os.environ.get("MLX_RANK") is not None:
        return 0
    if _OTHERS_AT_START:
        return _OTHERS_AT_START[0]
    from server.device_memory import snapshot

    snap = snapshot()
    outside = (snap or {}).get("outside_pool_bytes")
    return max(0, int(outside) - OWN_OUTSIDE_POOL) if outside is not None else 0


_OTHERS_AT_START: list[int] = []  # memory_of_others as remembered before this process started helpers of its own


def remember_memory_of_others() -> None:
    """Ask ``memory_of_others`` now and answer that from now on: the kernel warmers (server.startup.warmers) are this
    server's own helpers, started before the weights are read, and must not shrink its budget while they run."""
    if not _OTHERS_AT_START:
        _OTHERS_AT_START.append(memory_of_others())


def allocator_limits(budget_bytes: int, device_bytes: int) -> tuple[int, int]:
    """(memory limit, cache limit) in bytes for MLX's allocator on a GPU with memory of its own: the memory limit at
    the admission budget, the cache of freed buffers at 5% of the card (at least 1 GiB).

    Why: MLX's CUDA allocator gives its cache of freed buffers back only when its arrays plus that cache would pass
    its own limit, 95% of the card; the CUDA context, cuBLAS' workspaces and the memory pool's own slack live in the
    last 5%. On an H100 80GB with 16 agents of a Llama-3-8B shape the cache held 7-11.5 GB beside 54-59 GB of arrays
    and prefills failed with ``cudaMallocAsync ... out of memory`` (BENCHMARKS.md, 2026-12-06, third session). At the
    budget (``gpu_budget_share`` of the card by default) the cache yields before the card is full, and a small cache
    keeps it from sitting on what the next prefill needs."""
    memory = int(budget_bytes) if budget_bytes else int(device_bytes * CUDA_BUDGET_SHARE)
    return memory, max(1 << 30, int(device_bytes * 0.05))


def apply_allocator_limits(budget_bytes: int, pool_keep_bytes: Optional[int] = None) -> Optional[dict]:
    """Set ``allocator_limits`` on MLX's CUDA backend and return them as ``{"limit_bytes", "cache_limit_bytes",
    "pool_keep_bytes"}``; None (nothing set) on the CPU and on Metal, whose allocator sizes itself against the
    machine's unified memory.

    ``pool_keep_bytes`` (--cuda-pool-keep): how much freed memory the CUDA memory pool under MLX keeps reserved
    across synchronizations (``server.device_memory.DeviceMemory.set_release_threshold``); None leaves the driver's
    default (0: every block MLX's buffer cache gives back is unmapped at the next synchronization and mapped again at
    the next allocation of its size). ``pool_keep_bytes`` in the answer is None where it was not set or the driver
    refused."""
    import mlx.core as mx

    if not on_cuda():
        return None
    total, _ = device_memory()
    memory, cache = allocator_limits(budget_bytes, total)
    mx.set_memory_limit(memory)
    mx.set_cache_limit(cache)
    global CACHE_LIMIT_SET
    CACHE_LIMIT_SET = cache
    kept = None
    if pool_keep_bytes is not None:
        from server.device_memory import driver

        dm = driver()
        kept = int(pool_keep_bytes) if dm is not None and dm.set_release_threshold(pool_keep_bytes) else None
    return {"limit_bytes": memory, "cache_limit_bytes": cache, "pool_keep_bytes": kept}


CACHE_LIMIT_SET: Optional[int] = None  # what apply_allocator_limits gave MLX's buffer cache (MLX has no getter)
