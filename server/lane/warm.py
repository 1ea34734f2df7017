"""The engine's warm-up, run by the lane thread in steps: before the lane says it is ready, or behind the requests.

The warm-up (server.engine.warmup) pages the weights in and has MLX compile the kernels the first requests use: on
the H200 7-29 s of a start-up, nearly all of it kernel compiles. Run before ready, every client waits for all of it,
even one whose request needs a fraction of those kernels. So by default (``--warm-up behind``) the port opens as
soon as the weights are in and the lane thread runs, and the warm-up runs on the lane thread between requests, one
step at a time, only while the lane is idle:

- a grace first: no step before a request was served or ``grace_s`` passed since ready, so a request sent right
  after /health answers does not queue behind a step;
- after any work, a step waits for ``settle_s`` (5 s) of idleness, so a client that sends its next request within
  seconds of the last answer (an agent after a quick tool call) finds the lane free: a GPU's step compiles for up to
  ~12 s and cannot be cut short;
- between steps the lane looks for work again: a request waits for at most the one step in progress (each is about
  one --prefill-chunk forward or less);
- a step that raises ends the warm-up (logged once); the lane serves on, as it did when the warm-up ran before ready;
- while the kernel warmers (server.startup.warmers) compile the steps' kernels in processes of their own, no step runs
  (``hold_while``): the steps then find those kernels in the kernel cache. Requests never wait for the warmers.

``WarmUp`` holds the plan and the account; it decides nothing about the lane's queue. The lane asks ``delay()`` only
while it is idle and calls ``worked()`` after each tick that had work; the rule is unit-tested on a fake clock
(tests/unit/test_warm_up.py). /stats shows ``as_dict()`` as ``lane.warm_up``.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Callable, Optional, Sequence

from server.lane.seam import WarmStep

__all__ = ["WarmMode", "WarmState", "WarmUp"]

log = logging.getLogger("mlx_lane.lane")


class WarmMode(str, enum.Enum):
    """--warm-up."""

    BEFORE_READY = "before-ready"  # every step before the port opens (the old behaviour)
    BEHIND = "behind"  # ready at once; the steps run while the lane is idle
    OFF = "off"  # no warm-up: the first requests compile what they use


class WarmState(str, enum.Enum):
    PENDING = "pending"  # no step run yet
    RUNNING = "running"  # some steps run, some left
    DONE = "done"
    FAILED = "failed"  # a step raised: the rest were dropped
    OFF = "off"


GRACE_S = 1.5  # after ready, before the first step when no request came
# of idleness after the lane's last work, before the next step. A GPU's step compiles for seconds and cannot be cut
# short: at 0.25 s, a RAM hit sent 0.5 s after the previous answer waited 4.7-12.2 s behind a Llama-3-8B step on the
# H200 (BENCHMARKS.md, 2026-12-07, fourteenth session), where an agent's next turn after a quick tool call comes
# within a second or two. So the warm-up waits for a pause longer than such turns
SETTLE_S = 5.0
HOLD_POLL_S = 0.5  # how often a held warm-up asks again whether the kernel warmers are done


class WarmUp:
    """The warm-up's steps, which of them ran, and when the next one is due. Lane thread only, but ``as_dict`` and
    ``finished`` (plain reads, for /stats and /health)."""

    def __init__(self, mode: WarmMode | str = WarmMode.BEHIND, *, grace_s: float = GRACE_S,
                 settle_s: float = SETTLE_S, clock: Callable[[], float] = time.monotonic):
        self.mode = WarmMode(mode)
        self.grace_s, self.settle_s, self._clock = grace_s, settle_s, clock
        self.state = WarmState.OFF if self.mode == WarmMode.OFF else WarmState.PENDING
        self._steps: Sequence[WarmStep] = ()
        self.steps_done = 0
        self.seconds = 0.0  # spent running steps (not the idle time between them)
        self._ready_at: Optional[float] = None
        self._last_work: Optional[float] = None  # the end of the lane's last tick with work, since ready
        self._hold: Callable[[], bool] = lambda: False

    # -- the plan --------------------------------------------------------------------------------------------------
    def load(self, steps: Sequence[WarmStep]) -> None:
        """The engine's steps, in order (lane thread, once its stream is bound). Nothing to run is done at once."""
        if self.state != WarmState.PENDING:
            return
        self._steps = tuple(steps)
        if not self._steps:
            self.state = WarmState.DONE

    def fail(self, what: str) -> None:
        """The steps could not even be planned: log it and warm nothing (the lane serves on)."""
        log.exception("warm-up: %s failed; serving without a warm-up", what)
        self.state = WarmState.FAILED

    def hold_while(self, busy: Callable[[], bool]) -> None:
        """No step while ``busy()``: the kernel warmers (server.startup.warmers) compile the steps' kernels in other
        processes meanwhile, and a step now would compile them a second time, a request waiting behind it."""
        self._hold = busy

    @property
    def finished(self) -> bool:
        """No step will run any more: done, failed or off."""
        return self.state not in (WarmState.PENDING, WarmState.RUNNING)

    # -- before ready ----------------------------------------------------------------------------------------------
    def run_all(self) -> None:
        """Every step now, in order, until one fails (--warm-up before-ready)."""
        while self._hold():  # the warmers' kernels, then the steps find them compiled
            time.sleep(HOLD_POLL_S)
        while not self.finished:
            self.step()

    # -- behind the requests ---------------------------------------------------------------------------------------
    def on_ready(self) -> None:
        """The lane serves from now on: the grace starts."""
        self._ready_at = self._clock()

    def worked(self) -> None:
        """The lane just ran a tick that had work: the grace is over, and the next step waits to settle."""
        self._last_work = self._clock()

    def delay(self) -> Optional[float]:
        """Asked while the lane is idle: seconds until the next step is due (0.0: now), or None when no step will
        come (finished, --warm-up before-ready or off, or the lane not ready yet). The caller waits that long for
        work, then asks again."""
        if self.finished or self.mode != WarmMode.BEHIND or self._ready_at is None:
            return None
        if self._hold():
            return HOLD_POLL_S
        if self._last_work is not None:
            due = self._last_work + self.settle_s
        else:
            due = self._ready_at + self.grace_s
        return max(0.0, due - self._clock())

    # -- one step --------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Run the next step (lane thread, the lane idle). A step that raises is logged and ends the warm-up."""
        if self.finished:
            return
        step = self._steps[self.steps_done]
        self.state = WarmState.RUNNING
        started = self._clock()
        try:
            step.run()
        except Exception:
            log.exception("warm-up step %r failed; serving on without the rest of the warm-up", step.name)
            self.state = WarmState.FAILED
            return
        finally:
            self.seconds += self._clock() - started
        self.steps_done += 1
        log.debug("warm-up: %s done (%d of %d)", step.name, self.steps_done, len(self._steps))
        if self.steps_done == len(self._steps):
            self.state = WarmState.DONE
            log.info("warm-up done (%s): %d steps in %.1fs", self.mode.value, self.steps_done, self.seconds)

    def as_dict(self) -> dict:
        """/stats ``lane.warm_up``."""
        return {"mode": self.mode.value, "state": self.state.value, "steps_done": self.steps_done,
                "steps": len(self._steps), "seconds": round(self.seconds, 3)}
