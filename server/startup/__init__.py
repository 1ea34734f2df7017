"""The start-up: its timeline (here) and the kernel warmers that may run beside it (warmers.py, the server's side;
warmer.py, a warmer's own process: ``python -m server.startup.warmer``).

A start-up timeline: where the seconds between launching `mlx-lane serve` and answering ready went.

``TIMELINE.mark(phase)`` ends a phase (its seconds since the previous mark); each mark is logged at debug level, the
whole line at info once the server is ready (``summary``), and /stats shows it (``startup``). The first phase starts
when the process started (the kernel's own start time of this process, so the interpreter's start and the imports
before this module count too), not when this module was imported.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

__all__ = ["Timeline", "TIMELINE", "process_age"]

log = logging.getLogger("mlx_lane.startup")


def process_age() -> Optional[float]:
    """Seconds since this process started (Linux: /proc/self/stat's start time), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / ticks)
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    def __init__(self):
        age = process_age()
        self._start = time.monotonic() - (age or 0.0)  # when the process started
        self._last = self._start
        self.phases: list[tuple[str, float]] = []
        self.ready_s: Optional[float] = None
        self._details: dict[str, Callable[[], dict]] = {}

    def mark(self, phase: str) -> float:
        """End ``phase`` now; returns its seconds."""
        now = time.monotonic()
        seconds, self._last = now - self._last, now
        self.phases.append((phase, seconds))
        log.debug("start-up: %s %.2fs (at %.2fs)", phase, seconds, now - self._start)
        return seconds

    def ready(self) -> str:
        """The server answers ready now: the summary line (logged at info by the caller)."""
        self.ready_s = time.monotonic() - self._start
        return self.summary()

    def summary(self) -> str:
        total = self.ready_s if self.ready_s is not None else time.monotonic() - self._start
        parts = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.phases if seconds >= 0.05)
        return f"ready {total:.1f}s after the process started ({parts})"

    def attach(self, name: str, describe: Callable[[], dict]) -> None:
        """A part of the start-up that goes on after ready (the kernel warmers): /stats ``startup.<name>``."""
        self._details[name] = describe

    def as_dict(self) -> dict:
        return {"ready_s": round(self.ready_s, 3) if self.ready_s is not None else None,
                "phases": {name: round(seconds, 3) for name, seconds in self.phases},
                **{name: describe() for name, describe in self._details.items()}}


TIMELINE = Timeline()
