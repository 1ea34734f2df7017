"""The FastAPI application: state, auth and size limits, error mapping, small endpoints.

``create_app(state)`` wires a ready ``ServerState`` (model loaded, lane started by the
lifespan) to the routes. Every error leaves as OpenAI's error body; nothing internal
(stack traces, file paths) is ever put in a response.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import APIError, AuthenticationError, PayloadTooLarge, error_body
from server.lane import Lane
from server.routes import router, validation_message
from server.stats import ServingStats

log = logging.getLogger("mlx_lane.app")


@dataclass
class ServerState:
    loaded: object  # models.LoadedModel
    lane: Lane
    stats: ServingStats
    prompt_cache: object
    device: str
    blas: str
    api_key: Optional[str] = None
    keepalive_s: float = 10.0
    default_max_tokens: int = 2048
    max_body_bytes: int = 8 * 1024 * 1024
    model_names: set = field(default_factory=set)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def __post_init__(self):
        self.model_names = {self.loaded.model_id} | set(self.model_names)
        args = getattr(self.loaded.model, "args", None)
        self._vocab_size = getattr(args, "vocab_size", None) or len(self.loaded.tokenizer.vocab)
        self.system_fingerprint = "fp_" + self.loaded.fingerprint[:12]


def _json(obj, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.lane.stop()

    app = FastAPI(title="mlx-lane", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.lane_state = state
    app.include_router(router)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if state.api_key and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), state.api_key.encode()):
                err = AuthenticationError("Incorrect or missing API key. Send 'Authorization: Bearer <key>'.")
                return _json(err.body(), err.status_code, {"WWW-Authenticate": "Bearer"})
        length = request.headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > state.max_body_bytes
            except ValueError:
                too_big = True
            if too_big:
                err = PayloadTooLarge(f"The request body is larger than {state.max_body_bytes} bytes.")
                return _json(err.body(), err.status_code)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return _json(exc.body(), exc.status_code, exc.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return _json(error_body(message, "invalid_request_error", param, None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return _json(error_body(str(exc.detail), "invalid_request_error", None, kind), exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception):
        log.exception("unhandled error")
        err = APIError("The server had an internal error. It was logged; please retry.")
        return _json(err.body(), 500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state, name) for name in sorted(state.model_names)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in state.model_names:
            return _json(error_body(f"The model '{model_id}' does not exist", "invalid_request_error", "model", "model_not_found"), 404)
        return _model_card(state, model_id)

    @app.get("/stats")
    async def stats():
        return _json(stats_body(state))

    @app.get("/metrics")
    async def metrics():
        state.stats.queue_depth.set(state.lane.queue_depth)
        body = state.stats.prometheus_text(state.prompt_cache.stats())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/admin/cache/clear")
    async def cache_clear():
        return {"cleared_entries": state.prompt_cache.clear()}

    return app


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "context_length": state.loaded.context_length}


def stats_body(state: ServerState) -> dict:
    lane = state.stats.lane_block()
    lane.update({"queue_depth": state.lane.queue_depth, "active_request": state.lane.active_job_id})
    return {
        "model": state.loaded.model_id,
        "fingerprint": state.loaded.fingerprint,
        "device": state.device,
        "dtype": state.loaded.dtype,
        "blas": state.blas,
        "lane": lane,
        "prompt_cache": state.prompt_cache.stats(),
    }
