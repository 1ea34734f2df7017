"""One pipeline for every generating front door: parse, open, then stream or collect.

A door (chat completions, text completions, /v1/responses, /v1/messages) is a small object that knows its API and
nothing else::

    schema                         its pydantic wire type (validated once, by ``parse_body``)
    id_prefix                      the response id's prefix ("chatcmpl-", "resp_", ...)
    async call(state, request, body) -> Call     the wire body as the internal request (+ stream or not)
    formatter(state, body, call, generation) -> Formatter

``run(door, request)`` does the rest, the same for all four: read and validate the body, resolve its model name once
into a ``Target`` (server.http.target), let the door build the internal request (server.core.request), open the
generation on that target (server.core.generation: template, grammar, sampling,
off the event loop), then either stream the formatter's frames as server-sent events or collect the whole result
and answer the formatter's JSON body. Errors raised on the way are ``APIError``s; the app maps each into the error
shape of the API the path belongs to (server.http.error_shapes), and a stream that fails midway ends with the
formatter's own error frames.

A ``Formatter`` writes one generation in its API's shape: ``head()`` (frames before the first event),
``on_text`` / ``on_reasoning`` / ``on_keepalive`` / ``on_done`` / ``on_error`` (one per generation event: each event
names its hook, so nothing here tests types), ``tail()`` (after the end, e.g. ``data: [DONE]``), and ``body(result)``
(the non-streamed response).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from server.core.generation import Done, Error, Generation, KeepAlive, ReasoningOut, Result, TextOut, open_generation
from server.core.request import GenerationRequest
from server.lane.target import Target
from server.errors import APIError
from server.http.target import acquire, resolve
from server.http.wire import SSE_DONE, SSE_HEADERS, SSE_KEEPALIVE, json_response, parse_body, request_id, sse

__all__ = ["Call", "Door", "Formatter", "run"]


@dataclass(frozen=True)
class Call:
    """What a door made of one request: the internal request, and whether the client wants a stream."""

    request: GenerationRequest
    stream: bool = False
    context: Any = None  # anything of the door's own its formatter needs (e.g. a Responses conversation)


class Formatter:
    """One generation in an API's shape (see the module docstring). The defaults write nothing, and a keep-alive
    as an SSE comment; each door overrides what its API sends."""

    keepalive_frame = SSE_KEEPALIVE

    def head(self) -> list[bytes]:
        return []

    async def on_text(self, ev: TextOut) -> list[bytes]:
        return []

    async def on_reasoning(self, ev: ReasoningOut) -> list[bytes]:
        return []

    async def on_keepalive(self, ev: KeepAlive) -> list[bytes]:
        return [self.keepalive_frame]

    async def on_done(self, ev: Done) -> list[bytes]:
        raise NotImplementedError

    async def on_error(self, ev: Error) -> list[bytes]:
        raise NotImplementedError

    def tail(self) -> list[bytes]:
        return []

    async def body(self, result: Result) -> dict:
        raise NotImplementedError


class Door:
    """A front door (see the module docstring); subclasses set ``schema`` and ``id_prefix``."""

    schema: Any
    id_prefix: str

    async def call(self, state, request: Request, body) -> Call:
        raise NotImplementedError

    def formatter(self, state, body, call: Call, gen: Generation) -> Formatter:
        raise NotImplementedError

    def stream_error(self, error: APIError) -> list[bytes]:
        """The events of an error that ends a stream before its first event (OpenAI's shape: an error object,
        then [DONE]); the Anthropic and Responses doors write their own."""
        return [sse(error.body()), SSE_DONE]


async def run(door: Door, request: Request):
    """Serve one request through ``door``: a JSON response, or a stream of server-sent events."""
    state = request.app.state.lane_state
    body = await parse_body(request, door.schema, state.max_body_bytes)
    rid = request_id(request, door.id_prefix)
    resolution = resolve(state, getattr(body, "model", None))  # the request's model, once (server.http.target)
    if getattr(body, "stream", False) and resolution.must_load(state):
        # the model loads first: the stream starts now and keeps the client's connection alive meanwhile
        return StreamingResponse(_after_load(door, state, request, body, resolution, rid),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": rid})
    target = await acquire(state, resolution)  # an on-demand model: loaded and held until the response ends
    try:
        call, gen, fmt = await _open(door, state, request, body, target, rid)
        headers = {"X-Request-Id": gen.id, **gen.headers}
        if call.stream:
            await gen.__aenter__()  # submits the job (may raise QueueFull: a 429 before any byte is sent)
            frames, target = _frames(gen, fmt, target), None  # the stream releases the model when it ends
            return StreamingResponse(frames, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        async with gen:
            result = await gen.collect()
        return json_response(await fmt.body(result), headers=headers)
    finally:
        if target is not None:
            target.release()


async def _open(door: Door, state, request: Request, body, target: Target, rid: str):
    """The door's call, its generation (on the request's target model) and its formatter."""
    call = await door.call(state, request, body)
    call = dataclasses.replace(call, request=dataclasses.replace(call.request, target=target))
    gen = await open_generation(state.core, request, call.request, rid)
    return call, gen, door.formatter(state, body, call, gen)


async def _after_load(door: Door, state, request: Request, body, resolution, rid: str) -> AsyncIterator[bytes]:
    """A stream whose model is loading: SSE comments every --keepalive seconds until it is in, then the stream
    itself. What fails before the first event (the load, the prompt's checks, a full queue) is the door's error
    event, since the status line is already sent."""
    task = asyncio.ensure_future(acquire(state, resolution))
    target = None
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=state.keepalive_s)
            if not task.done():
                yield SSE_KEEPALIVE
        target = task.result()
        call, gen, fmt = await _open(door, state, request, body, target, rid)
        await gen.__aenter__()
    except APIError as exc:
        if target is not None:
            target.release()
        for frame in door.stream_error(exc):
            yield frame
        return
    finally:
        if not task.done():  # the client left while the model loaded: the load goes on for the others
            task.cancel()
    frames = _frames(gen, fmt, target)
    try:
        async for frame in frames:
            yield frame
    finally:  # a client that leaves mid-stream: the job is cancelled and the model given back now, not at GC
        await frames.aclose()


async def _frames(gen: Generation, fmt: Formatter, target: Optional[Target] = None) -> AsyncIterator[bytes]:
    try:
        for frame in fmt.head():
            yield frame
        async for ev in gen.events():
            for frame in await getattr(fmt, ev.hook)(ev):
                yield frame
        for frame in fmt.tail():
            yield frame
    finally:
        await gen.__aexit__(None, None, None)
        if target is not None:
            target.release()
