"""OpenAI's chat completions (``POST /v1/chat/completions``) and text completions (``POST /v1/completions``).

Two doors of server.http.pipeline: each turns its validated wire body (server.http.chat.schemas) into the internal
request and writes the generation as OpenAI's ``chat.completion`` / ``text_completion`` objects or their SSE chunks
(server.http.chat.format). Errors use OpenAI's error body.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.core.generation import Done, Error, Generation, ReasoningOut, Result, TextOut
from server.core.request import GenerationRequest, system_breakpoint, template_message, template_wishes
from server.http.chat.format import ChatFormatter, CompletionFormatter
from server.http.chat.schemas import ChatCompletionRequest, CompletionRequest
from server.http.pipeline import Call, Door, Formatter, run
from server.http.wire import SSE_DONE, session_of, sse

__all__ = ["router", "ChatDoor", "CompletionDoor", "chat_request", "COMPLETIONS_DEFAULT_MAX_TOKENS"]

router = APIRouter()

# OpenAI's legacy /v1/completions default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _sampling(body) -> dict:
    """The sampling fields chat and text completions share, as internal request fields."""
    return dict(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        stop=tuple(body.stop or ()), presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        num_draft_tokens=body.num_draft_tokens,
    )


def chat_request(body: ChatCompletionRequest, headers) -> GenerationRequest:
    """A chat completions body as the internal request."""
    messages = tuple(
        template_message(m.role, m.template_content(i), name=m.name, tool_call_id=m.tool_call_id,
                         tool_calls=[(tc.id, tc.function.name, tc.function.arguments) for tc in m.tool_calls or ()],
                         reasoning=m.past_reasoning())
        for i, m in enumerate(body.messages))
    choice = body.tool_choice if isinstance(body.tool_choice, str) else "auto"
    wishes = template_wishes(body.chat_template_kwargs, effort=body.reasoning_effort)
    return GenerationRequest(
        messages=messages,
        tools=tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
        tool_choice=choice, forced_tool=body.forced_tool(), parallel_tool_calls=body.parallel_tool_calls,
        answer_schema=body.response_format.target_schema() if body.response_format is not None else None,
        max_tokens=body.requested_max_tokens(),
        logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
        session=session_of(headers, body.prompt_cache_key, body.user),
        breakpoints=system_breakpoint(messages), enable_thinking=wishes.enable_thinking,
        reasoning_effort=wishes.reasoning_effort, template_kwargs=wishes.template_kwargs, **_sampling(body),
    )


class ChatOutput(Formatter):
    def __init__(self, chunks: ChatFormatter, include_usage: bool, logprobs: bool):
        self.chunks, self.include_usage, self.logprobs = chunks, include_usage, logprobs

    def head(self) -> list[bytes]:
        return [sse(self.chunks.role_chunk())]

    async def on_text(self, ev: TextOut) -> list[bytes]:
        return [sse(self.chunks.content_chunk(ev.text, list(ev.logprobs)))]

    async def on_reasoning(self, ev: ReasoningOut) -> list[bytes]:
        return [sse(self.chunks.reasoning_chunk(ev.text, []))]

    async def on_error(self, ev: Error) -> list[bytes]:
        return [sse(ev.error.body())]  # then [DONE]: a well-formed end, not a cut connection

    async def on_done(self, ev: Done) -> list[bytes]:
        out = [sse(self.chunks.tool_calls_chunk(list(ev.calls)))] if ev.calls else []
        out.append(sse(self.chunks.finish_chunk(ev.reason)))
        if self.include_usage:
            out.append(sse(self.chunks.usage_chunk(ev.finished)))
        return out

    def tail(self) -> list[bytes]:
        return [SSE_DONE]

    async def body(self, res: Result) -> dict:
        return self.chunks.completion(res.text, res.calls, res.logprobs if self.logprobs else None, res.reason,
                                      res.finished, reasoning=res.reasoning)


class ChatDoor(Door):
    schema = ChatCompletionRequest
    id_prefix = "chatcmpl-"

    async def call(self, state, request: Request, body: ChatCompletionRequest) -> Call:
        return Call(chat_request(body, request.headers), stream=body.stream)

    def formatter(self, state, body: ChatCompletionRequest, call: Call, gen: Generation) -> Formatter:
        chunks = ChatFormatter(model=gen.model_name, fingerprint=state.system_fingerprint, id=gen.id)
        return ChatOutput(chunks, bool(body.stream_options and body.stream_options.include_usage), gen.params.logprobs)


class CompletionOutput(Formatter):
    def __init__(self, chunks: CompletionFormatter, include_usage: bool, logprobs: bool):
        self.chunks, self.include_usage, self.logprobs = chunks, include_usage, logprobs
        self._offset = 0  # characters sent so far: the logprobs' text_offset

    async def on_text(self, ev: TextOut) -> list[bytes]:
        frame = sse(self.chunks.text_chunk(ev.text, list(ev.logprobs), self._offset))
        self._offset += len(ev.text)
        return [frame]

    async def on_error(self, ev: Error) -> list[bytes]:
        return [sse(ev.error.body())]

    async def on_done(self, ev: Done) -> list[bytes]:
        out = [sse(self.chunks.finish_chunk(ev.reason))]
        if self.include_usage:
            out.append(sse(self.chunks.usage_chunk(ev.finished)))
        return out

    def tail(self) -> list[bytes]:
        return [SSE_DONE]

    async def body(self, res: Result) -> dict:
        return self.chunks.completion(res.text, res.logprobs if self.logprobs else None, res.reason, res.finished)


class CompletionDoor(Door):
    schema = CompletionRequest
    id_prefix = "cmpl-"

    async def call(self, state, request: Request, body: CompletionRequest) -> Call:
        prompt = body.prompt if isinstance(body.prompt, str) else tuple(body.prompt)
        req = GenerationRequest(
            prompt=prompt,
            max_tokens=body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS,
            logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
            session=session_of(request.headers, body.prompt_cache_key, body.user),
            names={"messages": "prompt"}, **_sampling(body))
        return Call(req, stream=body.stream)

    def formatter(self, state, body: CompletionRequest, call: Call, gen: Generation) -> Formatter:
        chunks = CompletionFormatter(model=gen.model_name, fingerprint=state.system_fingerprint, id=gen.id)
        return CompletionOutput(chunks, bool(body.stream_options and body.stream_options.include_usage),
                                gen.params.logprobs)


_CHAT, _COMPLETION = ChatDoor(), CompletionDoor()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await run(_CHAT, request)


@router.post("/v1/completions")
async def completions(request: Request):
    return await run(_COMPLETION, request)
