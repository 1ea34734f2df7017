"""One request's generation state, as the lane advances it one token at a time.

A ``Sequence`` is pure Python (no MLX): it turns each sampled token into what the client sees and decides when
the request is over. The lane feeds it with ``on_token(token, logprobs)``, whatever produced the token (the
batch, a solo decode, a speculative step), and it answers ``None`` (go on) or a finish reason:

    "stop"       EOS, or a stop string appeared (the text before it was emitted; the stop string never is)
    "length"     max_tokens reached
    "cancelled"  the job's cancel flag was set (client gone, or the server's shutdown timeout)

Contract:
- every call emits at most one ``Delta`` through ``job.sink`` (text already passed through the stop matcher, so
  a partial stop string is held back and never emitted); the first token's ``Delta`` has ``first_token=True``
  even when its text is held back (so time-to-first-token is measured at the token, not at the text);
- when a call returns "stop" (EOS) or "length", the held-back text is released first; after a stop string or a
  cancellation nothing more is emitted;
- ``finished(reason)`` builds the one ``Finished`` event (the lane sends it after storing the caches).

Lifecycle (``state``): WAITING -> PREFILL -> DECODE -> FINISHED; the lane owns the transitions.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from server.jobs import Delta, Finished, Job
from server.stops import StopMatcher


class SeqState(enum.Enum):
    WAITING = "waiting"  # in the lane's queue
    PREFILL = "prefill"  # admitted: cache taken, prompt chunks being computed
    DECODE = "decode"  # producing tokens (in the batch or solo)
    FINISHED = "finished"


@dataclass
class Timings:
    admitted_at: float = 0.0
    prefill_started: float = 0.0
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None


@dataclass
class Sequence:
    job: Job
    detokenizer: object  # a fresh mlx-lm streaming detokenizer (tokenizer.detokenizer hands out copies)
    eos: frozenset
    logprob_of: Optional[Callable] = None  # (logprobs, token) -> TokenLogprob, when the request asked for them
    state: SeqState = SeqState.WAITING
    cached: int = 0  # prompt tokens served by the prefix cache
    generated: list = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    spec: Optional[dict] = None  # speculative counters, set by a speculative decode when it finishes

    def __post_init__(self):
        self._stops = StopMatcher(list(self.job.params.stop))
        self.detokenizer.reset()

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def prompt(self) -> list:
        return self.job.prompt

    @property
    def cancelled(self) -> bool:
        return self.job.cancel.is_set()

    def on_token(self, token: int, logprobs=None, now: Optional[float] = None) -> Optional[str]:
        """Take one sampled token; emit what is safe to show; return a finish reason or None."""
        now = time.monotonic() if now is None else now
        if self.timings.first_token_at is None:
            self.timings.first_token_at = now
        self.generated.append(token)
        first = len(self.generated) == 1
        if token in self.eos:
            tail = self._release_tail()
            if tail or first:
                self.job.sink(Delta(tail, first_token=first))
            return "stop"
        self.detokenizer.add_token(token)
        text = self._stops.feed(self.detokenizer.last_segment)
        lp = (self.logprob_of(logprobs, token),) if self.logprob_of is not None and logprobs is not None else ()
        if self._stops.stopped:
            self.job.sink(Delta(text, lp, first_token=first))
            return "stop"
        if len(self.generated) >= self.job.params.max_tokens:
            self.job.sink(Delta(text + self._release_tail(), lp, first_token=first))
            return "length"
        self.job.sink(Delta(text, lp, first_token=first))
        if self.cancelled:
            return "cancelled"
        return None

    def _release_tail(self) -> str:
        self.detokenizer.finalize()
        return self._stops.feed(self.detokenizer.last_segment) + self._stops.flush()

    def finished(self, reason: str, now: Optional[float] = None) -> Finished:
        now = time.monotonic() if now is None else now
        t = self.timings
        t.finished_at = now
        self.state = SeqState.FINISHED
        first = t.first_token_at
        return Finished(
            finish_reason=reason,
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.generated),
            cached_tokens=self.cached,
            prefill_tokens=(len(self.prompt) - self.cached) if first is not None else 0,
            prefill_s=(first - t.prefill_started) if first is not None else 0.0,
            decode_tokens=max(0, len(self.generated) - 1),
            decode_s=(now - first) if first is not None else 0.0,
            queued_s=max(0.0, (t.admitted_at or now) - self.job.enqueued_at),
            spec=self.spec,
            stop_sequence=self._stops.matched if reason == "stop" else None,
        )
