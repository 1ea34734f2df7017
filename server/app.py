"""The FastAPI application: state, auth and size limits, error mapping, small endpoints.

(About 400 lines, one job: building the app. Routes live in their own modules (server/routes.py, api_*.py);
what stays here is the state, the guard, error mapping, /health /stats /metrics bodies and their collectors. The
next split, when it grows: the /metrics collectors into server/metrics.py.)

``create_app(state)`` wires a ready ``ServerState`` (model loaded, lane started by the
lifespan) to the routes. Every error leaves as OpenAI's error body; nothing internal
(stack traces, file paths) is ever put in a response.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import importlib.metadata
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.error_shapes import shaped_body, shaped_error_body
from server.errors import APIError, AuthenticationError, Forbidden, PayloadTooLarge, error_body
from server.lane import Lane
from server.http_util import validation_message
from server.adapters import AdapterRegistry
from server.response_store import ResponseStore
from server.routes import router
from server.stats import ServingStats
from server.web_guard import WebPolicy, check_request, cors_headers, is_preflight, preflight_headers

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
    model_aliases: tuple = ()  # --model-alias glob patterns answered by the served model (server/model_names.py)
    ssd: Optional[object] = None  # cache.tiered.TieredCache (the same object as prompt_cache) or None
    shutdown_timeout_s: float = 30.0
    distributed: Optional[dict] = None  # server.distributed.Group.describe() when sharded over processes
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses previous_response_id
    adapters: AdapterRegistry = field(default_factory=AdapterRegistry)  # LoRA adapters, selected by `model`
    adapter_dir: Optional[str] = None  # --adapter-dir: what /admin/adapters may load without --api-key
    embedder: Optional[object] = None  # models.embedding.EmbeddingModel behind /v1/embeddings, or None
    web: WebPolicy = field(default_factory=WebPolicy)  # Host / Origin allow-lists (server/web_guard.py)
    dashboard: bool = True  # GET / and /dashboard (server/dashboard.py); --no-dashboard turns it off

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
    app.include_router(router)
    from server.api_messages import router as messages_router  # noqa: E402 (after the core routes)
    from server.api_responses import router as responses_router

    from server.api_adapters import router as adapters_router
    from server.api_embeddings import router as embeddings_router

    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(adapters_router)
    app.include_router(embeddings_router)
    if state.dashboard:
        from server.dashboard import mount_dashboard

        mount_dashboard(app)

    def _error(request: Request, err: APIError, headers: Optional[dict] = None) -> Response:
        """``err`` in the error shape of the API the request went to (OpenAI's, or Anthropic's)."""
        return _json(shaped_error_body(request.url.path, err), err.status_code, {**err.headers(), **(headers or {})})

    def refuse(request: Request) -> Optional[Response]:
        """The answer for a request that may not reach a route, or None. Browser checks first (a refused Host or
        Origin learns nothing, not even whether a key is needed), then CORS preflights, the API key, the body
        size."""
        path, headers = request.url.path, request.headers
        refusal = check_request(state.web, request.method, path, headers)
        if refusal is not None:
            return _error(request, Forbidden(refusal.message, code=refusal.code))
        if is_preflight(request.method, headers):
            allow = preflight_headers(state.web, headers, path)
            if allow is not None:
                return Response(status_code=204, headers=allow)
        if state.api_key and not _open_path(state, path):
            if not hmac.compare_digest(_given_key(request).encode(), state.api_key.encode()):
                err = AuthenticationError("Incorrect or missing API key. Send 'Authorization: Bearer <key>' "
                                          "(or 'x-api-key: <key>').")
                return _error(request, err, {"WWW-Authenticate": "Bearer", **cors_headers(state.web, headers)})
        length = request.headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > state.max_body_bytes
            except ValueError:
                too_big = True
            if too_big:
                return _error(request, PayloadTooLarge(f"The request body is larger than {state.max_body_bytes} bytes."))
        return None

    def on_response(request: Request, status: int, headers, refused: bool) -> None:
        state.stats.on_http_status(status)
        if not refused:
            headers.update(cors_headers(state.web, request.headers))

    app.add_middleware(RequestGuard, refuse=refuse, on_response=on_response)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return _json(shaped_body(request.url.path, 400, message, "invalid_request_error", param, None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        body = shaped_body(request.url.path, exc.status_code, str(exc.detail), "invalid_request_error", None, kind)
        return _json(body, exc.status_code)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(request, APIError("The server had an internal error. It was logged; please retry."))

    @app.get("/health")
    async def health():
        # the port opens only after the lane's warm-up (server.serve waits for lane.ready): "ok" means warm
        return {"status": "ok", "warm": state.lane.ready.is_set(), "lane": state.lane.state.value,
                "api_key_required": bool(state.api_key)}  # the dashboard asks for the key before it polls

    @app.get("/v1/models")
    async def models():
        cards = [_model_card(state, name) for name in sorted(state.model_names)]
        cards += [_adapter_card(state, a) for a in state.adapters.all()]
        if state.embedder is not None:
            cards.append(_embedding_card(state))
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        adapter = state.adapters.get(model_id)
        if adapter is not None:
            return _adapter_card(state, adapter)
        if state.embedder is not None and model_id == state.embedder.model_id:
            return _embedding_card(state)
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
        body += generate_latest(_AdapterCollector(state.adapters.stats_block()))
        if state.ssd is not None:
            body += generate_latest(_SSDCollector(state.ssd.ssd_stats()))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/admin/cache/clear")
    async def cache_clear():
        return {"cleared_entries": state.prompt_cache.clear(), "tier": "ram",
                "note": "RAM tier only; the SSD tier keeps its files (delete the --ssd-cache dir to drop them)"}

    @app.post("/admin/cache/flush")
    async def cache_flush(timeout: float = 10.0):
        if state.ssd is None:
            return _json(error_body("The SSD cache is off (--no-ssd-cache): there is nothing to flush.",
                                    "invalid_request_error", None, "ssd_cache_disabled"), 409)
        timeout = min(max(timeout, 0.0), 600.0)
        if await asyncio.to_thread(state.ssd.flush, timeout):
            return {"durable": True}
        pending = state.ssd.pending()
        body = error_body(f"{len(pending)} cache entries are not durable yet (written within {timeout:g}s: "
                          "no); retry, or see /stats ssd_cache.failed", "server_error", None, "not_durable")
        body["pending"] = pending
        return _json(body, 503)

    return app


class RequestGuard:
    """Pure ASGI middleware: ``refuse(request)`` sees the headers and may answer instead of the app;
    ``on_response(request, status, headers, refused)`` sees (and may add to) every response's start.

    Not Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``): that one re-streams every response chunk
    through a memory stream and an extra task, a cost paid per token per stream (profiled: the biggest item of the
    event loop's time under 16 concurrent streams)."""

    def __init__(self, app, refuse, on_response):
        self.app = app
        self.refuse = refuse
        self.on_response = on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self.refuse(request)

        async def send_seen(message) -> None:
            if message["type"] == "http.response.start":
                self.on_response(request, message["status"], MutableHeaders(scope=message), refusal is not None)
            await send(message)

        if refusal is not None:
            await refusal(scope, receive, send_seen)
        else:
            await self.app(scope, receive, send_seen)


def _open_path(state: ServerState, path: str) -> bool:
    """Paths that never need the API key: /health, and the dashboard's static page (it holds no data: it asks for
    the key, then reads /stats with it)."""
    if path == "/health":
        return True
    return state.dashboard and (path in ("/", "/dashboard") or path.startswith("/dashboard/assets/"))


def _given_key(request: Request) -> str:
    """The API key a client sent: OpenAI clients send ``Authorization: Bearer KEY``, Anthropic's send
    ``x-api-key: KEY`` (Claude Code sends either, depending on how it was configured)."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:]
    return request.headers.get("x-api-key", "")


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "context_length": state.loaded.context_length}


def _adapter_card(state: ServerState, adapter) -> dict:
    return {"id": adapter.name, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "context_length": state.loaded.context_length, "parent": state.loaded.model_id,
            "adapter": {"identity": adapter.identity[:16], "rank": adapter.rank, "num_layers": adapter.num_layers,
                        "fine_tune_type": adapter.fine_tune_type}}


def _embedding_card(state: ServerState) -> dict:
    e = state.embedder
    return {"id": e.model_id, "object": "model", "created": state.created, "owned_by": "mlx-lane",
            "type": "embedding", "dimensions": e.dims, "max_input_tokens": e.max_tokens}


def stats_body(state: ServerState) -> dict:
    lane = state.stats.lane_block()
    lane.update(state.stats.batch_block())
    lane.update({"queue_depth": state.lane.queue_depth, "active_request": state.lane.active_job_id,
                 "running_requests": list(state.lane.running_ids), "max_batch": state.lane.scheduler.limits.max_batch,
                 "prefill_batch": state.lane.scheduler.limits.prefill_batch,
                 "state": state.lane.state.value})
    return {
        "version": server_version(),
        "model": state.loaded.model_id,
        "fingerprint": state.loaded.fingerprint,
        "device": state.device,
        "dtype": state.loaded.dtype,
        "blas": state.blas,
        "lane": lane,
        "prompt_cache": state.prompt_cache.stats(),
        "kv_cache": state.lane.engine.kv_stats(),  # KV scheme + bytes per cached token (issue 8)
        # one model over several processes: the group, and cache hits dropped because a rank lacked its shard
        **({"distributed": {**state.distributed, **state.prompt_cache.shard_stats()}} if state.distributed else {}),
        "ssd_cache": state.ssd.ssd_stats() if state.ssd is not None else {"enabled": False},
        "speculative": state.stats.spec.as_dict() if state.stats.spec is not None else {"enabled": False},
        "adapters": state.adapters.stats_block(),
        "embeddings": state.stats.embeddings.as_dict(state.embedder),
        "http": state.stats.http_block(),
    }


class _AdapterCollector:
    """Per-adapter counters (read at scrape time), labelled by adapter name."""

    _COUNTERS = [
        ("requests", "adapter_requests", "Finished requests served through a LoRA adapter"),
        ("cache_hits", "adapter_cache_hits", "Adapter requests whose prompt was partly served by the prefix cache"),
        ("cached_tokens", "adapter_cached_tokens", "Prompt tokens of adapter requests served by the prefix cache"),
        ("prompt_tokens", "adapter_prompt_tokens", "Prompt tokens of adapter requests"),
    ]

    def __init__(self, block: dict):
        self.block = block

    def collect(self):
        for key, name, doc in self._COUNTERS:
            m = CounterMetricFamily("mlx_lane:" + name, doc, labels=["adapter"])
            for adapter, row in self.block.items():
                m.add_metric([adapter], float(row.get(key) or 0))
            yield m


@functools.lru_cache(maxsize=1)
def server_version() -> str:
    """mlx-lane's installed version (the package metadata), or 'unknown' when run from a bare checkout."""
    try:
        return importlib.metadata.version("mlx-lane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _SSDCollector:
    """The SSD tier's counters (read at scrape time) as Prometheus series."""

    _COUNTERS = [
        ("restores", "ssd_cache_restores", "Prefix-cache entries restored from SSD"),
        ("writes", "ssd_cache_writes", "Prefix-cache entries written to SSD"),
        ("dropped", "ssd_cache_dropped", "Pending SSD writes dropped over the pending-bytes budget"),
        ("failed", "ssd_cache_failed", "SSD disk errors (the request was served anyway)"),
        ("writes_abandoned", "ssd_cache_writes_abandoned", "SSD writes given up after retries"),
        ("removed_at_scan", "ssd_cache_removed_at_scan", "Unusable files removed by the start-up scan"),
        ("evictions", "ssd_cache_evictions", "SSD files deleted by the byte cap"),
        ("demotions", "ssd_cache_demotions", "Idle RAM entries moved to SSD"),
        ("spills", "ssd_cache_spills", "RAM evictions handed to SSD"),
        ("prefetches", "ssd_cache_prefetches", "SSD reads started before the request reached the lane"),
        ("prefetch_coalesced", "ssd_cache_prefetch_coalesced", "Prefetches that joined a read in flight"),
        ("ssd_hits", "ssd_cache_hits", "Requests whose prefix came from SSD"),
        ("ssd_tokens_hit", "ssd_cache_tokens_hit", "Prompt tokens whose KV came from SSD"),
    ]
    _GAUGES = [
        ("entries", "ssd_cache_entries", "SSD cache files"),
        ("bytes", "ssd_cache_bytes", "SSD cache bytes on disk"),
        ("max_bytes", "ssd_cache_max_bytes", "SSD cache byte cap"),
        ("pending", "ssd_cache_pending", "Cache entries waiting to be written"),
        ("restore_ms_last", "ssd_cache_restore_ms_last", "Milliseconds of the last restore"),
        ("restore_mb_s", "ssd_cache_restore_mb_per_s", "Restore throughput, MB/s (moving average)"),
        ("write_ms_last", "ssd_cache_write_ms_last", "Milliseconds of the last write (serialize + fsync)"),
    ]

    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        s = self.stats
        for key, name, doc in self._COUNTERS:
            m = CounterMetricFamily("mlx_lane:" + name, doc)
            m.add_metric([], float(s.get(key) or 0))
            yield m
        for key, name, doc in self._GAUGES:
            m = GaugeMetricFamily("mlx_lane:" + name, doc)
            m.add_metric([], float(s.get(key) or 0))
            yield m
        cost = s.get("cost_model", {})
        for key, name, doc in [("prefill_tok_s", "cost_model_prefill_tokens_per_s", "Measured prefill rate"),
                               ("read_mb_s", "cost_model_read_mb_per_s", "Measured SSD restore rate, MB/s")]:
            m = GaugeMetricFamily("mlx_lane:" + name, doc)
            m.add_metric([], float(cost.get(key) or 0))
            yield m
        m = CounterMetricFamily("mlx_lane:cost_model_decisions", "Restore-or-recompute decisions",
                                labels=["decision"])
        m.add_metric(["restore"], float(cost.get("decisions_restore") or 0))
        m.add_metric(["recompute"], float(cost.get("decisions_recompute") or 0))
        yield m
