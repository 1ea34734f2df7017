"""A minimal progress bar on stderr (no dependency); silent when disabled."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """`done/total` bar redrawn in place on stderr; `close()` ends the line with the elapsed time."""

    def __init__(self, label: str, total: int, *, enabled: bool = True, unit: str = "tensors", width: int = 30):
        self.label, self.total, self.enabled, self.unit, self.width = label, max(int(total), 1), enabled, unit, width
        self.done = 0
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            self._draw()

    def _draw(self, end: str = "") -> None:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {self.unit}{end}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(end=f" ({time.monotonic() - self._start:.1f}s)\n")
