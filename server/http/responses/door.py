"""OpenAI Responses API: ``POST /v1/responses`` (JSON and SSE), ``GET`` / ``DELETE /v1/responses/{id}``,
``POST /v1/responses/input_tokens``.

A door of server.http.pipeline: validate (server.http.responses.schemas), continue a stored conversation
(``previous_response_id``, server.http.responses.store), build the internal request (server.http.responses.
translate), and write the response object or its event stream (server.http.responses.format). A finished response
is stored (unless ``store: false``) with the conversation that produced it. Errors use OpenAI's error body.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from server.core.generation import Done, Error, Generation, ReasoningOut, Result, TextOut
from server.core.prompts import chat_prompt
from server.errors import NotFound
from server.http.pipeline import Call, Door, Formatter, run
from server.http.responses.format import ResponsesStream, response_base, response_object, status_of
from server.http.responses.schemas import InputTokensRequest, ResponsesRequest
from server.http.responses.store import StoredResponse
from server.http.responses.translate import (
    input_items, items_for_history, output_to_items, responses_request, tool_index,
)
from server.http.target import resolve_target
from server.http.wire import json_response, parse_body, session_of

router = APIRouter()


class ResponsesOutput(Formatter):
    """A response object at the end, or OpenAI's event stream; either way the response is stored at its end."""

    def __init__(self, state, body: ResponsesRequest, base: dict, conversation: tuple, tokenizer):
        self.state, self.req, self.base, self.conversation = state, body, base, conversation
        self.tokenizer = tokenizer  # the request's model's: reasoning tokens are counted with it
        self.tools = tool_index(body, conversation)  # what each call is: a function, a custom tool, a tool search
        self.stream = ResponsesStream(base, self.tools)
        self._reasoning: list[str] = []

    def head(self) -> list[bytes]:
        return self.stream.start()

    async def on_text(self, ev: TextOut) -> list[bytes]:
        return self.stream.text(ev.text) if ev.text else []

    async def on_reasoning(self, ev: ReasoningOut) -> list[bytes]:
        self._reasoning.append(ev.text)
        return self.stream.reasoning(ev.text)

    async def on_error(self, ev: Error) -> list[bytes]:
        return self.stream.fail(ev.error)

    async def on_done(self, ev: Done) -> list[bytes]:
        frames = self.stream.calls(ev.calls)
        closing, obj = self.stream.finish(ev.finished, ev.reason, await self._count("".join(self._reasoning)))
        self._store(obj)
        return frames + closing

    async def body(self, res: Result) -> dict:
        status = status_of(res.reason)
        output = output_to_items(res.text, res.reasoning, res.calls, status=status, tools=self.tools)
        obj = response_object(self.base, output, status, finished=res.finished,
                              reasoning_tokens=await self._count(res.reasoning))
        self._store(obj)
        return obj

    def _store(self, obj: dict) -> None:
        if self.req.store:
            history = (*self.conversation, *items_for_history(obj["output"]))
            self.state.responses.put(obj["id"], StoredResponse(response=obj, history=history))

    async def _count(self, text: str) -> int:
        """Tokens of the model's thinking (usage.output_tokens_details.reasoning_tokens)."""
        if not text:
            return 0
        return len(await run_in_threadpool(self.tokenizer.encode, text))


def history_of(state, body: ResponsesRequest, local=None) -> tuple:
    """The input items of the stored conversation ``previous_response_id`` continues (none without one); a
    response not stored (or evicted) is a 404. ``local``: a store looked in first (a WebSocket connection's own
    responses, kept even with ``store: false``)."""
    if not body.previous_response_id:
        return ()
    prev = local.get(body.previous_response_id) if local is not None else None
    prev = prev or state.responses.get(body.previous_response_id)
    if prev is None:
        raise NotFound(f"Previous response with id '{body.previous_response_id}' not found: it was stored "
                       "with store=false, or evicted (the server keeps the most recent responses in memory "
                       "only). Resend the whole conversation as input instead.",
                       param="previous_response_id", code="previous_response_not_found")
    return prev.history


class ResponsesDoor(Door):
    schema = ResponsesRequest
    id_prefix = "resp_"

    def stream_error(self, error) -> list[bytes]:
        return ResponsesStream.error_event(error)  # the Responses stream's `error` event

    async def call(self, state, request: Request, body: ResponsesRequest) -> Call:
        history = history_of(state, body)
        req = responses_request(body, history, session=session_of(request.headers, body.prompt_cache_key, body.user),
                                max_tokens_cap=state.max_tokens_cap)
        return Call(req, stream=body.stream, context=(*history, *input_items(body)))

    def formatter(self, state, body: ResponsesRequest, call: Call, gen: Generation) -> Formatter:
        base = response_base(body, "resp_" + uuid.uuid4().hex, gen.model_name, gen.params)
        return ResponsesOutput(state, body, base, call.context, gen.target.tokenizer)


_DOOR = ResponsesDoor()


@router.post("/v1/responses")
async def create_response(request: Request):
    return await run(_DOOR, request)


@router.post("/v1/responses/input_tokens")
async def input_tokens(request: Request):
    """Input tokens of a Responses request (OpenAI's ``POST /v1/responses/input_tokens``): the same translation and
    rendering as ``/v1/responses`` (its model's template, instructions, a stored conversation, tools), so the count
    is that response's ``usage.input_tokens``."""
    state = request.app.state.lane_state
    body = await parse_body(request, InputTokensRequest, state.max_body_bytes)
    req = responses_request(body, history_of(state, body))
    target = await resolve_target(state, body.model)
    try:
        prompt = await run_in_threadpool(chat_prompt, target.slot, req, state.core.image_limits)
    finally:
        target.release()
    return json_response({"object": "response.input_tokens", "input_tokens": len(prompt)})


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
