"""Generation endpoints: /v1/chat/completions and /v1/completions (JSON and SSE), over the generation core."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from server.generation import Done, Error, Generation, KeepAlive, ReasoningOut, TextOut, chat_generation
from server.http_util import SSE_HEADERS, json_response, parse_body
from server.model_names import check_model
from server.prompts import (COMPLETIONS_DEFAULT_MAX_TOKENS, sampling_params, session_header, session_of,
                            tokenize_completion)
from server.responses import SSE_DONE, SSE_KEEPALIVE, ChatFormatter, CompletionFormatter, sse
from server.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()
log = logging.getLogger("mlx_lane.routes")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = request.app.state.lane_state
    req = await parse_body(request, ChatCompletionRequest, state.max_body_bytes)
    adapter = check_model(state, req.model)
    gen = await chat_generation(state, request, req, "chatcmpl-", adapter=adapter)
    fmt = ChatFormatter(model=adapter.name if adapter else state.loaded.model_id, fingerprint=state.system_fingerprint, id=gen.id)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        await gen.__aenter__()
        return StreamingResponse(_chat_stream(gen, fmt, include_usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, "X-Request-Id": gen.id})
    async with gen:
        res = await gen.collect()
    body = fmt.completion(res.text, res.calls, res.logprobs if gen.params.logprobs else None, res.reason,
                          res.finished, reasoning=res.reasoning)
    return json_response(body, headers={"X-Request-Id": gen.id})


async def _chat_stream(gen: Generation, fmt: ChatFormatter, include_usage: bool):
    try:
        yield sse(fmt.role_chunk())
        async for ev in gen.events():
            if isinstance(ev, KeepAlive):
                yield SSE_KEEPALIVE
            elif isinstance(ev, TextOut):
                yield sse(fmt.content_chunk(ev.text, list(ev.logprobs)))
            elif isinstance(ev, ReasoningOut):
                yield sse(fmt.reasoning_chunk(ev.text, []))
            elif isinstance(ev, Error):
                yield sse(ev.error.body())  # then [DONE]: a well-formed end, not a cut connection
            elif isinstance(ev, Done):
                if ev.calls:
                    yield sse(fmt.tool_calls_chunk(list(ev.calls)))
                yield sse(fmt.finish_chunk(ev.reason))
                if include_usage:
                    yield sse(fmt.usage_chunk(ev.finished))
        yield SSE_DONE
    finally:
        await gen.__aexit__(None, None, None)


@router.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state.lane_state
    req = await parse_body(request, CompletionRequest, state.max_body_bytes)
    adapter = check_model(state, req.model)
    prompt = await run_in_threadpool(tokenize_completion, state.loaded.tokenizer, req, state.vocab_size)
    if req.max_tokens is None:
        req = req.model_copy(update={"max_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS})
    params = sampling_params(req, len(prompt), state.loaded.context_length,
                             default_max_tokens=state.default_max_tokens, vocab_size=state.vocab_size)
    gen = Generation(state, request, prompt, params, session=session_of(session_header(request.headers), req),
                     id_prefix="cmpl-", adapter=adapter)
    fmt = CompletionFormatter(model=adapter.name if adapter else state.loaded.model_id, fingerprint=state.system_fingerprint, id=gen.id)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        await gen.__aenter__()
        return StreamingResponse(_completion_stream(gen, fmt, include_usage), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, "X-Request-Id": gen.id})
    async with gen:
        res = await gen.collect()
    return json_response(fmt.completion(res.text, res.logprobs if params.logprobs else None, res.reason,
                                        res.finished), headers={"X-Request-Id": gen.id})


async def _completion_stream(gen: Generation, fmt: CompletionFormatter, include_usage: bool):
    offset = 0
    try:
        async for ev in gen.events():
            if isinstance(ev, KeepAlive):
                yield SSE_KEEPALIVE
            elif isinstance(ev, TextOut):
                yield sse(fmt.text_chunk(ev.text, list(ev.logprobs), offset))
                offset += len(ev.text)
            elif isinstance(ev, Error):
                yield sse(ev.error.body())
            elif isinstance(ev, Done):
                yield sse(fmt.finish_chunk(ev.reason))
                if include_usage:
                    yield sse(fmt.usage_chunk(ev.finished))
        yield SSE_DONE
    finally:
        await gen.__aexit__(None, None, None)
