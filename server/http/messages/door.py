"""Anthropic Messages API: ``POST /v1/messages`` (JSON and SSE) and ``POST /v1/messages/count_tokens``.

A door of server.http.pipeline: validate (server.http.messages.schemas), build the internal request
(server.http.messages.translate), and write the message object or its event stream (server.http.messages.format).
Every error under /v1/messages leaves in Anthropic's shape (server.http.error_shapes, chosen by path in the app's
handlers); ``anthropic-version`` and ``anthropic-beta`` headers are accepted and ignored.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from server.core.generation import Done, Error, Generation, ReasoningOut, Result, TextOut
from server.core.prompts import chat_prompt
from server.http.messages.format import PING, MessagesStream, message_object
from server.http.messages.schemas import CountTokensRequest, MessagesRequest
from server.http.messages.translate import messages_request, messages_session
from server.http.pipeline import Call, Door, Formatter, run
from server.http.target import resolve_target
from server.http.wire import json_response, parse_body

router = APIRouter()


class MessagesOutput(Formatter):
    keepalive_frame = PING  # Anthropic's keep-alive is a ping event, not an SSE comment

    def __init__(self, message_id: str, model: str, prompt_tokens: int, last_breakpoint: int = 0, tokenizer=None):
        self.message_id, self.model, self.last_breakpoint = message_id, model, last_breakpoint
        self.stream = MessagesStream(message_id, model, prompt_tokens, last_breakpoint)
        self.tokenizer = tokenizer  # the request's model's: the thinking's tokens are counted with it
        self._thinking: list[str] = []

    def head(self) -> list[bytes]:
        return self.stream.start()

    async def on_text(self, ev: TextOut) -> list[bytes]:
        return self.stream.text(ev.text) if ev.text else []

    async def on_reasoning(self, ev: ReasoningOut) -> list[bytes]:
        self._thinking.append(ev.text)
        return self.stream.thinking(ev.text)

    async def on_error(self, ev: Error) -> list[bytes]:
        return self.stream.fail(ev.error)

    async def on_done(self, ev: Done) -> list[bytes]:
        thinking = await self._count("".join(self._thinking))
        return self.stream.finish(ev.calls, ev.reason, ev.stop_sequence, ev.finished, thinking)

    async def body(self, res: Result) -> dict:
        return message_object(self.message_id, self.model, res.text, res.reasoning, res.calls, res.reason,
                              res.stop_sequence, res.finished, self.last_breakpoint, await self._count(res.reasoning))

    async def _count(self, text: str) -> int:
        """Tokens of the model's thinking (usage.output_tokens_details.thinking_tokens)."""
        if not text or self.tokenizer is None:
            return 0
        return len(await run_in_threadpool(self.tokenizer.encode, text))


class MessagesDoor(Door):
    schema = MessagesRequest
    id_prefix = "msg_"

    def stream_error(self, error) -> list[bytes]:
        return MessagesStream.error_event(error)  # Anthropic's `event: error`

    async def call(self, state, request: Request, body: MessagesRequest) -> Call:
        session = messages_session(request.headers, body.metadata.user_id if body.metadata else None)
        return Call(messages_request(body, session=session, keep_billing_header=state.keep_billing_header),
                    stream=body.stream)

    def formatter(self, state, body: MessagesRequest, call: Call, gen: Generation) -> Formatter:
        return MessagesOutput("msg_" + uuid.uuid4().hex, body.model, len(gen.prompt), gen.last_breakpoint,
                              gen.target.tokenizer)


_DOOR = MessagesDoor()


@router.post("/v1/messages")
async def create_message(request: Request):
    return await run(_DOOR, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """Prompt tokens of a Messages request as the model it names renders it (its chat template + tools)."""
    state = request.app.state.lane_state
    req = await parse_body(request, CountTokensRequest, state.max_body_bytes)
    target = await resolve_target(state, req.model)
    try:
        req_ = messages_request(req, keep_billing_header=state.keep_billing_header)
        prompt = await run_in_threadpool(chat_prompt, target.slot, req_, state.core.image_limits)
    finally:
        target.release()
    return json_response({"input_tokens": len(prompt)})
