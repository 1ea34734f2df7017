"""Anthropic Messages API: ``POST /v1/messages`` (JSON and SSE) and ``POST /v1/messages/count_tokens``.

Validate (schemas_messages), translate into the one internal chat request (translate_messages), run it
on the generation core, format (format_messages). Every error under /v1/messages leaves in Anthropic's
shape (server/error_shapes.py, chosen by path in the app's handlers); ``anthropic-version`` and
``anthropic-beta`` headers are accepted and ignored.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from server.format_messages import PING, MessagesStream, message_object
from server.generation import Done, Error, Generation, KeepAlive, ReasoningOut, TextOut, chat_generation
from server.http_util import SSE_HEADERS, json_response, parse_body
from server.model_names import check_model
from server.prompts import render_chat
from server.schemas_messages import CountTokensRequest, MessagesRequest
from server.translate_messages import messages_to_chat

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request):
    state = request.app.state.lane_state
    req = await parse_body(request, MessagesRequest, state.max_body_bytes)
    adapter = check_model(state, req.model)
    gen = await chat_generation(state, request, messages_to_chat(req), "msg_", fit_max_tokens=True, adapter=adapter)
    message_id = "msg_" + uuid.uuid4().hex
    if req.stream:
        fmt = MessagesStream(message_id, req.model, len(gen.prompt))
        await gen.__aenter__()
        return StreamingResponse(_stream(gen, fmt), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, "X-Request-Id": gen.id})
    async with gen:
        res = await gen.collect()
    body = message_object(message_id, req.model, res.text, res.reasoning, res.calls, res.reason, res.stop_sequence,
                          res.finished)
    return json_response(body, headers={"X-Request-Id": gen.id})


async def _stream(gen: Generation, fmt: MessagesStream):
    try:
        for chunk in fmt.start():
            yield chunk
        async for ev in gen.events():
            if isinstance(ev, KeepAlive):
                yield PING
            elif isinstance(ev, TextOut) and ev.text:
                for chunk in fmt.text(ev.text):
                    yield chunk
            elif isinstance(ev, ReasoningOut):
                for chunk in fmt.thinking(ev.text):
                    yield chunk
            elif isinstance(ev, Error):
                for chunk in fmt.fail(ev.error):
                    yield chunk
            elif isinstance(ev, Done):
                for chunk in fmt.finish(ev.calls, ev.reason, ev.stop_sequence, ev.finished):
                    yield chunk
    finally:
        await gen.__aexit__(None, None, None)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """Prompt tokens of a Messages request as this server's model renders it (chat template + tools)."""
    state = request.app.state.lane_state
    req = await parse_body(request, CountTokensRequest, state.max_body_bytes)
    check_model(state, req.model)
    prompt = await run_in_threadpool(render_chat, state.loaded.tokenizer, messages_to_chat(req))
    return json_response({"input_tokens": len(prompt)})
