"""Small HTTP helpers shared by every API front door: JSON bodies in and out, request ids, SSE framing, sessions.

``parse_body`` reads a JSON body whatever its Content-Type and validates it with a pydantic schema; every
failure is an ``InvalidRequest`` (400) or ``PayloadTooLarge`` (413) naming the parameter. Each API maps
those errors into its own error shape at the app boundary (server/http/error_shapes.py).
"""

from __future__ import annotations

import re
import uuid
from typing import Optional

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from server.errors import InvalidRequest, PayloadTooLarge

__all__ = ["SSE_HEADERS", "SSE_DONE", "SSE_KEEPALIVE", "sse", "json_response", "read_json", "parse_body",
           "validate_body", "request_id",
           "validation_message", "session_header", "session_of"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (OpenAI's framing: data lines only)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def session_header(headers) -> Optional[str]:
    """The session a request's headers name: ``X-Session-Id``, else ``session-id`` (what Codex CLI 0.171 sends),
    else ``session_id`` (older Codex CLIs); the replicas' proxy routes on the same ones (deploy/haproxy.cfg.in)."""
    return headers.get("x-session-id") or headers.get("session-id") or headers.get("session_id") or None


def session_of(headers, *fallbacks: Optional[str]) -> Optional[str]:
    """The prefix cache's session of a request: its header (``session_header``), else the first of the body's own
    session fields that is set (``prompt_cache_key``, then ``user``, for the OpenAI APIs)."""
    return session_header(headers) or next((f for f in fallbacks if f), None)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id(request: Request, prefix: str) -> str:
    """The client's ``X-Request-Id`` when it is a short safe token, else a fresh one."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else prefix + uuid.uuid4().hex


def json_response(obj, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object (curl -d sends form-encoded JSON: the Content-Type is not trusted)."""
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
    return obj


async def parse_body(request: Request, schema, max_bytes: int):
    """Read and validate a JSON body into ``schema`` (a pydantic model class)."""
    return validate_body(await read_json(request, max_bytes), schema)


def validate_body(obj: dict, schema):
    """A JSON body already read (``read_json``) validated into ``schema``; a failure is an ``InvalidRequest``."""
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise InvalidRequest(message, param=param) from None


_BRANCH_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "constrained-str", "literal"}


def _clean_loc(loc) -> list[str]:
    """A pydantic error location as the client's parameter path: union branch labels (``list[tagged-union[...]]``,
    ``str``, a model's class name) and the tag after a tagged-union index are not part of it."""
    out: list[str] = []
    raw = [p for p in loc if p != "body"]
    for i, part in enumerate(raw):
        if isinstance(part, str) and ("[" in part or part in _BRANCH_NAMES or part[:1].isupper()):
            continue
        if isinstance(part, str) and i >= 2 and isinstance(raw[i - 1], int) and "tagged-union" in str(raw[i - 2]):
            continue
        out.append(str(part))
    return out


def validation_message(errors: list) -> tuple[str, Optional[str]]:
    """The most specific pydantic error as (message, dotted parameter path): with unions pydantic reports every
    branch's failure, and the deepest location is the branch the client meant."""
    if not errors:
        return "Invalid request.", None
    first = max(errors, key=lambda e: len(_clean_loc(e.get("loc", ()))))
    loc = _clean_loc(first.get("loc", ()))
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param:
        return f"Invalid value for '{param}': {msg}", param
    return f"Invalid request: {msg}", None
