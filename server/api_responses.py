"""OpenAI Responses API: ``POST /v1/responses`` (JSON and SSE), ``GET`` / ``DELETE /v1/responses/{id}``.

Validate (schemas_responses), continue a stored conversation (``previous_response_id``, response_store),
translate into the one internal chat request (translate_responses), run it on the generation core, and
format (format_responses). Errors use OpenAI's error body, like chat completions.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from server.errors import InvalidRequest, NotFound
from server.format_responses import ResponsesStream, response_base, response_object, status_of
from server.generation import Done, Error, Generation, KeepAlive, ReasoningOut, TextOut, chat_generation
from server.http_util import SSE_HEADERS, json_response, parse_body
from server.model_names import check_model
from server.response_store import StoredResponse
from server.responses import SSE_KEEPALIVE
from server.schemas_responses import ResponsesRequest
from server.translate_responses import (
    input_items, items_for_history, output_to_items, responses_to_chat, tool_namespaces,
)

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request):
    state = request.app.state.lane_state
    req = await parse_body(request, ResponsesRequest, state.max_body_bytes)
    adapter = check_model(state, req.model)
    history = ()
    if req.previous_response_id:
        prev = state.responses.get(req.previous_response_id)
        if prev is None:
            raise NotFound(f"Previous response with id '{req.previous_response_id}' not found: it was stored with "
                           "store=false, or evicted (the server keeps the most recent responses in memory only). "
                           "Resend the whole conversation as input instead.",
                           param="previous_response_id", code="previous_response_not_found")
        history = prev.history
    chat_req = responses_to_chat(req, history)
    try:
        gen = await chat_generation(state, request, chat_req, "resp_", adapter=adapter)
    except InvalidRequest as exc:  # a schema the grammar library refused: name the Responses field
        if exc.param == "response_format":
            exc.param = "text.format"
            exc.message = exc.message.replace("response_format", "text.format")
        raise
    base = response_base(req, "resp_" + uuid.uuid4().hex, adapter.name if adapter else state.loaded.model_id)
    conversation = (*history, *input_items(req))
    if req.stream:
        await gen.__aenter__()
        return StreamingResponse(_stream(state, gen, req, base, conversation), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, "X-Request-Id": gen.id})
    async with gen:
        res = await gen.collect()
    output = output_to_items(res.text, res.reasoning, res.calls, status=status_of(res.reason),
                             namespaces=tool_namespaces(req))
    obj = response_object(base, output, status_of(res.reason), finished=res.finished,
                          reasoning_tokens=await _count_tokens(state, res.reasoning))
    _store(state, req, obj, conversation)
    return json_response(obj, headers={"X-Request-Id": gen.id})


async def _stream(state, gen: Generation, req: ResponsesRequest, base: dict, conversation: tuple):
    fmt = ResponsesStream(base, tool_namespaces(req))
    reasoning: list[str] = []
    try:
        for chunk in fmt.start():
            yield chunk
        async for ev in gen.events():
            if isinstance(ev, KeepAlive):
                yield SSE_KEEPALIVE
            elif isinstance(ev, TextOut) and ev.text:
                for chunk in fmt.text(ev.text):
                    yield chunk
            elif isinstance(ev, ReasoningOut):
                reasoning.append(ev.text)
                for chunk in fmt.reasoning(ev.text):
                    yield chunk
            elif isinstance(ev, Error):
                for chunk in fmt.fail(ev.error):
                    yield chunk
            elif isinstance(ev, Done):
                chunks = fmt.calls(ev.calls)
                closing, obj = fmt.finish(ev.finished, ev.reason, await _count_tokens(state, "".join(reasoning)))
                _store(state, req, obj, conversation)
                for chunk in chunks + closing:
                    yield chunk
    finally:
        await gen.__aexit__(None, None, None)


def _store(state, req: ResponsesRequest, obj: dict, conversation: tuple) -> None:
    if req.store:
        history = (*conversation, *items_for_history(obj["output"]))
        state.responses.put(obj["id"], StoredResponse(response=obj, history=history))


async def _count_tokens(state, text: str) -> int:
    """Tokens of the model's thinking (usage.output_tokens_details.reasoning_tokens)."""
    if not text:
        return 0
    return len(await run_in_threadpool(state.loaded.tokenizer.encode, text))


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    entry = request.app.state.lane_state.responses.get(response_id)
    if entry is None:
        raise NotFound(f"Response with id '{response_id}' not found (not stored, or evicted).",
                       param="response_id", code="response_not_found")
    return json_response(entry.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    if not request.app.state.lane_state.responses.delete(response_id):
        raise NotFound(f"Response with id '{response_id}' not found (not stored, or evicted).",
                       param="response_id", code="response_not_found")
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
