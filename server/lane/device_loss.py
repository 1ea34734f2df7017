"""Which errors leave the GPU unusable for this process, and what the client is told.

CUDA reports some faults as *sticky*: after an illegal memory access (or a failed kernel launch, a device-side assert,
an uncorrectable ECC error) every later call in the same process fails too, with the same error. On an H100 whose
memory ran out mid-prefill, MLX's next allocation failed that way and every request after it ended in a 500 until the
process was restarted (BENCHMARKS.md, 2026-12-06, third session). A lane that sees one stops taking work: the
requests in it end with ``DeviceLost`` (a 503 that says to restart), ``/health`` answers 503, and the server exits
non-zero (``EXIT_CODE``) so that whatever supervises it (systemd, Docker's restart policy, Kubernetes) starts a
fresh process. Out-of-memory alone is not sticky (``is_out_of_memory``): a prompt whose prefill ran out of memory goes
back to the front of the queue after the RAM tier yields a quarter of what it holds (``MAX_OOM_RETRIES`` times at most,
nothing of it having reached the client yet), and the lane serves on.
"""

from __future__ import annotations

from typing import Optional

from server.errors import DeviceLost

__all__ = ["EXIT_CODE", "MAX_OOM_RETRIES", "device_lost_reason", "device_lost_error", "is_out_of_memory"]

EXIT_CODE = 3  # `mlx-lane serve`'s exit status after a device loss (2: the model did not load)
MAX_OOM_RETRIES = 2  # a prompt's prefill runs out of memory this many times before its request fails

# CUDA's sticky errors, as cudaGetErrorString words them (what MLX's RuntimeError carries)
_STICKY = (
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "device-side assert triggered",
    "uncorrectable ECC error encountered",
    "hardware stack error",
    "the launch timed out and was terminated",
)


def device_lost_reason(exc: BaseException) -> Optional[str]:
    """The error's own words when ``exc`` is one of CUDA's sticky errors (or already a ``DeviceLost``), else None."""
    if isinstance(exc, DeviceLost):
        return exc.reason
    text = str(exc)
    if any(words in text for words in _STICKY):
        return text[:300]
    return None


def device_lost_error(reason: str) -> DeviceLost:
    """What every request in the lane, and every one after, is told."""
    return DeviceLost(f"The GPU reported an error this process cannot recover from ({reason}); the server is "
                      f"restarting (it exits with status {EXIT_CODE} for its supervisor to start it again).",
                      reason=reason)


def is_out_of_memory(exc: BaseException) -> bool:
    """MLX could not allocate (CUDA's ``out of memory``, MLX's own ``Unable to allocate``) and the device is not lost."""
    text = str(exc)
    return device_lost_reason(exc) is None and ("out of memory" in text or "Unable to allocate" in text)
