"""The next turn's cache entry: when a chat reply ends, the conversation as the next request will render it is put in
the prefix cache, so the next turn extends a stored entry instead of parting from one.

Why: a finished request stores its prompt and the tokens it generated. The next turn renders the reply back through
the chat template, and a template that drops past thinking (Qwen3 before the last user turn, DeepSeek-R1, the zoo's
thinking template) or writes the reply otherwise than the model did (whitespace around the think tags, a generation
prompt that opened a think block the history does not show) parts from that entry where the reply began: everything
after it (the answer, a tool call) was prefilled again on the next turn, while the client waited (a peer measured
2,018 tokens re-prefilled for 48 tokens of dropped reasoning). The cache still serves the prompt up to where it
parts; this module makes the entry the next turn will extend.

``NextTurns.finished(...)`` (called by the generation core when a chat reply ends, before its last event reaches the
client) renders the conversation with the reply as every door carries it back (``next_turn_tokens``: its thinking
included, server.core.template_input) up to the opening of the message that follows (the user's, or a tool result's
after calls). When that does not extend the stored entry (it parts from it before the entry's end) and the next turn
would compute at least ``MIN_GAIN`` tokens of it again, it is computed as a job of its own on the lane: an internal
sequence (not counted among the requests served) that prefills the rest of the rendering over the cached part and
decodes one greedy token, its entry put under the request's namespace and session, in the time the client spends
reading the reply or running its tools. A request of the same namespace whose prompt extends such a pending rendering past
where it parted waits for it (``NextTurns.ready``), so the tokens it finds cached never depend on timing.

``NextTurns.prefill(...)`` does the same for a conversation without a reply: a compacted one
(server.http.responses.compact), whose next turn then finds its opening cached.

Not for raw completions, prompts with images, or on-demand models (their lease ends with the response).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass, field
from typing import Optional

from starlette.concurrency import run_in_threadpool

from server.core.prompts import render_chat
from server.core.request import GenerationRequest, custom_call, template_message
from server.errors import APIError
from server.lane.events import Failed, Finished, SamplingParams
from server.lane.sequence import Sequence
from server.lane.target import Target

__all__ = ["NextTurns", "next_turn_tokens", "continuation_tokens"]

log = logging.getLogger("mlx_lane.next_turn")

MIN_GAIN = 8  # fewer tokens than this saved on the next turn: a job of its own costs more (a stop string the reply
# leaves out, a tool call a template does not render: the next turn recomputes a few tokens of its own anyway)
WAIT_S = 120.0  # the longest a request waits for a pending rendering (a job stuck behind a long queue is skipped)
_FOLLOW = ("Go on.", "Next?")  # two follow-up texts that differ from their first character


@dataclass(frozen=True)
class _Job:
    """What a next-turn job computes with: the request's model, its (greedy, one-token) parameters, namespace and
    session."""

    target: Target
    params: SamplingParams
    ns: str
    session: Optional[str]


@dataclass(eq=False)
class _Pending:
    base: int  # where the rendering parts from what the finished request stored
    tokens: Optional[list[int]] = None  # the rendering (None until computed)
    rendered: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


def next_turn_tokens(tokenizer, req: GenerationRequest, text: str, reasoning: str, calls) -> Optional[list[int]]:
    """The tokens of ``req``'s conversation followed by the reply (``text``, ``reasoning``, ``calls`` in OpenAI's
    shape) as the next request renders it, through the opening of the message after it (a tool result's after calls,
    else the user's). None when the template refuses the conversation."""
    reply = template_message("assistant", text, reasoning=reasoning or None,
                             tool_calls=[_as_history(c) for c in calls])
    follow = ((lambda t: [template_message("tool", t, tool_call_id=c["id"]) for c in calls]) if calls
              else (lambda t: [template_message("user", t)]))
    return continuation_tokens(tokenizer, dataclasses.replace(req, messages=(*req.messages, reply)), follow)


def continuation_tokens(tokenizer, req: GenerationRequest, follow=None) -> Optional[list[int]]:
    """The tokens every next request that continues ``req``'s conversation begins with: the common part of two
    renderings that differ only in the text of the message after it (``follow(text)``: the messages; default a user
    message). None when the template refuses the conversation."""
    follow = follow or (lambda t: [template_message("user", t)])
    renders = []
    for text in _FOLLOW:
        try:
            renders.append(render_chat(tokenizer, dataclasses.replace(req, messages=(*req.messages, *follow(text)))))
        except Exception:  # noqa: BLE001 - a template that refuses the cut: no entry, nothing else changes
            return None
    a, b = renders
    return a[:_common(a, b)]


def _as_history(call: dict):
    """A call the model made, as a door's history carries it back."""
    if call.get("type") == "custom":
        return custom_call(call["id"], call["custom"]["name"], call["custom"]["input"])
    return call["id"], call["function"]["name"], call["function"]["arguments"]


def _common(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class NextTurns:
    """Pending next-turn renderings per cache namespace (event-loop side; the jobs run on the lane)."""

    def __init__(self):
        self._pending: dict[str, list[_Pending]] = {}
        self.replies = 0  # chat replies whose next turn was rendered
        self.jobs = 0  # of them, those whose rendering was computed as a job of its own
        self.tokens = 0  # tokens of those renderings past where they parted from the stored entry

    def finished(self, ctx, gen, req: GenerationRequest, text: str, reasoning: str, calls) -> None:
        """A chat reply of ``gen`` ended: render and, when it pays, compute its next turn's entry (in the
        background; the rendering is pending for ``ready`` from now on)."""
        seq = gen.run.seq
        stored = list(gen.prompt) + list(seq.generated[:-1])  # what the finished request put in the cache

        def render():
            return next_turn_tokens(gen.target.tokenizer, req, text, reasoning, list(calls))

        self._start(ctx, gen, render, stored)

    def prefill(self, ctx, gen, req: GenerationRequest) -> None:
        """Compute the opening every continuation of ``req``'s conversation shares (``continuation_tokens``) as an
        entry of its own, under ``gen``'s model, namespace and session (a compacted conversation's, after the
        generation of its summary: its next turn finds it cached)."""
        self._start(ctx, gen, lambda: continuation_tokens(gen.target.tokenizer, req), [])

    def _start(self, ctx, gen, render, stored: list[int]) -> None:
        # the job decodes as the request did (speculating or not: a speculating request's namespace holds its draft's
        # layers too), one greedy token
        params = dataclasses.replace(gen.params, max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                     seed=None, stop=(), presence_penalty=None, frequency_penalty=None,
                                     repetition_penalty=None, logit_bias=None, logprobs=False, top_logprobs=0,
                                     grammar=None)
        seq = gen.run.seq
        pending = _Pending(base=len(stored))
        self._pending.setdefault(seq.ns, []).append(pending)
        job = _Job(gen.target, params, seq.ns, seq.session)
        asyncio.ensure_future(self._compute(ctx, job, render, stored, pending, len(gen.prompt) if stored else 0))

    async def settle(self, timeout: float = WAIT_S) -> None:
        """Wait until no rendering or job is pending (at most ``timeout``): what ``/admin/cache/clear`` does first, so
        that no job's entry lands after the clear."""
        pending = [p.done.wait() for waiting in self._pending.values() for p in waiting]
        if pending:
            try:
                await asyncio.wait_for(asyncio.gather(*pending), timeout)
            except asyncio.TimeoutError:
                log.warning("next-turn jobs still running after %.0fs", timeout)

    def stats(self) -> dict:
        """The ``next_turn`` block of /stats."""
        return {"enabled": True, "replies": self.replies, "jobs": self.jobs, "tokens": self.tokens,
                "pending": sum(len(v) for v in self._pending.values())}

    async def ready(self, prompt: list[int], ns: str) -> None:
        """Wait until no pending rendering of ``ns`` that ``prompt`` extends past its parting point is still being
        computed (at most ``WAIT_S``)."""
        for pending in list(self._pending.get(ns, ())):
            try:
                await asyncio.wait_for(pending.rendered.wait(), WAIT_S)
                if pending.tokens is not None and _common(prompt, pending.tokens) > pending.base:
                    await asyncio.wait_for(pending.done.wait(), WAIT_S)
            except asyncio.TimeoutError:
                log.warning("a request went on without the next-turn entry it extends (still computing)")

    @staticmethod
    def _reuse(job: "_Job", parts: int, prompt_len: int) -> int:
        """What the next turn would find cached without the job: up to where it parts from the stored entry, or for a
        model whose caches cannot be cut back, from a checkpoint at most at the prompt's end."""
        return min(parts, max(prompt_len - 1, 0)) if job.target.slot.facts.needs_checkpoints else parts

    async def _compute(self, ctx, job: "_Job", render, stored: list[int], pending: _Pending,
                       prompt_len: int = 0) -> None:
        try:
            tokens = await run_in_threadpool(render)
            parts = _common(tokens, stored) if tokens is not None else len(stored)
            self.replies += 1
            # only a rendering that parts inside the stored entry (or has none): one that extends it is served by it
            # already (a template that renders the reply as the model wrote it: nothing to do, the common case)
            if tokens and (parts < len(stored) or not stored) and len(tokens) < job.target.slot.context_length \
                    and len(tokens) - self._reuse(job, parts, prompt_len) >= MIN_GAIN:
                pending.tokens, pending.base = tokens, parts
                pending.rendered.set()
                self.tokens += len(tokens) - parts
                await self._run(ctx, job, tokens)
        except APIError as exc:  # the lane refused it (a full queue, a shutdown): the next turn computes it
            log.info("no next-turn cache entry: %s", exc)
        except Exception:  # an optimisation: never fail anything for it
            log.exception("the next turn's cache entry failed")
        finally:
            pending.rendered.set()
            pending.done.set()
            waiting = self._pending.get(job.ns, [])
            if pending in waiting:
                waiting.remove(pending)
            if not waiting:
                self._pending.pop(job.ns, None)

    async def _run(self, ctx, job: "_Job", tokens: list[int]) -> None:
        """Compute ``tokens`` on the lane as a job of its own (one greedy step past them), and wait for its end."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()

        def end(event) -> None:  # the loop's thread
            if not ended.done():
                ended.set_result(event)

        def sink(event) -> None:  # the lane's thread
            if isinstance(event, (Finished, Failed)):
                loop.call_soon_threadsafe(end, event)

        seq = Sequence(prompt=tokens, params=job.params, sink=sink, target=job.target, session=job.session,
                       ns=job.ns, id="next-turn-" + uuid.uuid4().hex[:12], internal=True)
        try:
            ctx.prompt_cache.prefetch(tokens, job.ns, job.session)  # an SSD-cached part starts loading now
        except Exception:  # noqa: BLE001 - an optimisation
            log.exception("prefetch failed")
        ctx.lane.submit(seq)
        self.jobs += 1
        event = await ended
        if isinstance(event, Failed):
            log.warning("the next turn's cache entry failed: %s", event.error)
