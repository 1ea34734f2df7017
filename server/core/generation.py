"""The generation core: one internal request -> one job on the lane -> normalized events.

Every front door (chat completions, completions, /v1/responses, /v1/messages) turns its wire body into one
internal request (server.core.request.GenerationRequest), ``open_generation`` renders it into token ids +
``SamplingParams`` and opens a ``Generation``; the door only formats what ``events()`` yields (server.http.pipeline
runs that for every door):

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

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, ClassVar, Optional, Union

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from server.core.bridge import JobRun
from server.core.context import CoreContext
from server.core.output_parse import make_output_parser, prompt_opens_thinking
from server.core.prompts import (NO_BREAKPOINTS, breakpoint_marks, chat_grammar, history_end, render, render_media,
                                 sampling_params)
from server.core.template_facts import template_facts
from server.core.template_input import effort_choice
from server.core.request import GenerationRequest
from server.errors import APIError, ClientClosed, ShuttingDown
from server.lane.events import Delta, Failed, Finished, SamplingParams, TokenLogprob
from server.lane.target import Target

__all__ = [
    "TextOut", "ReasoningOut", "KeepAlive", "Done", "Error", "GenEvent", "Result", "Generation", "open_generation",
]

log = logging.getLogger("mlx_lane.generation")


# Each event names the formatter method that writes it (server.http.pipeline.Formatter): the pipeline dispatches on
# ``hook``, so no door needs a ladder of isinstance checks over the event types.
@dataclass(frozen=True)
class TextOut:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    hook: ClassVar[str] = "on_text"


@dataclass(frozen=True)
class ReasoningOut:
    text: str
    hook: ClassVar[str] = "on_reasoning"


@dataclass(frozen=True)
class KeepAlive:
    hook: ClassVar[str] = "on_keepalive"


@dataclass(frozen=True)
class Done:
    finished: Finished
    reason: str  # "stop" | "length" | "tool_calls"
    calls: tuple[dict, ...] = ()
    stop_sequence: Optional[str] = None  # which stop string ended it (the lane's stop matcher says)
    hook: ClassVar[str] = "on_done"


@dataclass(frozen=True)
class Error:
    error: APIError
    hook: ClassVar[str] = "on_error"


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


class _ResultBuilder:
    """Gathers a whole generation's events into a ``Result`` (the non-streamed responses' formatter)."""

    def __init__(self):
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list = []
        self.result: Optional[Result] = None

    def on_text(self, ev: TextOut) -> None:
        self.text.append(ev.text)
        self.logprobs.extend(ev.logprobs)

    def on_reasoning(self, ev: ReasoningOut) -> None:
        self.reasoning.append(ev.text)

    def on_keepalive(self, ev: KeepAlive) -> None:
        pass

    def on_error(self, ev: Error) -> None:
        raise ev.error

    def on_done(self, ev: Done) -> None:
        self.result = Result("".join(self.text), "".join(self.reasoning), self.logprobs, list(ev.calls), ev.reason,
                             ev.stop_sequence, ev.finished)


class Generation:
    """One request's job on the lane and the parser over its output (see the module docstring)."""

    def __init__(self, ctx: CoreContext, request: Request, prompt: list[int], params: SamplingParams,
                 target: Target, *, session: Optional[str], request_id: str, parser=None, anchors: tuple = (),
                 last_breakpoint: int = 0, checkpoints: tuple = (), media=None, headers: Optional[dict] = None,
                 ns: Optional[str] = None, next_turn: Optional[GenerationRequest] = None):
        self.ctx = ctx
        self.prompt = prompt
        self.params = params
        self.target = target
        self.parser = parser  # None: raw text (text completions)
        self.id = request_id
        self.anchors = anchors  # token positions of the request's cache breakpoints in ``prompt``
        self.last_breakpoint = last_breakpoint  # the last one's, even at the prompt's end (0: none; Anthropic usage)
        self.t0 = time.monotonic()
        self.model_name = target.name  # what the response says served it
        self.headers = dict(headers or {})  # response headers that say how the request was read (X-Reasoning-Effort)
        # a 400 when the memory budget can never admit it
        ctx.lane.check_fits(len(prompt), params.max_tokens, target.slot.kv_price)
        if ns is None:
            ns = ctx.namespace_for(target, params)  # the one place, once: the prefetch and the lane use it
        self.next_turn = next_turn  # a chat request whose reply gets its next turn's entry (server.core.next_turn)
        self._text: list[str] = []  # the reply as the client reads it, for that entry
        self._reasoning: list[str] = []
        _prefetch(ctx, prompt, ns, session)  # starts SSD reads while the sequence waits for the lane
        self.run = JobRun(ctx.lane, request, prompt, params, target, session, ctx.keepalive_s, request_id=self.id,
                          ns=ns, anchors=anchors, checkpoints=checkpoints, media=media)

    async def __aenter__(self) -> "Generation":
        await self.run.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.run.__aexit__(*exc)

    async def events(self) -> AsyncIterator[GenEvent]:
        stats = self.ctx.stats
        async for ev in self.run.events():
            if ev is None:
                yield KeepAlive()
            elif isinstance(ev, Delta):
                if ev.first_token:
                    stats.observe_ttft(time.monotonic() - self.t0)
                for out in self._pieces(self.parser.feed(ev.text) if self.parser else None, ev):
                    self._keep(out)
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
                        self._keep(out)
                        yield out
                if self.next_turn is not None and self.ctx.next_turns is not None:  # before the client hears the end
                    self.ctx.next_turns.finished(self.ctx, self, self.next_turn, "".join(self._text),
                                                 "".join(self._reasoning), calls)
                reason = "tool_calls" if calls else ev.finish_reason
                yield Done(ev, reason, tuple(calls), ev.stop_sequence if reason == "stop" else None)
                return
            # Progress events carry nothing a client is sent

    def _keep(self, out) -> None:
        if self.next_turn is not None:
            (self._reasoning if isinstance(out, ReasoningOut) else self._text).append(out.text)

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
        builder = _ResultBuilder()
        async for ev in self.events():
            getattr(builder, ev.hook)(ev)
            if builder.result is not None:
                return builder.result
        raise APIError("generation ended without a result")

    def _cut_short(self, ev: Finished) -> APIError:
        """The error that ends a response whose job was cancelled: its client left (a 499 nobody reads, counted as
        such in /stats), or, while the client was still reading, the server's --shutdown-timeout ran out
        (Lane.abort)."""
        if self.run.client_left:
            return ClientClosed(f"The client closed the connection after {ev.completion_tokens} tokens; the "
                                f"request was cancelled.")
        if self.run.lane.aborted:
            return ShuttingDown(f"The server is shutting down: its --shutdown-timeout ended this response after "
                                f"{ev.completion_tokens} tokens. Retry in a moment.", retry_after_s=5)
        return APIError("The server cancelled this response. Please retry.", code="cancelled")


