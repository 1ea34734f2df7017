"""The generation core: one internal request -> one job on the lane -> normalized events.

Every front door (chat completions, completions, /v1/responses, /v1/messages) translates its request into
token ids + ``SamplingParams`` (chat-shaped APIs through one ``ChatCompletionRequest``), opens a
``Generation`` and only formats what ``events()`` yields:

    TextOut(text, logprobs)   visible text, tool-call markup already removed (partial markers held back)
    ReasoningOut(text)        the model's thinking, when its output parser splits it off
    KeepAlive()               nothing arrived for --keepalive seconds (SSE comment / ping time)
    Done(finished, reason, calls, stop_sequence)   the end: reason is "stop" | "length" | "tool_calls"
    Error(error)              the job failed or the server cut it short; nothing follows

Usage: ``async with gen:`` (or ``await gen.__aenter__()`` before handing ``events()`` to a streaming
response, which must call ``__aexit__`` in its ``finally``); entering submits the job and may raise
``QueueFull``. Leaving cancels the job if it has not finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from server.errors import APIError, ShuttingDown
from server.http_util import request_id
from server.jobrun import JobRun
from server.jobs import Delta, Failed, Finished, SamplingParams, TokenLogprob
from server.output_parse import make_output_parser, prompt_opens_thinking
from server.prompts import chat_grammar, render_chat, sampling_params, session_header, session_of
from server.schemas import ChatCompletionRequest

__all__ = [
    "TextOut", "ReasoningOut", "KeepAlive", "Done", "Error", "GenEvent", "Result", "Generation", "chat_generation",
]

log = logging.getLogger("mlx_lane.generation")


@dataclass(frozen=True)
class TextOut:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ReasoningOut:
    text: str


@dataclass(frozen=True)
class KeepAlive:
    pass


@dataclass(frozen=True)
class Done:
    finished: Finished
    reason: str  # "stop" | "length" | "tool_calls"
    calls: tuple[dict, ...] = ()
    stop_sequence: Optional[str] = None  # which stop string ended it (the lane's stop matcher says)


@dataclass(frozen=True)
class Error:
    error: APIError


GenEvent = Union[TextOut, ReasoningOut, KeepAlive, Done, Error]


@dataclass
class Result:
    """A whole generation, for the non-streamed responses."""

    text: str
    reasoning: str
    logprobs: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    reason: str = "stop"
    stop_sequence: Optional[str] = None
    finished: Optional[Finished] = None


class Generation:
    """One request's job on the lane and the parser over its output (see the module docstring)."""

    def __init__(self, state, request: Request, prompt: list[int], params: SamplingParams, *,
                 session: Optional[str], id_prefix: str, parser=None, adapter=None):
        self.state = state
        self.prompt = prompt
        if adapter is not None:  # the LoRA adapter the request's `model` named (server.model_names.check_model)
            params = replace(params, adapter=adapter)
        self.params = params
        self.parser = parser  # None: raw text (text completions)
        self.id = request_id(request, id_prefix)
        self.t0 = time.monotonic()
        state.lane.check_fits(len(prompt), params.max_tokens)  # 400 when the memory budget can never admit it
        _prefetch(state, prompt, params, session)  # starts SSD reads while the job waits for the lane
        self.run = JobRun(state.lane, request, prompt, params, session, state.keepalive_s, request_id=self.id)

    async def __aenter__(self) -> "Generation":
        await self.run.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.run.__aexit__(*exc)

    async def events(self) -> AsyncIterator[GenEvent]:
        stats = self.state.stats
        async for ev in self.run.events():
            if ev is None:
                yield KeepAlive()
            elif isinstance(ev, Delta):
                if ev.first_token:
                    stats.observe_ttft(time.monotonic() - self.t0)
                for out in self._pieces(self.parser.feed(ev.text) if self.parser else None, ev):
                    yield out
            elif isinstance(ev, Failed):
                yield Error(_internal(ev))
                return
            elif isinstance(ev, Finished) and ev.finish_reason == "cancelled":
                yield Error(self._cut_short(ev))
                return
            elif isinstance(ev, Finished):
                stats.observe_e2e(time.monotonic() - self.t0)
                calls: list = []
                if self.parser is not None:
                    rest, calls = self.parser.finish()
                    for out in self._pieces(rest, None):
                        yield out
                reason = "tool_calls" if calls else ev.finish_reason
                yield Done(ev, reason, tuple(calls), ev.stop_sequence if reason == "stop" else None)
                return
            # Progress events carry nothing a client is sent

    @staticmethod
    def _pieces(pieces, delta: Optional[Delta]):
        """Merge a feed's pieces into events; a raw delta (no parser) passes through with its logprobs."""
        if pieces is None:
            if delta.text or delta.logprobs:
                yield TextOut(delta.text, delta.logprobs)
            return
        lps = delta.logprobs if delta is not None else ()
        for p in pieces:
            if p.kind == "reasoning":
                if p.text:
                    yield ReasoningOut(p.text)
            elif p.text or lps:
                yield TextOut(p.text, lps)
                lps = ()
        if lps:  # text held back by the parser: the logprobs still go out, in order
            yield TextOut("", lps)

    async def collect(self) -> Result:
        """Run to the end; raises the ``APIError`` of a failed or cut-short job."""
        text, reasoning, lps = [], [], []
        async for ev in self.events():
            if isinstance(ev, TextOut):
                text.append(ev.text)
                lps.extend(ev.logprobs)
            elif isinstance(ev, ReasoningOut):
                reasoning.append(ev.text)
            elif isinstance(ev, Error):
                raise ev.error
            elif isinstance(ev, Done):
                return Result("".join(text), "".join(reasoning), lps, list(ev.calls), ev.reason,
                              ev.stop_sequence, ev.finished)
        raise APIError("generation ended without a result")

    def _cut_short(self, ev: Finished) -> APIError:
        """The error that ends a response whose job was cancelled while its client was still reading: only the
        server does that (a client that left reads nothing), when its --shutdown-timeout ran out (Lane.abort)."""
        if self.run.lane.aborted:
            return ShuttingDown(f"The server is shutting down: its --shutdown-timeout ended this response after "
                                f"{ev.completion_tokens} tokens. Retry in a moment.", retry_after_s=5)
        return APIError("The server cancelled this response. Please retry.", code="cancelled")


