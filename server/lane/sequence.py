"""One request on the lane, from submission to its end: the one object every part of the lane shares.

A ``Sequence`` is made by the HTTP side (server.core.bridge) with what the request asks for: token ids, the
lane's ``SamplingParams``, the ``Target`` model that computes it, the cache namespace and session, and a
thread-safe ``sink`` for its events. The lane (server.lane.lane) moves it through one lifecycle:

    WAITING     in the lane's queue
    WAITING_IO  its cached prefix is being read from SSD; it is admitted once the read has landed (the read is
                never on the lane's clock) and keeps its place in the queue meanwhile
    PREFILL     admitted: the prefix cache was taken, prompt chunks are being computed
    READY       its prompt is computed (all but its last token, the first decode step's input): it starts decoding
                at the next start the scheduler plans
    SOLO        decoding on its own (speculative, caches that cannot join a batch, or its group's only sequence)
    BATCHED     decoding as a row of its group's batch
    FINISHED    ended, for a ``FinishReason``

The scheduler (server.lane.scheduler) reads the phase and the facts below to plan each tick; the lane writes them
from what the engine returns (server.lane.seam): the engine keeps its model state (caches, sampler, decoder) in a
record of its own, never here. ``on_token`` turns each sampled token into what the client sees and says when the
request is over.

Output contract (``on_token(token, logprobs)``, whatever produced the token: the batch, a solo decode, a
speculative step) answers ``None`` (go on) or a ``FinishReason``:
- every call emits at most one ``Delta`` through ``sink`` (text already passed through the stop matcher, so a
  partial stop string is held back and never emitted); the first token's ``Delta`` has ``first_token=True`` even
  when its text is held back (so time-to-first-token is measured at the token, not at the text);
- STOP (EOS, or a stop string appeared: the text before it was emitted, the stop string never is) and LENGTH
  (``max_tokens`` reached) release the held-back text first (not after a stop string);
- cancellation is not decided here: the scheduler ends cancelled sequences at the start of a tick (on every rank
  of a sharded model at the same point), so a cancelled request stops within one tick;
- ``finished(reason)`` builds the one ``Finished`` event (the lane sends it after storing the caches).
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from server.lane.events import Delta, Event, Finished, SamplingParams
from server.lane.seam import SeqFacts
from server.lane.stops import StopMatcher
from server.lane.target import Target

__all__ = ["Phase", "FinishReason", "Sequence", "Timings"]


class Phase(enum.Enum):
    WAITING = "waiting"
    WAITING_IO = "waiting_io"
    PREFILL = "prefill"
    READY = "ready"
    SOLO = "solo"
    BATCHED = "batched"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence ended (the wire APIs map these onto their own words: "length" is Anthropic's max_tokens)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"  # the client left, or the server's shutdown timeout ended it
    FAILED = "failed"  # the model work raised: the request gets a 500, the lane serves on

    def __str__(self) -> str:
        return self.value


@dataclass
class Timings:
    admitted_at: float = 0.0
    prefill_started: float = 0.0
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None


@dataclass(eq=False)
class Sequence:
    # -- the request (set by the HTTP side; read-only afterwards) ------------------------------------------------
    prompt: list
    params: SamplingParams
    sink: Callable[[Event], None]
    target: Optional[Target] = None  # the model that computes it (None only in tests of plans, which need none)
    ns: str = ""  # the prefix cache's namespace (computed once, at submit: server.core.generation)
    session: Optional[str] = None
    anchors: tuple = ()  # prompt positions kept as cache entries of their own (a client's cache breakpoints)
    checkpoints: tuple = ()  # prompt positions where a model whose caches cannot be cut back keeps their state
    # (cache.checkpoints: where the next turn's prompt is expected to part from this one)
    media: Any = None  # server.core.media.PromptMedia of a prompt with images (``prompt`` is then its cache key)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    internal: bool = False  # the server's own work (a next-turn cache entry: server.core.next_turn), not a client's
    # request: not counted among the requests served nor in their latencies
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)

    # -- lifecycle (the lane's) ----------------------------------------------------------------------------------
    phase: Phase = Phase.WAITING
    finish_reason: Optional[FinishReason] = None

    # -- what the scheduler plans with: the engine's facts of it (``LaneEngine.classify``) and how far it got ------
    facts: SeqFacts = SeqFacts()
    covered: int = 0  # prompt tokens its caches cover (during prefill)
    cached: int = 0  # prompt tokens served by the prefix cache
    stored: int = 0  # prompt tokens covered by what it put in the prefix cache so far
    oom_retries: int = 0  # times its prefill ran out of memory and it went back to the queue (server.lane.device_loss)

    # -- output side ---------------------------------------------------------------------------------------------
    generated: list = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    spec_stats: Optional[dict] = None  # speculative counters, set when a speculating sequence ends
    detokenizer: Any = None  # a fresh mlx-lm streaming detokenizer (start_output)
    eos: frozenset = frozenset()
    logprob_of: Optional[Callable] = None  # (logprobs, token) -> TokenLogprob, when the request asked for them
    _stops: Optional[StopMatcher] = None

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill (the last prompt token is the first decode step's input)."""
        return max(0, len(self.prompt) - 1 - self.covered)

    @property
    def group(self):
        """Its decode batch group (``facts.group``)."""
        return self.facts.group

    @property
    def kv_price(self):
        """What its model's caches cost the memory budget (server.lane.budget.KVPrice; None: the server's price)."""
        return self.target.slot.kv_price if self.target is not None else None

    def next_anchor(self, done: int) -> Optional[int]:
        """The first anchor or checkpoint past ``done`` (where a prefill chunk stops, so that prefix is stored or its
        state kept), or None."""
        return min((a for a in (*self.anchors, *self.checkpoints) if a > done), default=None)

    @property
    def decoding(self) -> bool:
        return self.phase in (Phase.SOLO, Phase.BATCHED)

    @property
    def migratable(self) -> bool:
        """May it move from its group's batch to solo decoding? The move recomputes the one token the batch fed
        ahead, so its caches must be trimmable by one (no sliding window has wrapped yet), and it may not have a
        grammar (its processor must see each sampled token exactly once)."""
        if not self.facts.batchable or not self.facts.moves or self.params.grammar is not None:
            return False
        window = self.facts.window
        return window is None or len(self.prompt) + len(self.generated) < window

    @property
    def joinable(self) -> bool:
        """May it move from solo decoding into its group's batch? As ``migratable``, but a solo decoder that ran
        nothing ahead (``facts.solo_ahead`` False: recurrent state, sliding windows) hands over
        caches that need no trim, so a wrapped window joins too."""
        if self.migratable:
            return True
        return (self.facts.batchable and self.facts.joins and self.params.grammar is None
                and not self.facts.solo_ahead)

    @property
    def yields(self) -> bool:
        """Does it speculate on its own only for want of company (``facts.yields``), so that it joins its group's
        batch, drafting no more, when that batch forms or takes rows? Not with a grammar (as ``joinable``)."""
        return self.facts.yields and self.params.grammar is None

    def start_output(self, detokenizer, eos: frozenset, logprob_of: Optional[Callable] = None) -> None:
        """Bind the text side (the engine does it at admission: the detokenizer is the model's)."""
        self.detokenizer, self.eos, self.logprob_of = detokenizer, eos, logprob_of
        self._stops = StopMatcher(list(self.params.stop))
        detokenizer.reset()

    def on_token(self, token: int, logprobs=None, now: Optional[float] = None) -> Optional[FinishReason]:
        """Take one sampled token; emit what is safe to show; return a finish reason or None."""
        now = time.monotonic() if now is None else now
        if self.timings.first_token_at is None:
            self.timings.first_token_at = now
        self.generated.append(token)
        first = len(self.generated) == 1
        if token in self.eos:
            tail = self._release_tail()
            if tail or first:
                self.sink(Delta(tail, first_token=first))
            return FinishReason.STOP
        self.detokenizer.add_token(token)
        text = self._matcher.feed(self.detokenizer.last_segment)
        lp = (self.logprob_of(logprobs, token),) if self.logprob_of is not None and logprobs is not None else ()
        if self._matcher.stopped:
            self.sink(Delta(text, lp, first_token=first))
            return FinishReason.STOP
        if len(self.generated) >= self.params.max_tokens:
            self.sink(Delta(text + self._release_tail(), lp, first_token=first))
            return FinishReason.LENGTH
        self.sink(Delta(text, lp, first_token=first))
        return None

    def _release_tail(self) -> str:
        self.detokenizer.finalize()
        return self._matcher.feed(self.detokenizer.last_segment) + self._matcher.flush()

    @property
    def _matcher(self) -> StopMatcher:
        if self._stops is None:
            raise RuntimeError(f"sequence {self.id} takes tokens before start_output bound its text side")
        return self._stops

    def finished(self, reason: FinishReason, now: Optional[float] = None) -> Finished:
        """End the sequence (phase FINISHED) and build its one ``Finished`` event."""
        now = time.monotonic() if now is None else now
        t = self.timings
        t.finished_at = now
        self.phase, self.finish_reason = Phase.FINISHED, reason
        first = t.first_token_at
        matched = self._stops.matched if self._stops is not None else None
        return Finished(
            finish_reason=str(reason),
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.generated),
            cached_tokens=self.cached,
            prefill_tokens=(len(self.prompt) - self.cached) if first is not None else 0,
            prefill_s=(first - t.prefill_started) if first is not None else 0.0,
            decode_tokens=max(0, len(self.generated) - 1),
            decode_s=(now - first) if first is not None else 0.0,
            queued_s=max(0.0, (t.admitted_at or now) - self.enqueued_at),
            spec=self.spec_stats,
            stop_sequence=matched if reason == FinishReason.STOP else None,
            cache_write_tokens=max(0, min(self.stored, len(self.prompt)) - self.cached),
        )
