"""A range of the lane's batch steps under a CUDA profiler (``--debug-cuda-profile-steps A:B``).

Nsight Compute started with ``--profile-from-start off`` measures only the kernels launched between the driver's
``cuProfilerStart`` and ``cuProfilerStop``. With a range set, the lane starts the profiler before its A-th batch
decode step (counted from 1 over every group's batches, speculating ones included) and stops it after its B-th,
waiting for the device at both ends, so the range holds exactly those steps' kernels: what a served step runs, to set
beside one in-process (bench/gpu_kernel_times.py; bench/gpu_agents.py --ncu-ours runs a server so). Without a CUDA
driver the calls do nothing (the CPU). Lane thread only.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable, Optional

__all__ = ["StepRange", "configure", "current", "driver_profiler"]

log = logging.getLogger("mlx_lane.lane")


def driver_profiler(on: bool) -> bool:
    """cuProfilerStart / cuProfilerStop of the CUDA driver (no runtime version to match); False where there is none."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return (lib.cuProfilerStart() if on else lib.cuProfilerStop()) == 0


def _synchronize() -> None:
    import mlx.core as mx

    mx.synchronize()


class StepRange:
    """Batch steps ``first``..``last`` (1-based, inclusive) between a profiler's start and stop."""

    def __init__(self, first: int, last: int, profiler: Callable[[bool], bool] = driver_profiler,
                 synchronize: Callable[[], None] = _synchronize):
        if not 1 <= first <= last:
            raise ValueError(f"a profiled range of batch steps needs 1 <= A <= B, got {first}:{last}")
        self.first, self.last = first, last
        self._profiler, self._synchronize = profiler, synchronize
        self.steps = 0  # batch steps begun so far
        self.started: Optional[bool] = None  # what cuProfilerStart answered (None: not reached yet)

    @classmethod
    def parse(cls, spec: str) -> Optional["StepRange"]:
        """``"A:B"`` (or ``"A"`` for one step); ``""`` is no range. A malformed spec is a ValueError that says the form."""
        spec = spec.strip()
        if not spec:
            return None
        first, colon, last = spec.partition(":")
        try:
            return cls(int(first), int(last if colon else first))
        except ValueError as exc:
            raise ValueError(f"--debug-cuda-profile-steps {spec!r}: expected A:B, the first and last batch steps "
                             f"to profile (1-based), e.g. 200:203 ({exc})") from None

    @property
    def done(self) -> bool:
        return self.steps >= self.last

    def before_step(self) -> None:
        self.steps += 1
        if self.steps == self.first:
            self._synchronize()  # the steps before stay outside the range
            self.started = self._profiler(True)
            log.warning("CUDA profiler range: batch steps %d..%d begin (cuProfilerStart %s)", self.first, self.last,
                        "ok" if self.started else "unavailable")

    def after_step(self) -> None:
        if self.steps == self.last:
            self._synchronize()  # the last step's kernels, pipelined, finish inside the range
            self._profiler(False)
            log.warning("CUDA profiler range: batch steps %d..%d done", self.first, self.last)


_range: Optional[StepRange] = None


def configure(spec: str) -> None:
    """The range the lane profiles (``--debug-cuda-profile-steps``; ``""``: none)."""
    global _range
    _range = StepRange.parse(spec)


def current() -> Optional[StepRange]:
    """The configured range while it has steps left; None otherwise (the lane's fast path)."""
    return _range if _range is not None and not _range.done else None