async def chat_generation(state, request: Request, req: ChatCompletionRequest, id_prefix: str, *,
                          session: Optional[str] = None, fit_max_tokens: bool = False, adapter=None) -> Generation:
    """Render, size and open a generation for a chat-shaped internal request (not yet submitted).

    ``session`` overrides the cache session derived from ``X-Session-Id`` / ``prompt_cache_key`` / ``user``.
    ``fit_max_tokens``: a ``max_tokens`` larger than the room left in the context is lowered to that room
    instead of being a 400 (Anthropic clients always send one, sized for Claude: Claude Code asks for 64,000).
    ``adapter``: the LoRA adapter that computes it (None: the base model)."""
    prompt = await run_in_threadpool(render_chat, state.loaded.tokenizer, req)
    grammar = await run_in_threadpool(chat_grammar, state.loaded.tokenizer, req)  # response_format / forced calls
    max_tokens = req.requested_max_tokens()
    if fit_max_tokens:
        max_tokens = fit_to_context(max_tokens, len(prompt), state.loaded.context_length)
    params = sampling_params(
        req.model_copy(update={"max_tokens": max_tokens}), len(prompt),
        state.loaded.context_length, default_max_tokens=state.default_max_tokens, vocab_size=state.vocab_size,
        grammar=grammar,
    )
    session = session or session_of(session_header(request.headers), req)
    tok, tools = state.loaded.tokenizer, req.tools_enabled()
    parser = make_output_parser(  # the model family's tool-call format and thinking tags (server.output_parse)
        tok, tools=tools, in_reasoning=prompt_opens_thinking(tok, prompt),
        tool_specs=[t.model_dump(exclude_none=True) for t in req.tools] if tools else None)
    return Generation(state, request, prompt, params, session=session, id_prefix=id_prefix, parser=parser,
                      adapter=adapter)


def fit_to_context(max_tokens: Optional[int], prompt_len: int, context_length: int) -> Optional[int]:
    """``max_tokens`` lowered to the room the prompt leaves in the context (at least 1: a prompt that fills the
    context is still refused, by ``sampling_params``, with a message saying so)."""
    if max_tokens is None:
        return None
    return min(max_tokens, max(1, context_length - prompt_len))


def _internal(ev: Failed) -> APIError:
    if isinstance(ev.error, APIError):
        return ev.error
    return APIError("The server failed while generating this response. The error was logged; please retry.")


def _prefetch(state, prompt: list[int], params: SamplingParams, session: Optional[str]) -> None:
    """Start reading an SSD-cached prefix now, while the job waits for the lane (index lookups only here), in the
    namespace the lane will take from (the engine decides it: a speculating request's includes the draft)."""
    try:
        state.prompt_cache.prefetch(prompt, state.lane.engine.namespace_for(params), session)
    except Exception:  # an optimisation: never fail the request for it
        log.exception("prefetch failed")
