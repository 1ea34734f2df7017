"""Responses over a WebSocket: ``ws://HOST/v1/responses`` (OpenAI's WebSocket mode, which Codex CLI speaks and the
openai SDK's ``client.responses.connect()`` opens).

- The handshake passes the checks every HTTP request passes (Host, Origin, the API key: server.http.guard); a
  refused one is answered with the HTTP error (403 / 401) in OpenAI's error shape.
- The client sends JSON text frames ``{"type": "response.create", ...}`` holding the fields of a ``POST
  /v1/responses`` body (``stream`` is implied; ``stream_id``, when given, is echoed on each of that response's
  events). The server answers each with the events a streamed ``POST /v1/responses`` sends (``response.created``
  ... ``response.completed``), one JSON text frame per event. Responses run one at a time per connection, in the
  order their creates arrived.
- ``previous_response_id`` names a response of this connection (kept for the connection's life even with ``store:
  false``, as OpenAI's WebSocket mode keeps a connection's responses in memory: Codex sends ``store: false`` and
  then only the new input) or a stored one. An unknown one is an ``error`` event with ``code:
  previous_response_not_found`` (status 404): resend the whole conversation; the connection stays open.
- A request that fails before its response starts (a bad frame, an unknown model, a full queue) is one ``error``
  event (``{"type": "error", "status", "code", "message", "param", "error": {...}, "sequence_number": 0}``: the
  SDK's error event and the ``error`` object Codex reads); one that fails midway ends with ``response.failed``.
- Closing the socket cancels the response that is running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Optional

import orjson
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from server.core.generation import open_generation
from server.errors import APIError, InvalidRequest, PayloadTooLarge
from server.http.guard import connection_refusal, error_response
from server.http.responses.door import ResponsesOutput, history_of
from server.http.responses.format import error_fields, response_base
from server.http.responses.schemas import ResponsesRequest
from server.http.responses.store import ResponseStore, StoredResponse
from server.http.responses.translate import input_items, items_for_history, responses_request
from server.http.target import acquire, resolve
from server.http.wire import session_of, validate_body

__all__ = ["router", "event_data"]

log = logging.getLogger("mlx_lane.responses")

router = APIRouter()

_KEPT = 64  # a connection's own responses kept for previous_response_id (the latest ones)


@router.websocket("/v1/responses")
async def responses_socket(ws: WebSocket):
    state = ws.app.state.lane_state
    refused = connection_refusal(state, ws)
    if refused is not None:
        try:
            await ws.send_denial_response(error_response(ws, refused))  # the HTTP error, in OpenAI's shape
        except RuntimeError:  # a server without the ASGI denial-response extension: a bare 403
            await ws.close(code=1008)
        return
    await ws.accept()
    await _Connection(state, ws).serve()


def event_data(frame: bytes) -> Optional[bytes]:
    """The JSON of one server-sent event (``event: TYPE\\ndata: JSON\\n\\n``, what the Responses formatter writes);
    None for a comment (a keep-alive: the WebSocket keeps itself alive)."""
    _, sep, data = frame.partition(b"data: ")
    return data.rstrip(b"\n") if sep else None


class _Disconnected:
    """What the generation core watches for a client that left (its ``receive()``): the socket's closing."""

    def __init__(self, closed: asyncio.Event):
        self.closed = closed

    async def receive(self) -> dict:
        await self.closed.wait()
        return {"type": "http.disconnect"}


class _SocketOutput(ResponsesOutput):
    """The door's formatter, whose finished responses are also kept for this connection."""

    def __init__(self, *args, local: ResponseStore):
        super().__init__(*args)
        self.local = local

    def _store(self, obj: dict) -> None:
        super()._store(obj)
        self.local.put(obj["id"], StoredResponse(response=obj, history=(*self.conversation,
                                                                        *items_for_history(obj["output"]))))


