"""The FastAPI application: the server's state, its routes, the guard in front of them, and error mapping.

``create_app(state)`` wires a ready ``ServerState`` (model loaded, lane started) to the routes of every room of
server.http: the doors (chat, completions, responses, messages: server.http.pipeline runs them), embeddings,
/tokenize and /detokenize (server.http.tokenize), the read-only endpoints (server.http.info), /admin
(server.http.admin) and the dashboard. Every error leaves as its API's error body (server.http.error_shapes);
nothing internal (stack traces, file paths) is ever put in a response.
The lifespan stops the lane and flushes the SSD tier on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cache.protocol import PrefixCache
from cache.tiered import TieredCache
from models import LoadedModel
from models.embedding import EmbeddingModel
from server.catalog import AdapterRegistry
from server.core.context import CoreContext
from server.engine.engine import Engine
from server.errors import APIError
from server.http.error_shapes import shaped_body
from server.http.guard import RequestGuard, WebPolicy, cors_headers, error_response, refusal
from server.http.responses.store import ResponseStore
from server.http.wire import json_response, validation_message
from server.lane.lane import Lane
from server.pool.pool import ModelPool
from server.stats import ServingStats

__all__ = ["ServerState", "create_app"]

log = logging.getLogger("mlx_lane.app")


@dataclass
class ServerState:
    """Everything the routes read: the base model's facts, the engine and lane, the caches, the settings. The
    generation core sees only ``core`` (server.core.context.CoreContext)."""

    loaded: LoadedModel  # the base model's load facts (id, fingerprint, dtype, context length)
    engine: Engine
    lane: Lane
    core: CoreContext
    stats: ServingStats
    prompt_cache: PrefixCache  # RAM (+ SSD) tiers; on a sharded model, the wrapper that agrees hits over ranks
    device: str
    blas: str
    api_key: Optional[str] = None
    keepalive_s: float = 10.0
    default_max_tokens: int = 2048  # when a chat / completions / Messages request gives no max_tokens
    max_tokens_cap: Optional[int] = None  # --default-max-tokens when given: also caps Responses' default (the room)
    max_body_bytes: int = 8 * 1024 * 1024
    model_names: set = field(default_factory=set)
    model_aliases: tuple = ()  # --model-alias glob patterns answered by the served model (server/catalog.py)
    alias_rules: tuple = ()  # every --model-alias in order: (pattern, on-demand model name or None for the base)
    ssd: Optional[TieredCache] = None  # the SSD-backed tier behind prompt_cache (flush, close, its stats), or None
    shutdown_timeout_s: float = 30.0
    distributed: Optional[dict] = None  # server.engine.distributed.Group.describe() when sharded over processes
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses previous_response_id
    adapters: AdapterRegistry = field(default_factory=AdapterRegistry)  # LoRA adapters, selected by `model`
    adapter_dir: Optional[str] = None  # --adapter-dir: what /admin/adapters may load without --api-key
    models: Optional[ModelPool] = None  # the on-demand models (None: only the base model)
    embedder: Optional[EmbeddingModel] = None  # behind /v1/embeddings, or None
    web: WebPolicy = field(default_factory=WebPolicy)  # Host / Origin allow-lists (server/http/guard.py)
    keep_billing_header: bool = False  # --keep-billing-header: Claude Code's per-prompt system block stays
    dashboard: bool = True  # GET / and /dashboard (server/http/dashboard.py); --no-dashboard turns it off

    def __post_init__(self):
        self.model_names = {self.loaded.model_id} | set(self.model_names)
        self.system_fingerprint = "fp_" + self.loaded.fingerprint[:12]


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from server.startup import TIMELINE

        log.info("%s", TIMELINE.ready())  # the lane serves and the app starts: /health answers ready from here
        yield
        if state.models is not None:
            state.models.stop()
        state.lane.stop()
        if state.ssd is not None:  # after the lane: its last put is scheduled before the flush starts
            durable = await asyncio.to_thread(state.ssd.close, state.shutdown_timeout_s)
            left = state.ssd.pending()  # also RAM entries no file covers: a write given up, a file evicted
            if durable and not left:
                log.info("ssd cache flushed: every cache entry is durable")
            elif durable:
                log.warning("ssd cache flushed; %d RAM entries have no file (a write that failed for good, or a "
                            "file evicted by --ssd-cache-bytes): see /stats ssd_cache", len(left))
            else:
                log.warning("ssd cache: %d entries not written within %.0fs (--shutdown-timeout)", len(left),
                            state.shutdown_timeout_s)

    app = FastAPI(title="mlx-lane", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.lane_state = state
    from server.http import admin, embeddings, info, tokenize
    from server.http.chat import door as chat
    from server.http.messages import door as messages
    from server.http.responses import compact, socket
    from server.http.responses import door as responses

    for room in (chat, responses, compact, socket, messages, embeddings, tokenize, info, admin):
        app.include_router(room.router)
    if state.dashboard:
        from server.http.dashboard import mount_dashboard

        mount_dashboard(app)

    def on_response(request: Request, status: int, headers, refused: bool) -> None:
        state.stats.on_http_status(status)
        if not refused:
            headers.update(cors_headers(state.web, request.headers))

    app.add_middleware(RequestGuard, refuse=lambda request: refusal(state, request), on_response=on_response)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return json_response(shaped_body(request.url.path, 400, message, "invalid_request_error", param, None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        body = shaped_body(request.url.path, exc.status_code, str(exc.detail), "invalid_request_error", None, kind)
        return json_response(body, exc.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(request, APIError("The server had an internal error. It was logged; please retry."))

    return app
