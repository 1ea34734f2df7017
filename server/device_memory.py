"""What a CUDA card really holds, read from the driver (``libcuda``), beside what MLX's allocator counts.

MLX's counters (``mx.get_active_memory`` / ``get_cache_memory``) see only MLX's own buffers. The card also holds the
CUDA context, cuBLAS / cuDNN kernels and workspaces, and the slack of the stream-ordered memory pool that
``cudaMallocAsync`` draws from (freed blocks the pool keeps reserved). On an H100 80GB with 16 Llama-3-8B agents
nvidia-smi read 81 GB while MLX counted 64-68 GB (BENCHMARKS.md, 2026-12-06), and prefills failed out of memory.
This module reads the card's used memory and the default pool's reserved / used bytes, and trims the pool's slack.

One job: the driver calls (mechanism). Who acts on the numbers is server.memory's and the lane's (policy). Every
function answers None / does nothing where there is no CUDA driver (the CPU, Metal), so callers need no guard.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Optional

log = logging.getLogger("mlx_lane")

__all__ = ["DeviceMemory", "driver", "snapshot", "trim_pool"]

# CUmemPool_attribute (cuda.h)
_RELEASE_THRESHOLD = 4
_RESERVED_MEM_CURRENT = 5
_RESERVED_MEM_HIGH = 6
_USED_MEM_CURRENT = 7
_USED_MEM_HIGH = 8
# CUgraphMem_attribute (cuda.h): the memory CUDA graphs' own allocation nodes hold (a pool apart from the one above)
_GRAPH_USED_MEM_CURRENT = 0
_GRAPH_RESERVED_MEM_CURRENT = 2
_GRAPH_RESERVED_MEM_HIGH = 3


class DeviceMemory:
    """The CUDA driver for one device (``ordinal``, MLX's default: 0), through ctypes. Calls bind the device's
    primary context (the one MLX's runtime uses) to the calling thread first; a failed call answers None."""

    def __init__(self, lib, ordinal: int = 0):
        self._lib = lib
        self._lock = threading.Lock()
        self._ctx = ctypes.c_void_p()
        self._pool = ctypes.c_void_p()
        dev = self._dev = ctypes.c_int()
        self._ok = (lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
                    and lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev) == 0)
        self._has_pool = self._ok and lib.cuDeviceGetDefaultMemPool(ctypes.byref(self._pool), dev) == 0

    def _bind(self) -> bool:
        return self._ok and self._lib.cuCtxSetCurrent(self._ctx) == 0

    def card(self) -> Optional[tuple[int, int]]:
        """(used, total) bytes of the whole card, as nvidia-smi counts them (every process on it)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self._lock:
            if not self._bind() or self._lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
                return None
        return total.value - free.value, total.value

    def pool(self, attribute: int) -> Optional[int]:
        """One attribute of the device's default memory pool (the one ``cudaMallocAsync`` draws from), in bytes."""
        value = ctypes.c_uint64()
        with self._lock:
            if not self._has_pool or not self._bind():
                return None
            if self._lib.cuMemPoolGetAttribute(self._pool, attribute, ctypes.byref(value)) != 0:
                return None
        return value.value

    def graph_memory(self, attribute: int) -> Optional[int]:
        """One attribute of the memory CUDA graphs allocate for themselves on this device, in bytes."""
        value = ctypes.c_uint64()
        with self._lock:
            if not self._bind() or self._lib.cuDeviceGetGraphMemAttribute(self._dev, attribute,
                                                                          ctypes.byref(value)) != 0:
                return None
        return value.value

    def set_release_threshold(self, keep_bytes: int) -> bool:
        """Let the pool keep up to ``keep_bytes`` of freed memory reserved across synchronizations
        (``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD``). The driver's default, 0, gives every freed block back to the card at
        the next stream or context synchronization, so the next ``cudaMallocAsync`` of that size maps new memory."""
        value = ctypes.c_uint64(max(0, int(keep_bytes)))
        with self._lock:
            if not self._has_pool or not self._bind():
                return False
            return self._lib.cuMemPoolSetAttribute(self._pool, _RELEASE_THRESHOLD, ctypes.byref(value)) == 0

    def trim_pool(self, keep_bytes: int = 0) -> bool:
        """Give the pool's unused reserved memory back to the card, down to ``keep_bytes`` (``cuMemPoolTrimTo``)."""
        with self._lock:
            if not self._has_pool or not self._bind():
                return False
            trimmed = self._lib.cuMemPoolTrimTo(self._pool, ctypes.c_size_t(keep_bytes)) == 0
            self._lib.cuDeviceGraphMemTrim(self._dev)  # graphs' allocations no graph in flight holds
            return trimmed


@functools.lru_cache(maxsize=1)
def driver() -> Optional[DeviceMemory]:
    """The CUDA driver when MLX computes on a CUDA GPU; None elsewhere (no libcuda, or MLX on the CPU / Metal)."""
    from server.sizes import on_cuda

    if not on_cuda():
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        log.debug("no CUDA driver to read the card's memory from: %s", e)
        return None
    dm = DeviceMemory(lib)
    return dm if dm._ok else None


def snapshot(dm: Optional[DeviceMemory] = None) -> Optional[dict]:
    """The card's memory in bytes, for /stats ``memory.device``: ``used`` / ``total`` (the whole card),
    ``pool_reserved`` / ``pool_used`` (and their high-water marks) of the memory pool MLX allocates from, and
    ``pool_keep`` (freed memory the pool keeps reserved across synchronizations: --cuda-pool-keep), ``outside_pool``
    (used less the pool's reserve: the CUDA context, libraries' kernels and workspaces, CUDA
    graphs' own memory, other processes), ``graph_reserved`` / ``graph_used`` (what CUDA graphs' allocation nodes
    hold, part of ``outside_pool``). None without a CUDA driver."""
    dm = dm if dm is not None else driver()
    if dm is None:
        return None
    card = dm.card()
    if card is None:
        return None
    used, total = card
    reserved = dm.pool(_RESERVED_MEM_CURRENT)
    return {"used_bytes": used, "total_bytes": total, "pool_reserved_bytes": reserved,
            "pool_used_bytes": dm.pool(_USED_MEM_CURRENT), "pool_reserved_high_bytes": dm.pool(_RESERVED_MEM_HIGH),
            "pool_used_high_bytes": dm.pool(_USED_MEM_HIGH), "pool_keep_bytes": dm.pool(_RELEASE_THRESHOLD),
            "outside_pool_bytes": None if reserved is None else used - reserved,
            "graph_reserved_bytes": dm.graph_memory(_GRAPH_RESERVED_MEM_CURRENT),
            "graph_reserved_high_bytes": dm.graph_memory(_GRAPH_RESERVED_MEM_HIGH),
            "graph_used_bytes": dm.graph_memory(_GRAPH_USED_MEM_CURRENT)}


def trim_pool(keep_bytes: int = 0) -> bool:
    """Synchronize MLX, empty its buffer cache, then give the pool's slack back to the card. False (nothing done
    beyond MLX's cache) without a CUDA driver."""
    import mlx.core as mx

    mx.synchronize()
    mx.clear_cache()
    dm = driver()
    return dm is not None and dm.trim_pool(keep_bytes)
