"""Generation endpoints: /v1/chat/completions and /v1/completions (JSON and SSE)."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Optional

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pydantic import ValidationError

from server.errors import APIError, InvalidRequest, ModelNotFound, PayloadTooLarge, ShuttingDown
from server.jobrun import JobRun
from server.jobs import Delta, Failed, Finished, Progress
from server.output_parse import OutputParser, make_output_parser, prompt_opens_thinking
from server.prompts import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_grammar,
    render_chat,
    sampling_params,
    session_of,
    tokenize_completion,
)
from server.responses import SSE_DONE, SSE_KEEPALIVE, ChatFormatter, CompletionFormatter, sse
from server.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()
log = logging.getLogger("mlx_lane.routes")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id(request: Request, prefix: str) -> str:
    """The client's ``X-Request-Id`` when it is a short safe token, else a fresh one."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else prefix + uuid.uuid4().hex


def _json(obj, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


async def _parse(request: Request, schema, max_bytes: int):
    """Read and validate a JSON body whatever its Content-Type (curl -d sends form-encoded)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"The request body is larger than {max_bytes} bytes.")
        chunks.append(chunk)
    try:
        obj = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError:
        raise InvalidRequest("The request body is not valid JSON (UTF-8 encoded).") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise InvalidRequest(message, param=param) from None


def validation_message(errors: list) -> tuple[str, Optional[str]]:
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param:
        return f"Invalid value for '{param}': {msg}", param
    return f"Invalid request: {msg}", None


def _check_model(state, requested: Optional[str]) -> None:
    if requested and requested not in state.model_names:
        raise ModelNotFound(
            f"The model '{requested}' does not exist on this server. Served: {', '.join(sorted(state.model_names))}",
            param="model",
        )


def _prefetch(state, prompt: list[int], params, session: Optional[str]) -> None:
    """Start reading an SSD-cached prefix now, while the job waits for the lane (index lookups only here), in the
    namespace the lane will take from (the engine decides it: a speculating request's includes the draft)."""
    try:
        state.prompt_cache.prefetch(prompt, state.lane.engine.namespace_for(params), session)
    except Exception:  # an optimisation: never fail the request for it
        log.exception("prefetch failed")


def _internal(ev: Failed) -> APIError:
    if isinstance(ev.error, APIError):
        return ev.error
    return APIError("The server failed while generating this response. The error was logged; please retry.")


def _cut_short(run: JobRun, ev: Finished) -> APIError:
    """The error that ends a response whose job was cancelled while its client was still reading: only the server
    does that (a client that left reads nothing), when its --shutdown-timeout ran out (Lane.abort)."""
    if run.lane.aborted:
        return ShuttingDown(f"The server is shutting down: its --shutdown-timeout ended this response after "
                            f"{ev.completion_tokens} tokens. Retry in a moment.", retry_after_s=5)
    return APIError("The server cancelled this response. Please retry.", code="cancelled")


def _prepare(state, request: Request, req, prompt: list[int], params, formatter, id_prefix: str):
    """Session, SSD prefetch (starts while the job waits for the lane), request id, formatter, job run."""
    session = session_of(request.headers.get("x-session-id"), req)
    state.lane.check_fits(len(prompt), params.max_tokens)  # 400 when the memory budget can never admit it
    _prefetch(state, prompt, params, session)
    rid = request_id(request, id_prefix)
    fmt = formatter(model=state.loaded.model_id, fingerprint=state.system_fingerprint, id=rid)
    run = JobRun(state.lane, request, prompt, params, session, state.keepalive_s, request_id=rid)
    return run, fmt, rid, time.monotonic()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = request.app.state.lane_state
    req = await _parse(request, ChatCompletionRequest, state.max_body_bytes)
    _check_model(state, req.model)
    tok = state.loaded.tokenizer
    prompt = await run_in_threadpool(render_chat, tok, req)
    grammar = await run_in_threadpool(chat_grammar, tok, req)  # response_format / forced tool calls, or None
    params = sampling_params(
        req.model_copy(update={"max_tokens": req.requested_max_tokens()}), len(prompt),
        state.loaded.context_length, default_max_tokens=state.default_max_tokens, vocab_size=state.vocab_size,
        grammar=grammar,
    )
    parser = _output_parser(tok, req, prompt)
    run, fmt, rid, t0 = _prepare(state, request, req, prompt, params, ChatFormatter, "chatcmpl-")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        await run.__aenter__()
        return StreamingResponse(
            _chat_stream(run, fmt, include_usage, parser, state.stats, t0),
            media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": rid},
        )
    async with run:
        text, lps, finished = await _collect(run, state.stats, t0)
    reasoning, content, calls = parser.complete(text)
    reason = "tool_calls" if calls else finished.finish_reason
    return _json(fmt.completion(content, calls, lps if params.logprobs else None, reason, finished,
                                reasoning=reasoning), headers={"X-Request-Id": rid})


def _output_parser(tok, req: ChatCompletionRequest, prompt: list[int]) -> OutputParser:
    """Splits the reply into text, reasoning and tool calls in the model family's format (server.output_parse)."""
    tools = req.tools_enabled()
    specs = [t.model_dump(exclude_none=True) for t in req.tools] if tools else None
    return make_output_parser(tok, tools=tools, in_reasoning=prompt_opens_thinking(tok, prompt), tool_specs=specs)


async def _collect(run: JobRun, stats, t0: float):
    parts: list[str] = []
    lps: list = []
    async for ev in run.events():
        if isinstance(ev, Delta):
            if ev.first_token:
                stats.observe_ttft(time.monotonic() - t0)
            parts.append(ev.text)
            lps.extend(ev.logprobs)
        elif isinstance(ev, Failed):
            raise _internal(ev)
        elif isinstance(ev, Finished) and ev.finish_reason == "cancelled":
            raise _cut_short(run, ev)
        elif isinstance(ev, Finished):
            stats.observe_e2e(time.monotonic() - t0)
            return "".join(parts), lps, ev
    raise APIError("generation ended without a result")


async def _chat_stream(run: JobRun, fmt: ChatFormatter, include_usage: bool, parser: OutputParser, stats, t0):
    try:
        yield sse(fmt.role_chunk())
        async for ev in run.events():
            if ev is None or isinstance(ev, Progress):
                if ev is None:
                    yield SSE_KEEPALIVE
                continue
            if isinstance(ev, Delta):
                if ev.first_token:
                    stats.observe_ttft(time.monotonic() - t0)
                for chunk in fmt.piece_chunks(parser.feed(ev.text), list(ev.logprobs)):
                    yield sse(chunk)
            elif isinstance(ev, Failed):
                yield sse(_internal(ev).body())
                break
            elif isinstance(ev, Finished) and ev.finish_reason == "cancelled":
                yield sse(_cut_short(run, ev).body())  # then [DONE]: a well-formed end, not a cut connection
                break
            elif isinstance(ev, Finished):
                stats.observe_e2e(time.monotonic() - t0)
                reason = ev.finish_reason
                rest, calls = parser.finish()
                for chunk in fmt.piece_chunks(rest, []):
                    yield sse(chunk)
                if calls:
                    yield sse(fmt.tool_calls_chunk(calls))
                    reason = "tool_calls"
                yield sse(fmt.finish_chunk(reason))
                if include_usage:
                    yield sse(fmt.usage_chunk(ev))
        yield SSE_DONE
    finally:
        await run.__aexit__(None, None, None)


@router.post("/v1/completions")
async def completions(request: Request):
    state = request.app.state.lane_state
    req = await _parse(request, CompletionRequest, state.max_body_bytes)
    _check_model(state, req.model)
    prompt = await run_in_threadpool(tokenize_completion, state.loaded.tokenizer, req, state.vocab_size)
    if req.max_tokens is None:
        req = req.model_copy(update={"max_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS})
    params = sampling_params(req, len(prompt), state.loaded.context_length,
                             default_max_tokens=state.default_max_tokens, vocab_size=state.vocab_size)
    run, fmt, rid, t0 = _prepare(state, request, req, prompt, params, CompletionFormatter, "cmpl-")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        await run.__aenter__()
        return StreamingResponse(_completion_stream(run, fmt, include_usage, state.stats, t0),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": rid})
    async with run:
        text, lps, finished = await _collect(run, state.stats, t0)
    return _json(fmt.completion(text, lps if params.logprobs else None, finished.finish_reason, finished),
                 headers={"X-Request-Id": rid})


async def _completion_stream(run: JobRun, fmt: CompletionFormatter, include_usage: bool, stats, t0):
    offset = 0
    try:
        async for ev in run.events():
            if ev is None:
                yield SSE_KEEPALIVE
            elif isinstance(ev, Delta):
                if ev.first_token:
                    stats.observe_ttft(time.monotonic() - t0)
                if ev.text or ev.logprobs:
                    yield sse(fmt.text_chunk(ev.text, list(ev.logprobs), offset))
                    offset += len(ev.text)
            elif isinstance(ev, Failed):
                yield sse(_internal(ev).body())
                break
            elif isinstance(ev, Finished) and ev.finish_reason == "cancelled":
                yield sse(_cut_short(run, ev).body())
                break
            elif isinstance(ev, Finished):
                stats.observe_e2e(time.monotonic() - t0)
                yield sse(fmt.finish_chunk(ev.finish_reason))
                if include_usage:
                    yield sse(fmt.usage_chunk(ev))
        yield SSE_DONE
    finally:
        await run.__aexit__(None, None, None)