class _Connection:
    def __init__(self, state, ws: WebSocket):
        self.state, self.ws = state, ws
        self.local = ResponseStore(_KEPT)
        self.closed = asyncio.Event()
        self.inbox: asyncio.Queue = asyncio.Queue()

    async def serve(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            while (text := await self.inbox.get()) is not None:
                await self._one(text)
        except (WebSocketDisconnect, RuntimeError) as exc:  # sending to a client that left
            log.debug("websocket closed while sending: %s", exc)
        finally:
            reader.cancel()
            if self.ws.application_state == WebSocketState.CONNECTED and not self.closed.is_set():
                await self.ws.close()

    async def _read(self) -> None:
        """Every frame into the inbox as it arrives (so a close is seen while a response runs)."""
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    text = (message.get("bytes") or b"").decode("utf-8", errors="replace")
                await self.inbox.put(text)
        except (RuntimeError, WebSocketDisconnect):
            return
        finally:
            self.closed.set()
            self.inbox.put_nowait(None)

    async def _send(self, data: bytes, stream_id: Optional[str]) -> None:
        if stream_id is not None:
            data = orjson.dumps({**orjson.loads(data), "stream_id": stream_id})
        await self.ws.send_text(data.decode())

    async def _fail(self, error: APIError, stream_id: Optional[str]) -> None:
        shape = {"type": error.type, **error_fields(error)}
        event = {"type": "error", "status": error.status_code, **{k: v for k, v in shape.items() if k != "type"},
                 "error": shape, "sequence_number": 0}
        await self._send(orjson.dumps(event), stream_id)

    async def _one(self, text: str) -> None:
        """One ``response.create``: its events, or one ``error`` event."""
        stream_id = None
        try:
            if len(text.encode()) > self.state.max_body_bytes:
                raise PayloadTooLarge(f"The event is larger than {self.state.max_body_bytes} bytes.")
            try:
                obj = orjson.loads(text)
            except orjson.JSONDecodeError:
                raise InvalidRequest("The event is not valid JSON (UTF-8 encoded).") from None
            if not isinstance(obj, dict):
                raise InvalidRequest("An event must be a JSON object.")
            stream_id = obj.pop("stream_id", None) if isinstance(obj.get("stream_id"), str) else None
            kind = obj.pop("type", None)
            if kind != "response.create":
                raise InvalidRequest(f"Unsupported event type {kind!r}: this server takes 'response.create'.",
                                     param="type")
            body = validate_body({**obj, "stream": True}, ResponsesRequest)
            history = history_of(self.state, body, self.local)
            req = responses_request(body, history, session=session_of(self.ws.headers, body.prompt_cache_key,
                                                                      body.user),
                                    max_tokens_cap=self.state.max_tokens_cap)
            target = await acquire(self.state, resolve(self.state, body.model))
        except APIError as exc:
            await self._fail(exc, stream_id)
            return
        await self._run(body, req, (*history, *input_items(body)), target, stream_id)

    async def _run(self, body: ResponsesRequest, req, conversation: tuple, target, stream_id) -> None:
        gen = None
        try:
            gen = await open_generation(self.state.core, _Disconnected(self.closed),
                                        dataclasses.replace(req, target=target), "resp_" + uuid.uuid4().hex)
            fmt = _SocketOutput(self.state, body, response_base(body, gen.id, gen.model_name, gen.params), conversation,
                                gen.target.tokenizer, local=self.local)
            await gen.__aenter__()
        except APIError as exc:
            if gen is not None:
                await gen.__aexit__(None, None, None)
            target.release()
            await self._fail(exc, stream_id)
            return
        try:
            for frame in fmt.head():
                await self._send(event_data(frame), stream_id)
            async for ev in gen.events():
                for frame in await getattr(fmt, ev.hook)(ev):
                    data = event_data(frame)
                    if data is not None:
                        await self._send(data, stream_id)
        finally:
            await gen.__aexit__(None, None, None)
            target.release()

