"""What the SSD writer hands the host to read (cache.kvfile.save): an entry's own arrays, or, with
--debug-ssd-host-copies on CUDA, copies made on the device (serve.py sets it through `configure`).

On CUDA the host's first read of an array (``Buffer::raw_ptr``) moves its buffer to managed memory for good (mlx 0.32,
``move_to_unified_memory``): the RAM tier's entry and every fork sharing its buffers then reach the GPU through page
faults. A copy moves instead and dies with the write. Off by default: copies measured slower on the H200 with gpt-oss
(BENCHMARKS.md, 2026-12-04 night), and one H100 pair with Qwen3.5-9B settled nothing (2026-12-06).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["configure", "host_read_copies"]

_HOST_COPIES = False


def configure(host_copies: bool = False) -> None:
    """The process's setting: whether `save` reads device copies on CUDA (``host_read_copies``)."""
    global _HOST_COPIES
    _HOST_COPIES = bool(host_copies)


def _device_has_own_memory() -> bool:
    """True where the GPU's arrays live apart from the host's (MLX's CUDA backend); False on Metal and the CPU."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)


def host_read_copies(arrays: dict[str, mx.array], *, own_memory: bool | None = None) -> dict[str, mx.array]:
    """What `save` hands the host to read: `arrays` themselves unless copies are asked for (`configure`) on a device
    with its own memory (``own_memory`` overrides the check), else copies made on the device by the calling thread's
    stream, evaluated. Values kept bit for bit (x * 1 in x's own dtype; booleans x & True)."""
    if own_memory is None:
        own_memory = _HOST_COPIES and _device_has_own_memory()
    if not own_memory:
        return arrays
    out = {k: (x & True) if x.dtype == mx.bool_ else x * mx.array(1, dtype=x.dtype) for k, x in arrays.items()}
    mx.eval(list(out.values()))
    return out
