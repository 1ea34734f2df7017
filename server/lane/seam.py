"""The seam between the lane and the engine: the verbs the lane's executor calls, and the small records they return.

The lane (server.lane.lane) owns the sequences (their phase, their output, their place in the queue); the engine
(server.engine) owns the model work (caches, samplers, decode batches) and keeps its per-sequence state in a record
of its own. Everything that crosses is declared here:

    lane -> engine   the verbs of ``LaneEngine``, each given sequences; the engine reads of a sequence only what
                     ``SeqView`` declares (the request; the tokens it generated and kept, at a join, a leave, an end)
                     and never writes one
    engine -> lane   records: ``SeqFacts`` (how to plan it), ``Admitted``, ``Prefilled``, ``Emitted`` (a token),
                     ``BatchStep`` (a batch step's tokens, and rows that now decode in another group), ``Ended``

A sequence is the engine's key for its own state, never a place to write to. So the executor is tested against a
small fake of this protocol (tests/unit/test_lane_executor.py) as well as against the real engine on a tiny model
(tests/unit/test_lane.py), as vLLM's scheduler and model runner meet in ``SchedulerOutput`` / ``ModelRunnerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence

from server.lane.events import SamplingParams
from server.lane.target import Target

__all__ = ["GroupKey", "SeqFacts", "SeqView", "Admitted", "Prefilled", "Emitted", "BatchStep", "Covered", "Ended",
           "WarmStep", "LaneEngine"]


@dataclass(frozen=True)
class GroupKey:
    """Which rows may share one forward: those of one model (its name: the same on every rank of a sharded model),
    one LoRA adapter (its identity, or None for the model's own weights), speculating or not."""

    model: str
    adapter: Optional[str] = None
    speculating: bool = False

    def plain(self) -> "GroupKey":
        """The group of the same model's rows that do not speculate."""
        return GroupKey(self.model, self.adapter, False)

    def wire(self) -> list:
        """As JSON (a sharded model's plans carry groups: server.lane.plan)."""
        return [self.model, self.adapter, self.speculating]

    @classmethod
    def from_wire(cls, value: Sequence[Any]) -> "GroupKey":
        model, adapter, speculating = value
        return cls(model, adapter, bool(speculating))


@dataclass(frozen=True)
class SeqFacts:
    """What the engine says of a sequence when it arrives, for the scheduler to plan with."""

    group: Optional[GroupKey] = None  # its decode batch group: rows of one group share a forward
    batchable: bool = False  # it may decode in its group's batch (else it decodes on its own)
    prefill_together: bool = False  # its prefill chunks may join a batched prefill forward
    # ... even after a long cache hit (or past its own first chunks): where its model's per-token prefill cost dwarfs
    # the copy of a cached prefix in and out of the batched forward (a hybrid's recurrent state)
    together_after_hits: bool = False
    window: Optional[int] = None  # the model's smallest sliding window (None: no sliding-window layer)
    batch_kind: str = "solo"  # the kind of its group's batch (server.engine.batch.choose), for /stats
    moves: bool = True  # it may leave its group's batch to decode on its own (its caches allow it)
    joins: bool = True  # it may join its group's batch from decoding on its own
    drafting: bool = False  # it decodes speculatively (the server speculates, the request and its model allow it)
    solo_ahead: bool = True  # decoding on its own, it runs a forward ahead of the tokens it returned
    # it speculates on its own only because it arrived alone (its model's caches cannot speculate in a batch): when
    # its group's batch forms or takes rows, it joins it and drafts no more (the engine's join gives its new facts)
    yields: bool = False


class SeqView(Protocol):
    """What the engine reads of a lane sequence (server.lane.sequence.Sequence), at the verbs that pass it; it writes
    none of it. ``generated`` is read only where the lane has taken every token it kept (a join, a leave, an end):
    a batch keeps its own count in between (server.engine.batch.protocol.RowState)."""

    @property
    def id(self) -> str: ...

    @property
    def prompt(self) -> Sequence[int]: ...  # its token ids (a prompt with images: its cache key)

    @property
    def generated(self) -> Sequence[int]: ...  # the tokens it kept so far

    @property
    def params(self) -> SamplingParams: ...

    @property
    def target(self) -> Optional[Target]: ...  # the model that computes it (None only in plan-only tests)

    @property
    def ns(self) -> str: ...  # its prefix-cache namespace

    @property
    def session(self) -> Optional[str]: ...

    @property
    def media(self) -> Any: ...  # server.core.media.PromptMedia of a prompt with images (None: text only)

    @property
    def anchors(self) -> tuple: ...  # prompt positions stored as entries of their own (cache breakpoints)

    @property
    def checkpoints(self) -> tuple: ...  # prompt positions where untrimmable layers keep their state

    @property
    def facts(self) -> SeqFacts: ...  # what ``classify`` said (the engine's own answer, kept by the lane)

    @property
    def group(self) -> Optional[GroupKey]: ...  # its decode batch group (``facts.group``)


@dataclass(frozen=True)
class Admitted:
    """A sequence took its place: how much of its prompt the prefix cache gave it, and how its tokens become text."""

    cached: int  # prompt tokens served by the prefix cache
    detokenizer: Any  # a streaming detokenizer of its model (fresh)
    eos: frozenset  # its model's end-of-sequence ids
    logprob_of: Optional[Callable] = None  # (logprobs, token) -> TokenLogprob, when the request asked for them


@dataclass(frozen=True)
class Prefilled:
    """One sequence after a prefill chunk."""

    seq: Any
    covered: int  # prompt tokens its caches cover now
    ready: bool  # the prompt is computed (all but its last token, the first decode step's input)
    stored: int = 0  # prompt tokens covered by what it has put in the prefix cache so far


@dataclass(frozen=True)
class Emitted:
    """A token a decode step made for a sequence (its log-probabilities over the vocabulary, lazily on the device)."""

    seq: Any
    token: int
    logprobs: Any = None


@dataclass(frozen=True)
class BatchStep:
    """One decode step of a group's batch: its tokens (in row order, a speculating row's several in sequence order),
    and ``regrouped``: (sequence, its new facts) for rows that decode in another group from now on (a speculating
    batch whose drafts stopped paying went on as its group's plain batch; such a step made no tokens)."""

    emitted: Sequence[Emitted] = ()
    regrouped: Sequence[tuple[Any, SeqFacts]] = ()


@dataclass(frozen=True, eq=False)
class Covered:
    """A row taken out of a batch: its own caches and exactly the tokens they cover."""

    tokens: list
    caches: list


@dataclass(frozen=True)
class Ended:
    """What the engine did with an ending sequence: the prompt tokens now covered by its prefix-cache entries, and
    its speculative counters (spec.SpecStats) when it speculated."""

    stored: int = 0
    spec: Any = None


@dataclass(frozen=True)
class WarmStep:
    """One step of the engine's warm-up (server.lane.warm runs them in order, on the lane thread): ``run()`` computes
    it on the lane's stream and raises on failure; ``name`` is for the log. A step is at most about one
    --prefill-chunk forward: a request that arrives while one runs waits for that step alone. ``chain``: see below."""

    name: str
    run: Callable[[], None]
    # steps of one chain share state (a cache one grows, the next uses) and run in order in one process; a kernel
    # warmer (server.startup.warmers) runs whole chains. "": a step of its own, which compiles nothing worth a warmer
    chain: str = ""


# the chains of steps a kernel warmer runs in a process of its own (server.startup.warmers, which reads this without
# importing the engine), in the order they are dealt; server.engine.warmup names its steps' chains from these. Not the
# speculative rounds: a warmer loads no draft model nor MTP heads
WARMER_CHAINS = ("prefill", "sampling", "batched step", "batched prefill", "past a cache")


class LaneEngine(Protocol):
    """The verbs of the lane's executor (lane thread only, except ``namespace_for`` and ``classify``, which are
    pure). Each raises on failure; the lane then ends that sequence with ``fail``."""

    prefill_chunk: int
    stream: Any  # the lane thread's MLX stream, once bound (a sharded model's collectives run on it)

    def base_target(self) -> Target:
        """The server's base model with its own weights (a sharded model's followers serve it alone)."""

    def namespace_for(self, target: Target, params: SamplingParams) -> str:
        """The prefix-cache namespace of a request on ``target``."""

    def bind_stream(self, as_default: bool = False) -> None:
        """Create the MLX stream the calling (lane) thread computes on."""

    def warmup_steps(self) -> Sequence[WarmStep]:
        """The warm-up, in order: page in and compile what the first requests use (called once, on the lane thread
        after ``bind_stream``; the lane runs the steps before it says it is ready or while it is idle)."""

    def task_context(self) -> ContextManager:
        """What a lane task (model work other than a sequence's) runs under."""

    def classify(self, seq: SeqView, company: bool = False) -> SeqFacts:
        """The facts the scheduler plans with (once, when the sequence arrives); ``company``: other sequences are
        running or waiting in the lane."""

    def admit(self, seq: SeqView) -> Admitted:
        """Take the prefix cache for the sequence's prompt and prepare its model state."""

    def take_longer_prefix(self, seq: SeqView) -> Optional[int]:
        """Before a prefill chunk: when the prefix cache now holds more of the prompt than the sequence covers,
        take it; the new coverage, or None when nothing changed."""

    def prefill(self, chunks: Sequence[tuple[SeqView, int]], store_now: bool) -> list[Prefilled]:
        """Compute these prompt chunks ((sequence, tokens), one forward for all of them); ``store_now``: store a
        completed prompt at once, for requests that may share its prefix."""

    def join_batch(self, group: GroupKey, seqs: Sequence[SeqView]) -> Sequence[tuple[SeqView, SeqFacts]]:
        """These sequences (ready, or decoding on their own) join their group's batch in one step; the new facts of
        those that drafted alone and no longer draft (``SeqFacts.yields``)."""

    def leave_batch(self, seq: SeqView) -> None:
        """A batch row goes on decoding on its own."""

    def step_batch(self, group: GroupKey) -> BatchStep:
        """One decode step of a group's batch (see ``BatchStep``)."""

    def step_solo(self, seq: SeqView) -> Optional[Emitted]:
        """One decode step of a sequence decoding on its own; None when it can make no more tokens."""

    def end(self, seqs: Sequence[SeqView]) -> list[Ended]:
        """These sequences end (finished, or cancelled): out of their batch, what they computed stored."""

    def abandon(self, seq: SeqView) -> None:
        """A sequence whose model work raised: release what the engine holds for it (nothing is stored)."""

    def reset_batch(self, group: GroupKey, seqs: Sequence[SeqView] = ()) -> None:
        """A batch whose step raised goes whole, before its rows (``seqs``) are abandoned (nothing is copied out of
        it): start the group afresh."""

    def batch_rows(self) -> int:
        """Rows in all decode batches."""

    def batch_kv_bytes(self) -> int:
        """Bytes the decode batches' KV buffers hold now."""
