"""How many tokens to draft next round: the policy, kept apart from the verify mechanism.

A policy answers ``next_length()`` (0 = do not draft; once ``stopped`` it answers 0 for the
rest of the request) and learns from ``update(drafted, accepted)`` after each round that
drafted something. One policy object per request; not thread-safe (the lane owns it).

Why acceptance decides whether drafting pays: decode is bandwidth-bound, so a target forward
over n+1 tokens costs about one plain step plus a small ``verify_overhead`` per extra token,
and a draft step costs ``cost_ratio`` of a target step (0 for prompt lookup). A round of n
drafts with acceptance rate r yields 1 + r*n tokens for 1 + (cost_ratio + verify_overhead)*n
target steps, which beats plain decoding only when r > cost_ratio + verify_overhead. So
``AdaptiveDraftLength`` stops drafting once the acceptance over its recent window is below
that break-even, after a short warm-up; it grows the length after a fully accepted round and
shrinks it after a round that kept less than half.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Protocol

__all__ = ["DraftPolicy", "FixedDraftLength", "AdaptiveDraftLength", "BatchVerifyCost", "break_even_rate"]

# A target forward over n+1 tokens costs ~ (1 + VERIFY_OVERHEAD * n) plain steps on a
# bandwidth-bound machine (measured on the CPU: a 4-token forward ~1.2-1.3x a 1-token one).
VERIFY_OVERHEAD = 0.08


def break_even_rate(cost_ratio: float, verify_overhead: float = VERIFY_OVERHEAD) -> float:
    """The acceptance rate below which drafting with this cost ratio loses wall-clock."""
    return cost_ratio + verify_overhead


class DraftPolicy(Protocol):
    """A request's draft length, round by round (see the module docstring). A speculating batch reads its recent
    acceptance and raises its break-even to what a drafted token costs there (server.engine.batch.speculating)."""

    # the acceptance below which it stops or pauses drafting (None: it never does, whatever it accepts)
    stop_below: Optional[float]

    @property
    def stopped(self) -> bool: ...

    @property
    def recent_rate(self) -> float:
        """Accepted / drafted over its recent rounds (1.0 before any)."""
        ...

    def next_length(self) -> int: ...

    def update(self, drafted: int, accepted: int) -> None: ...


class FixedDraftLength:
    """Always draft ``n`` tokens (tests, and users who pin the length): it never stops, whatever it accepts."""

    def __init__(self, n: int):
        if n < 0:
            raise ValueError(f"draft length must be >= 0, got {n}")
        self.n = n
        self.stop_below: Optional[float] = None

    @property
    def stopped(self) -> bool:
        return self.n == 0

    @property
    def recent_rate(self) -> float:
        return 1.0  # not measured: a fixed length drafts whatever it accepts

    def next_length(self) -> int:
        return self.n

    def update(self, drafted: int, accepted: int) -> None:
        pass


class AdaptiveDraftLength:
    """Grow after full accepts, shrink after poor rounds, stop when drafting does not pay.

    - starts at ``start`` (default ``max_len``);
    - a round that accepted everything: length + 1 (up to ``max_len``);
    - a round that accepted less than half: length - 1 (down to ``min_len``);
    - after ``warmup`` drafted rounds, if accepted/drafted over the last ``window`` rounds is
      below ``stop_below``: with ``pause=None`` drafting stops for good (``stopped``;
      ``next_length() == 0``); with ``pause=P`` it pauses for P rounds (2P, 4P, up to 8P on
      repeated failures), then starts over at ``min_len`` with a fresh window. Pausing suits
      prompt lookup, whose usefulness comes and goes with what is being written (a copied
      block, then new prose); a second model is better stopped, as catching it up costs.
    """

    def __init__(
        self,
        max_len: int,
        *,
        min_len: int = 1,
        start: int | None = None,
        stop_below: float = break_even_rate(0.0),
        window: int = 8,
        warmup: int = 4,
        pause: int | None = None,
    ):
        if max_len < 1 or not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if window < 1 or warmup < 1 or (pause is not None and pause < 1):
            raise ValueError("window, warmup and pause must be >= 1")
        self.max_len = max_len
        self.min_len = min_len
        self.length = max_len if start is None else max(min_len, min(max_len, start))
        self.stop_below: Optional[float] = stop_below
        self.warmup = warmup
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)
        self._rounds = 0
        self._stopped = False
        self.pause = pause
        self._strikes = 0
        self._paused_for = 0

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def recent_rate(self) -> float:
        drafted = sum(d for d, _ in self._recent)
        return sum(a for _, a in self._recent) / drafted if drafted else 1.0

    def next_length(self) -> int:
        """The length for the coming round (called once per round: a pause counts down here)."""
        if self._stopped:
            return 0
        if self._paused_for:
            self._paused_for -= 1
            return 0
        return self.length

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0 or self._stopped or self._paused_for:
            return
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted={accepted} outside 0..drafted={drafted}")
        self._rounds += 1
        self._recent.append((drafted, accepted))
        if accepted == drafted:
            self.length = min(self.max_len, self.length + 1)
        elif 2 * accepted < drafted:
            self.length = max(self.min_len, self.length - 1)
        stop_below = self.stop_below if self.stop_below is not None else 0.0
        if self._rounds >= self.warmup and self.recent_rate < stop_below:
            if self.pause is None:
                self._stopped = True
                return
            self._paused_for = self.pause * 2 ** min(self._strikes, 3)
            self._strikes += 1
            self._rounds = 0
            self._recent.clear()
            self.length = self.min_len
        elif self._rounds >= self.warmup and self.recent_rate >= 2 * stop_below:
            self._strikes = 0


class BatchVerifyCost:
    """What a drafted token costs in a batched verify step, measured: the break-even acceptance for the batch.

    A step over B rows, W tokens each (1 + the longest draft: shorter rows are padded, and padding is computed too),
    takes about ``a*B + m*D`` seconds with D = B*(W - 1) the positions beyond a plain step: ``a`` is a row's share
    of a plain step, ``m`` what one more position in the forward adds. Drafts pay when the accepted fraction of those
    positions beats ``m / a`` (each accepted token saves a row a plain step's share, each position costs m). On a GPU
    a batched step is far from compute-bound and ``m / a`` is small; on this 2-core CPU the forward is compute-bound
    already at a few rows (4 rows of SmolLM2: 20 positions cost 3.3x a 4-position step, ``m / a`` ~0.5), so in a
    batch there drafts pay only when almost all are accepted. ``a`` and ``m`` are fitted (least squares, no intercept) over the last
    ``window`` steps; ``probe()`` asks for a step without drafts when none of the recent ones was, so the fit always
    sees both kinds. Until both are measured, ``break_even()`` is ``floor``. It may exceed 1 (up to ``cap``): a drafted
    token that costs more than a row's plain step (a draft model as big as the target, on a compute-bound CPU) never
    pays, however often it is accepted, and every row stops drafting (the batch still drafts now and then, to keep
    measuring). A cap below 1 (0.9 until the draft model joined the batch: n-gram drafts cost only their verify
    positions) would keep rows with ~100% acceptance drafting at any cost."""

    def __init__(self, window: int = 32, probe_every: int = 8, floor: float = VERIFY_OVERHEAD, cap: float = 1.1):
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.probe_every, self.floor, self.cap = probe_every, floor, cap
        self._since_plain = 0  # steps since the last one without drafts

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """One step: ``drafted`` = positions beyond one per row (B*(W-1))."""
        if rows <= 0 or seconds <= 0:
            return
        self._steps.append((rows, drafted, seconds))
        self._since_plain = 0 if drafted == 0 else self._since_plain + 1

    def probe(self) -> bool:
        """True when the coming step should draft nothing (to measure a plain step)."""
        return self._since_plain >= self.probe_every

    def coefficients(self) -> Optional[tuple[float, float]]:
        """(a, m) fitted over the recent steps, or None while the steps cannot tell them apart."""
        sbb = sum(b * b for b, _, _ in self._steps)
        sdd = sum(d * d for _, d, _ in self._steps)
        sbd = sum(b * d for b, d, _ in self._steps)
        sbt = sum(b * t for b, _, t in self._steps)
        sdt = sum(d * t for _, d, t in self._steps)
        det = sbb * sdd - sbd * sbd
        if sdd == 0 or det <= 1e-9 * max(sbb * sdd, 1e-30):
            return None
        a = (sbt * sdd - sdt * sbd) / det
        m = (sbb * sdt - sbd * sbt) / det
        return (a, m) if a > 0 else None

    def break_even(self) -> float:
        fit = self.coefficients()
        if fit is None:
            return self.floor
        a, m = fit
        return min(self.cap, max(self.floor, m / a))
