"""When is reading KV from SSD cheaper than recomputing it? Policy only: no I/O, no MLX.

    restore  iff  nbytes / read_rate  <  saved_tokens / prefill_rate

Both rates are exponential moving averages of what this process measured: prefill tokens/s of this model on this
machine (fed by the lane, `observe_prefill`: the compute rate, a forward of several prompts charged to each by its
share of the tokens, not the wall time each waited) and SSD read bytes/s (fed by the SSD tier's restores,
`observe_restore`). Until a rate has been measured its prior holds. The answer differs by machine: on a 2-core CPU
a restore wins ~250x; on an H200 an 8B bf16 model recomputes 32k tokens in 2.0 s while reading their 4.3 GB of KV
takes 4.0 s. The same rule decides prefetch.

The same rule also decides what is worth writing at all (`worth_writing`): an entry that could never be restored
faster than recomputed is not written in "auto" mode (on an H200 the write-behind of such entries cost 8-18% of
decode under load and could never pay back; declined, the SSD tier costs nothing measurable); on this kind of CPU
every entry is.

`mode` overrides the rule: "always" restores whenever the disk holds more tokens, "never" always recomputes
(rates are still measured and reported), "auto" (default) applies it. Only "auto" declines writes.

Thread-safe: the lane observes prefill while I/O threads observe restores and the event loop asks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["CostModel", "load_cost_model", "save_cost_model"]

log = logging.getLogger("mlx_lane.cache")

_MIN_SECONDS = 1e-6  # a sample timed below the clock's resolution says nothing about the rate


class CostModel:
    """Measured prefill and SSD read rates, and the restore-or-recompute decision built on them."""

    MODES = ("auto", "always", "never")

    def __init__(self, *, prefill_tok_s: float = 100.0, read_bytes_s: float = 500e6, alpha: float = 0.3,
                 mode: str = "auto") -> None:
        if prefill_tok_s <= 0 or read_bytes_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("rates must be > 0 and 0 < alpha <= 1")
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {', '.join(self.MODES)}, not {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._alpha = alpha
        self._prefill = float(prefill_tok_s)
        self._read = float(read_bytes_s)
        self._prefill_samples = 0
        self._read_samples = 0
        self._restore = 0
        self._recompute = 0
        self._declined = 0  # writes worth_writing declined

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One prefill of `tokens` tokens took `seconds`. The first sample replaces the prior."""
        if tokens <= 0 or seconds < _MIN_SECONDS:
            return
        with self._lock:
            self._prefill = self._ema(self._prefill, tokens / seconds, self._prefill_samples)
            self._prefill_samples += 1

    def observe_restore(self, nbytes: int, seconds: float) -> None:
        """One SSD restore read `nbytes` in `seconds` (file read + rebuild, as a request experiences it)."""
        if nbytes <= 0 or seconds < _MIN_SECONDS:
            return
        with self._lock:
            self._read = self._ema(self._read, nbytes / seconds, self._read_samples)
            self._read_samples += 1

    def should_restore(self, nbytes: int, saved_tokens: int) -> bool:
        """True when reading `nbytes` is expected to beat prefilling `saved_tokens`. Counts the decision."""
        with self._lock:
            if saved_tokens <= 0 or self.mode == "never":
                restore = False
            elif self.mode == "always":
                restore = True
            else:
                restore = nbytes / self._read < saved_tokens / self._prefill
            if restore:
                self._restore += 1
            else:
                self._recompute += 1
            return restore

    def worth_writing(self, nbytes: int, tokens: int) -> bool:
        """Could an entry of `nbytes` covering `tokens` ever be restored faster than it is recomputed here? Always
        True unless the mode is "auto"; counts the writes it declines."""
        with self._lock:
            if self.mode != "auto" or tokens <= 0 or nbytes / self._read < tokens / self._prefill:
                return True
            self._declined += 1
            return False

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"prefill_tok_s": round(self._prefill, 2), "prefill_measured": self._prefill_samples > 0,
                    "read_mb_s": round(self._read / 1e6, 2), "read_measured": self._read_samples > 0,
                    "mode": self.mode, "decisions_restore": self._restore, "decisions_recompute": self._recompute,
                    "writes_declined": self._declined}

    def snapshot(self) -> dict[str, float]:
        """The measured rates (only those measured), to carry across a restart."""
        with self._lock:
            out: dict[str, float] = {}
            if self._prefill_samples:
                out["prefill_tok_s"] = self._prefill
            if self._read_samples:
                out["read_bytes_s"] = self._read
            return out

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any], **kw: Any) -> "CostModel":
        """A model that starts from rates measured in an earlier run (they count as measured, so the
        first decision after a restart uses this machine's rates, not the priors)."""
        model = cls(**kw)
        for key, attr, count in (("prefill_tok_s", "_prefill", "_prefill_samples"),
                                 ("read_bytes_s", "_read", "_read_samples")):
            value = snap.get(key)
            if isinstance(value, (int, float)) and 0 < value < float("inf"):
                setattr(model, attr, float(value))
                setattr(model, count, 1)
        return model

    def _ema(self, old: float, sample: float, samples: int) -> float:
        return sample if samples == 0 else self._alpha * sample + (1 - self._alpha) * old


def load_cost_model(path: Path, mode: str = "auto") -> CostModel:
    """The restore-or-recompute model, seeded with the rates this model measured here last time (``path``, written
    by ``save_cost_model``): right after a restart (when the SSD tier matters most) the priors could pick a restore
    that a GPU recomputes faster. A missing or unreadable file: the priors."""
    try:
        return CostModel.from_snapshot(json.loads(Path(path).read_text()), mode=mode)
    except (OSError, ValueError, AttributeError):
        return CostModel(mode=mode)


def save_cost_model(path: Path, cost: CostModel) -> None:
    """Keep the measured rates for the next start (atomically; nothing measured: nothing written)."""
    snap = cost.snapshot()
    if not snap:
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snap))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not save the measured cache rates to %s: %s", path, exc)