async def open_generation(ctx: CoreContext, request: Request, req: GenerationRequest,
                          request_id: str, *, next_turn: bool = True) -> Generation:
    """Render, size and open a generation for an internal request (not yet submitted): the prompt's token ids
    (chat template or raw prompt), its grammar (response_format, forced or strict tool calls) and the lane's
    parameters, all computed off the event loop. Chat-shaped requests get the model family's output parser (tool
    calls, reasoning); a raw text completion's output is passed through as it is. ``request_id``: the id the
    lane, the logs and the ``X-Request-Id`` header know the request by. Everything model-specific comes from the
    request's target: its tokenizer and template, vocabulary and context length. ``next_turn``: a chat reply gets
    its next turn's cache entry (server.core.next_turn); False for a conversation that will not go on (a summary)."""
    target = req.target
    if target is None:
        raise ValueError("a request reaches the core with its target resolved (server.http.target)")
    slot = target.slot
    tok, vocab_size, context_length = slot.tokenizer, slot.vocab_size, slot.context_length
    media = None
    if req.images:  # the prompt is its cache key; the model reads ``media`` at the images (server.core.media)
        prompt, media = await run_in_threadpool(render_media, slot, req, ctx.image_limits)
    else:
        prompt = await run_in_threadpool(render, tok, req, vocab_size)
    grammar = None if req.prompt is not None else await run_in_threadpool(chat_grammar, tok, req)
    params = sampling_params(req, len(prompt), context_length, default_max_tokens=ctx.default_max_tokens,
                             vocab_size=vocab_size, grammar=grammar, defaults=ctx.sampling_defaults(slot))
    if media is not None:  # drafts would be proposed from (and fed as) the key's image tokens
        params = dataclasses.replace(params, num_draft_tokens=0)
    parser = None
    if req.prompt is None:
        tools = req.tools_enabled
        parser = make_output_parser(  # the model family's tool-call format and thinking tags (server.core.output_parse)
            tok, tools=tools, in_reasoning=prompt_opens_thinking(tok, prompt),
            tool_specs=list(req.tools) if tools else None, custom_tools=req.custom_names if tools else ())
    marks = await run_in_threadpool(breakpoint_marks, tok, req, prompt) if req.breakpoints else NO_BREAKPOINTS
    checkpoints = ()
    if slot.facts.needs_checkpoints:  # its caches cannot be cut back: keep their state where the next turn parts
        end = await run_in_threadpool(history_end, tok, req, prompt)
        checkpoints = (end,) if end is not None else ()
    ns = ctx.namespace_for(target, params)
    continues = None  # the request whose reply gets its next turn's entry
    if ctx.next_turns is not None and req.prompt is None:
        await ctx.next_turns.ready(prompt, ns)  # the entry a pending next-turn job is computing, when this extends it
        if media is None and target.lease is None and next_turn:
            continues = req
    return Generation(ctx, request, prompt, params, target, session=req.session, request_id=request_id,
                      parser=parser, anchors=marks.anchors, last_breakpoint=marks.last, checkpoints=checkpoints,
                      media=media, headers=_effort_header(tok, req, target.name), ns=ns, next_turn=continues)


EFFORT_HEADER = "X-Reasoning-Effort"
_efforts_logged: set = set()


def _effort_header(tokenizer, req: GenerationRequest, model: str) -> dict:
    """``X-Reasoning-Effort``: the level the chat template got for the request's effort (absent when the request asked
    none, or the template reads none); a level other than the one asked is logged once per model and pair."""
    if req.reasoning_effort is None or req.prompt is not None:
        return {}
    choice = effort_choice(tokenizer, req)
    if choice.level is None:
        return {}
    if choice.changed and (model, choice.asked) not in _efforts_logged:
        _efforts_logged.add((model, choice.asked))
        levels = ", ".join(template_facts(tokenizer).effort_levels)
        log.info("reasoning effort '%s' -> '%s' for %s: its chat template takes %s (logged once)", choice.asked,
                 choice.level, model, levels)
    return {EFFORT_HEADER: choice.level}


def _internal(ev: Failed) -> APIError:
    if isinstance(ev.error, APIError):
        return ev.error
    return APIError("The server failed while generating this response. The error was logged; please retry.")


def _prefetch(ctx: CoreContext, prompt: list[int], ns: str, session: Optional[str]) -> None:
    """Start reading an SSD-cached prefix now, while the sequence waits for the lane (index lookups only here), in
    the namespace the lane will take from."""
    try:
        ctx.prompt_cache.prefetch(prompt, ns, session)
    except Exception:  # an optimisation: never fail the request for it
        log.exception("prefetch failed")
