"""A range of the lane's batch steps or prefill forwards under a CUDA profiler (``--debug-cuda-profile-steps``).

Nsight Compute started with ``--profile-from-start off`` measures only the kernels launched between the driver's
``cuProfilerStart`` and ``cuProfilerStop``. With a range ``A:B`` set, the lane starts the profiler before its A-th
batch decode step (counted from 1 over every group's batches, speculating ones included) and stops it after its B-th,
waiting for the device at both ends, so the range holds exactly those steps' kernels: what a served step runs, to set
beside one in-process (bench/gpu_kernel_times.py; bench/gpu_agents.py --ncu-ours runs a server so). With
``prefill:A:B`` it counts the lane's prefill calls instead (one a tick per group: a forward of one or several rows,
with the stores it makes). Without a CUDA driver the calls do nothing (the CPU). Lane thread only.
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


KINDS = ("step", "prefill")  # what a range counts: batch decode steps, or the lane's prefill calls


class StepRange:
    """The lane's ``kind`` calls ``first``..``last`` (1-based, inclusive) between a profiler's start and stop."""

    def __init__(self, first: int, last: int, profiler: Callable[[bool], bool] = driver_profiler,
                 synchronize: Callable[[], None] = _synchronize, kind: str = "step"):
        if not 1 <= first <= last:
            raise ValueError(f"a profiled range needs 1 <= A <= B, got {first}:{last}")
        if kind not in KINDS:
            raise ValueError(f"a profiled range counts one of {', '.join(KINDS)}, not {kind!r}")
        self.first, self.last, self.kind = first, last, kind
        self._profiler, self._synchronize = profiler, synchronize
        self.steps = 0  # batch steps begun so far
        self.started: Optional[bool] = None  # what cuProfilerStart answered (None: not reached yet)

    @classmethod
    def parse(cls, spec: str) -> Optional["StepRange"]:
        """``"A:B"`` batch steps (``"A"``: one), ``"prefill:A:B"`` prefill calls; ``""`` is no range. A malformed spec is
        a ValueError that says the form."""
        spec = spec.strip()
        if not spec:
            return None
        kind, _, rest = spec.partition(":") if spec.split(":")[0] in KINDS else ("step", "", spec)
        first, colon, last = rest.partition(":")
        try:
            return cls(int(first), int(last if colon else first), kind=kind)
        except ValueError as exc:
            raise ValueError(f"--debug-cuda-profile-steps {spec!r}: expected A:B (the first and last batch steps to "
                             f"profile, 1-based, e.g. 200:203) or prefill:A:B (prefill calls) ({exc})") from None

    @property
    def done(self) -> bool:
        return self.steps >= self.last

    def before_step(self) -> None:
        self.steps += 1
        if self.steps == self.first:
            self._synchronize()  # the steps before stay outside the range
            self.started = self._profiler(True)
            log.warning("CUDA profiler range: %s %d..%d begin (cuProfilerStart %s)", self.noun, self.first,
                        self.last, "ok" if self.started else "unavailable")

    def after_step(self) -> None:
        if self.steps == self.last:
            self._synchronize()  # the last step's kernels, pipelined, finish inside the range
            self._profiler(False)
            log.warning("CUDA profiler range: %s %d..%d done", self.noun, self.first, self.last)

    @property
    def noun(self) -> str:
        return "batch steps" if self.kind == "step" else "prefill calls"


_range: Optional[StepRange] = None


def configure(spec: str) -> None:
    """The range the lane profiles (``--debug-cuda-profile-steps``; ``""``: none)."""
    global _range
    _range = StepRange.parse(spec)


def current(kind: str = "step") -> Optional[StepRange]:
    """The configured range of ``kind`` while it has calls left; None otherwise (the lane's fast path)."""
    return _range if _range is not None and _range.kind == kind and not _range.done else None
