"""Stop-string handling for streamed text.

``StopMatcher.feed(text)`` takes newly detokenized text and returns what is safe to emit
now: text that cannot be the start of a stop string is released, a suffix that could
still grow into a stop string is held back, and once a stop string appears the text
before it is released and ``stopped`` becomes True. The held-back suffix is released by
``flush()`` when generation ends for another reason. A partial stop string is therefore
never emitted, even when it is split across many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopMatcher:
    stops: list[str]
    stopped: bool = False
    matched: str | None = None  # the stop string that ended the text, once stopped
    _pending: str = field(default="", repr=False)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        first = None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (first is None or i < first):
                first, self.matched = i, s
        if first is not None:
            self.stopped = True
            self._pending = ""
            return buf[:first]
        hold = self._longest_partial_suffix(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _longest_partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
