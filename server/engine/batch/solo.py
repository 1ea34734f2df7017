"""The ``solo`` batch kind: one row decoding on its own, plainly (``PlainDecode`` over mlx-lm's ``generate_step``) or
speculatively (``spec.speculative_decode``: one verify forward over the row's pending token and its drafts).

A batch of one is slower than the solo path (plain ``generate_step`` pipelines each forward with the next), so a
sequence decodes here while it is its group's only one, or when no batch kind can hold it (a speculating row with a
grammar, caches that cannot merge). ``SoloBatch`` is the ``Batch`` (server.engine.batch.protocol) over the two
decoders: ``add`` takes its one row, the decoder opens at the first ``step``, ``remove`` closes it and hands back the
caches with exactly the tokens they cover (each decoder's own account, below); ``hand_over`` closes it for a join,
the row's next input unfed where the decoder allows (a speculative one: ``spec.verify.HandOver``), so a row over
recurrent state or a wrapped window can join its group's batch from speculating alone.

mlx-lm's ``generate_step`` pipelines every forward with the next one (``async_eval``). On a
CPU the first token then arrives only after *two* forward passes: for a prefix-cache hit
with one new token that is 2x the time-to-first-token it could be. ``PlainDecode`` computes
the first token alone, hands it out at once, and then continues with ``generate_step`` fed
that token, so the rest of the stream keeps mlx-lm's pipelining.

A RAM hit's caches may read the cached entry where it lies (models.attention.shared_prefix). On a GPU
(``one_buffer``) that holds for the first token only: the steps after it take MLX's fused one-query kernel, which
wants one buffer, so the decoder copies the entry once, right after handing out the first token.

Cache contract: after the iteration ends or is closed, the caches cover the prompt plus the
first ``fed_generated`` yielded tokens: all of them once the pipeline started, none when the
request ended on its first token (feeding it would cost a forward nobody needs).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Generator, Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import greedy_sampler

from models.attention.shared_prefix import flatten as flatten_shared
from server.engine.batch.protocol import Covered, Emitted, Row, RowState
from spec import HandOver, speculative_decode
from spec.rewind import can_rewind

__all__ = ["SoloBatch", "PlainDecode"]


class PlainDecode:
    """Plain decode steps (see the module docstring). ``pipelined`` False (a model with recurrent state, whose caches
    cannot take a token back): each token is fed only when the next is asked for, so that whenever the decoder stops
    its caches cover everything but the last token it yielded, and the row can move into a batch exactly."""

    def __init__(self, model, caches: list, prompt: Sequence[int], *, max_tokens: int, sampler,
                 processors_for: Callable[[Sequence[int]], list], stream, pipelined: bool = True,
                 one_buffer: bool = False):
        self.model = model
        self.caches = caches
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.processors_for = processors_for  # history -> logits processors that see it
        self.stream = stream
        self.pipelined = pipelined
        self.one_buffer = one_buffer  # a hit's shared-prefix layers become one buffer after the first token
        self.fed_generated = 0
        self._rest: Optional[Generator[tuple[Any, mx.array], None, None]] = None
        self._yielded = 0

    def __iter__(self) -> Iterator[tuple[int, mx.array]]:
        if self.max_tokens <= 0:
            return
        first, logprobs = self._first_token()
        self._yielded = 1
        yield first, logprobs
        if self.max_tokens == 1:
            return
        if self.one_buffer:
            # on CUDA a hit's first token read the cached entry where it lies (models.attention.gpu); the steps
            # after it take MLX's fused one-query kernel, which wants one buffer: the copy the first token did not
            # wait for, made once, with room for the tokens to come (in place: the list is the row's)
            self.caches[:] = flatten_shared(self.caches, room=KVCache.step)
        if not self.pipelined:
            yield from self._one_at_a_time(first)
            return
        self._rest = generate_step(
            mx.array([first]), self.model, self.stream, max_tokens=self.max_tokens - 1,
            sampler=self.sampler, logits_processors=self.processors_for(list(self.prompt)),
            prompt_cache=self.caches,
        )
        for token, lp in self._rest:
            self._yielded += 1
            self.fed_generated = self._yielded  # generate_step feeds each token before yielding it
            yield int(token), lp
        self.fed_generated = self._yielded

    def _one_at_a_time(self, first: int) -> Iterator[tuple[int, mx.array]]:
        """Feed the last token, sample the next, yield it: no forward runs ahead of what was asked."""
        processors = self.processors_for(list(self.prompt))
        generated = [first]
        while self._yielded < self.max_tokens:
            fed = mx.array(generated, dtype=mx.uint32)
            logits = self.model(mx.array([[generated[-1]]]), cache=self.caches)[:, -1, :]
            for proc in processors:
                logits = proc(fed, logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            token = self.sampler(logprobs)
            mx.eval(token, logprobs)
            self.fed_generated = len(generated)
            generated.append(token.item())
            self._yielded += 1
            yield generated[-1], logprobs.squeeze(0)

    def _first_token(self) -> tuple[int, mx.array]:
        last = mx.array(list(self.prompt[-1:]))
        logits = self.model(last[None], cache=self.caches)[:, -1, :]
        for proc in self.processors_for(list(self.prompt[:-1])):
            logits = proc(last, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = self.sampler(logprobs)
        mx.eval(token, logprobs)
        return token.item(), logprobs.squeeze(0)

    def close(self) -> None:
        if self._rest is not None:
            self._rest.close()
            self.fed_generated = self._yielded


class SoloBatch:
    """One row on its own (see the module docstring). ``stream``: the lane's MLX stream (the decoders run on it;
    None: the default device's default stream)."""

    kind: ClassVar[str] = "solo"

    def __init__(self, model, stream=None, pipelined: bool = True, one_buffer: bool = False):
        self.model = model
        self.pipelined = pipelined  # False: a model with recurrent state (see PlainDecode)
        self.one_buffer = one_buffer  # True on a GPU (see PlainDecode)
        self.stream = stream if stream is not None else mx.default_stream(mx.default_device())
        self.steps = 0
        self.row_steps = 0
        self._row: Optional[Row] = None
        self._state: Optional[RowState] = None  # the row's account (its limit, what it generated)
        self._emitted: list[int] = []  # the tokens its steps emitted since the join
        self._decoder: Any = None  # PlainDecode, or the speculative generator
        self._steps: Optional[Generator] = None  # the decoder's iteration
        self._done = False  # the decoder's iteration ended (a speculative one then fed its last token)

    def __len__(self) -> int:
        return int(self._row is not None)

    @property
    def sequences(self) -> list:
        return [self._row.seq] if self._row is not None else []

    @property
    def paying(self) -> bool:
        return True

    def kv_nbytes(self) -> int:
        return 0  # the row's own caches: counted as its sequence's need, not as a batch's buffers

    def accepts(self, row: Row) -> bool:
        """Any one row; a speculating one needs caches that can take rejected drafts back (spec.rewind)."""
        if self._row is not None:
            return False
        return row.draft is None or can_rewind(row.caches)

    def add(self, rows: Sequence[Row]) -> None:
        if len(rows) != 1 or not self.accepts(rows[0]):
            raise ValueError("a solo batch holds one row (a speculating one over caches that can be rewound)")
        self._row = rows[0]
        self._state = self._row.state()
        self._emitted = []

    def step(self) -> list[Emitted]:
        """The row's next token (a speculative step may have drafted it), or nothing when its decoder is done."""
        row, state = self._row, self._state
        if row is None or state is None:
            return []
        with mx.stream(self.stream):
            if self._decoder is None:
                self._decoder = self._open(row, state)
                self._steps = iter(self._decoder)
            if self._steps is None:
                return []
            try:
                token, logprobs, *_ = next(self._steps)  # speculative steps also say whether it was drafted
            except StopIteration:
                self._done = True
                return []
        self.steps += 1
        self.row_steps += 1
        self._emitted.append(token)
        state.generated += 1
        return [Emitted(row.seq, token, logprobs)]

    def remove(self, seqs: Sequence, kept: Optional[Sequence[int]] = None) -> list[Covered]:
        """Close the decoder; the caches cover the history plus what the decoder fed of what it yielded
        (``PlainDecode.fed_generated``; a speculative decoder feeds every token it yields that was kept)."""
        row, state = self._row, self._state
        if row is None or state is None or len(seqs) != 1 or seqs[0] is not row.seq:
            raise KeyError("not this solo batch's row")
        history = list(row.history)
        tokens = history[:-1]  # never stepped: the caches cover all but the next input
        if self._decoder is not None:
            if self._steps is not None and self._steps is not self._decoder:
                self._steps.close()
            self._decoder.close()
            since_join = state.covered(None if kept is None else kept[0]) - len(history)
            fed = self._decoder.fed_generated if isinstance(self._decoder, PlainDecode) else since_join
            tokens = history + self._emitted[:fed]
        self._clear()
        return [Covered(tokens, row.caches)]

    def hand_over(self, seqs: Sequence) -> list[Covered]:
        """``remove`` for a join: every token it emitted kept, and a speculative decoder told to leave its last token
        unfed (``HandOver``), so the caches cover the history but its next input and need no trim (recurrent state and
        wrapped windows cannot take one back: such a row's decoders are not ``pipelined``, so none fed ahead). Other
        decoders close as in ``remove``: a pipelined one's caches can be trimmed (``Decoder._entry``), and a plain one
        that is not pipelined fed nothing ahead."""
        row = self._row
        if row is None or len(seqs) != 1 or seqs[0] is not row.seq:
            raise KeyError("not this solo batch's row")
        steps = self._steps
        if (self.pipelined or isinstance(self._decoder, PlainDecode) or steps is None or self._done
                or not self._emitted):
            return self.remove(seqs)
        try:
            steps.throw(HandOver())
        except HandOver:
            pass
        else:
            raise RuntimeError("the speculative decoder went on after HandOver")
        tokens = list(row.history) + self._emitted[:-1]
        self._clear()
        return [Covered(tokens, row.caches)]

    def _clear(self) -> None:
        """No row, no decoder: ready for the next ``add``."""
        self._row = self._state = self._decoder = self._steps = None
        self._emitted, self._done = [], False

    def _open(self, row: Row, state: RowState):
        history = list(row.history)
        left = state.left()
        sampler = row.sampler or greedy_sampler
        if row.draft is not None:  # the caches cover history[:-1] (fresh, or back from a speculating batch)
            d = row.draft
            return speculative_decode(
                self.model, row.caches, history[-1], d.source, sampler=sampler,
                logits_processors=row.rules.processors(history[:-1]), max_tokens=left,
                num_draft_tokens=d.max_draft, stream=self.stream, policy=d.policy, stats=d.stats,
                pipelined=self.pipelined)
        return PlainDecode(self.model, row.caches, history, max_tokens=left, sampler=sampler,
                           stream=self.stream, processors_for=row.rules.processors, pipelined=self.pipelined,
                           one_buffer=self.one_buffer)

