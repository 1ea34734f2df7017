"""Which errors leave the GPU unusable for this process, and what the client is told.

CUDA reports some faults as *sticky*: after an illegal memory access (or a failed kernel launch, a device-side assert,
an uncorrectable ECC error) every later call in the same process fails too, with the same error. On an H100 whose
memory ran out mid-prefill, MLX's next allocation failed that way and every request after it ended in a 500 until the
process was restarted (BENCHMARKS.md, 2026-12-06, third session). A lane that sees one stops taking work: the
requests in it end with ``DeviceLost`` (a 503 that says to restart), ``/health`` answers 503, and the server exits
non-zero (``EXIT_CODE``) so that whatever supervises it (systemd, Docker's restart policy, Kubernetes) starts a
fresh process. Out-of-memory alone is not sticky: a request that ran out of memory fails, the lane serves on.
"""

from __future__ import annotations

from typing import Optional

from server.errors import DeviceLost

__all__ = ["EXIT_CODE", "device_lost_reason", "device_lost_error"]

EXIT_CODE = 3  # `mlx-lane serve`'s exit status after a device loss (2: the model did not load)

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
