"""The /admin endpoints: the prefix cache (``POST /admin/cache/clear``, ``/admin/cache/flush``) and LoRA adapters
(``POST /admin/adapters``). The guard (server.http.guard) keeps every browser page away from them.

``/admin/cache/clear`` drops the RAM tier (the SSD tier keeps its files). ``/admin/cache/flush?timeout=S`` writes
every pending SSD entry now: 200 ``{"durable": true}`` once every cache entry is on disk, 503 with what is pending
otherwise, 409 when the SSD tier is off.

``/admin/models/load`` and ``/admin/models/unload`` (body ``{"model": NAME}``) load an on-demand model now (as its
first request would) or unload one (409 while requests hold it). Only models the server was started with
(``--model NAME=PATH``, ``--models-dir``) can be named: no path is read from the request.

``/admin/profile?seconds=S&interval_ms=I&threads=NAMES`` samples where the server's threads spend their time for S
seconds (server.stack_sampler; default 10 s every 5 ms, the lane thread ``mlx-lane``, the event loop ``MainThread``
and the SSD writer ``mlx-lane-durability``) and answers each thread's hottest lines, hottest functions and folded
stacks (for flamegraph.pl or speedscope). One profile at a time (409 while one runs); requests go on meanwhile.

``/admin/adapters`` loads or unloads a LoRA adapter while the server runs. Body: ``{"action": "load", "name": NAME, "path": DIR}`` (``path`` may be left out with ``--adapter-dir``: then
``DIR/NAME``) or ``{"action": "unload", "name": NAME}``. Who may load what is ``server.catalog.load_refusal``
(a path from an unauthenticated client is never read). Loading runs on the lane thread (``Lane.call``: it owns
the model and its MLX stream) between two decode steps; requests running under an unloaded adapter finish with it.
"""

from __future__ import annotations

import asyncio
import re
from typing import Literal, Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from server.catalog import adapter_path_for, load_refusal
from server.errors import Conflict, InvalidRequest, NotFound, PermissionDenied, error_body
from server.http.wire import json_response, parse_body

router = APIRouter()

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class AdapterAction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Literal["load", "unload"]
    name: str
    path: Optional[str] = None


@router.post("/admin/adapters")
async def admin_adapters(request: Request):
    from models import ModelLoadError
    from models.loading.adapters import load_adapter

    state = request.app.state.lane_state
    req = await parse_body(request, AdapterAction, state.max_body_bytes)
    if not _NAME.match(req.name) or "/" in req.name:
        raise InvalidRequest("an adapter name is 1-128 letters, digits and _ . : - (no '/')", param="name")
    if req.action == "unload":
        adapter = state.adapters.remove(req.name)
        if adapter is None:
            raise NotFound(f"no adapter named '{req.name}' is loaded", param="name", code="adapter_not_found")
        return {"object": "adapter", "name": req.name, "status": "unloaded"}
    if state.distributed is not None:  # only rank 0 would load it: the ranks' forwards would no longer match
        raise InvalidRequest("LoRA adapters are not supported while the model is sharded over processes "
                             "(mlx.launch); serve adapters from a single-process server", param="action",
                             code="unsupported_when_sharded")
    if req.name in state.model_names or state.adapters.get(req.name) is not None:
        raise InvalidRequest(f"the name '{req.name}' is taken (the base model or a loaded adapter); unload it first "
                             "or pick another", param="name", code="adapter_exists")
    try:
        path = adapter_path_for(req.name, req.path, state.adapter_dir)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="path") from None
    why = load_refusal(path, authenticated=bool(state.api_key), adapter_dir=state.adapter_dir)
    if why:
        raise PermissionDenied(why, param="path")
    future = state.lane.call(lambda: load_adapter(state.loaded, req.name, path))
    try:
        adapter = await asyncio.wrap_future(future)
    except ModelLoadError as exc:
        raise InvalidRequest(str(exc), param="path", code="adapter_invalid") from None
    state.adapters.add(adapter)
    return {"object": "adapter", "name": adapter.name, "status": "loaded", "identity": adapter.identity[:16],
            "rank": adapter.rank, "num_layers": adapter.num_layers}


class ModelAction(BaseModel):
    """``{"model": NAME}`` (``"name"`` or ``"id"`` are taken too: what other servers' admin APIs call it)."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    name: Optional[str] = None
    id: Optional[str] = None

    def target(self) -> str:
        given = [v for v in (self.model, self.name, self.id) if v]
        if len(given) != 1:
            raise InvalidRequest('name one model: {"model": NAME}', param="model")
        return given[0]


def _on_demand_entry(state, name: str):
    if name in state.model_names:
        raise InvalidRequest(f"'{name}' is the base model: it is always loaded and cannot be unloaded", param="model",
                             code="base_model")
    if state.models is None or not state.models.knows(name):
        served = (", ".join(state.models.names()) or "none") if state.models is not None else \
            "none (start the server with --model NAME=PATH or --models-dir DIR)"
        raise NotFound(f"no on-demand model named '{name}'; on-demand models: {served}", param="model",
                       code="model_not_found")
    return state.models.entry(name)


@router.post("/admin/models/load")
async def admin_model_load(request: Request):
    from server.http.target import Resolution, acquire

    state = request.app.state.lane_state
    name = (await parse_body(request, ModelAction, state.max_body_bytes)).target()
    entry = _on_demand_entry(state, name)
    was = entry.state
    (await acquire(state, Resolution(on_demand=name))).release()
    return {"object": "model", "id": entry.name, "state": entry.state, "was": was, "size_bytes": entry.nbytes,
            "load_s": round(entry.load_s, 3)}


@router.post("/admin/models/unload")
async def admin_model_unload(request: Request):
    from server.pool.pool import ModelInUse

    state = request.app.state.lane_state
    entry = _on_demand_entry(state, (await parse_body(request, ModelAction, state.max_body_bytes)).target())
    try:
        unloaded = await asyncio.to_thread(state.models.unload, entry.name)
    except ModelInUse as exc:
        raise Conflict(str(exc), code="model_in_use") from None
    return {"object": "model", "id": entry.name, "state": entry.state, "was": "loaded" if unloaded else "not_loaded"}


_DEFAULT_PROFILED = "mlx-lane,MainThread,mlx-lane-durability"
_profiling = asyncio.Lock()


@router.get("/admin/profile")
async def admin_profile(request: Request, seconds: float = 10.0, interval_ms: float = 5.0,
                        threads: str = _DEFAULT_PROFILED, top: int = 25):
    from server.stack_sampler import MAX_SECONDS, sample

    if not 0 < seconds <= MAX_SECONDS:
        raise InvalidRequest(f"seconds must be in (0, {MAX_SECONDS:g}]", param="seconds")
    if not 0.5 <= interval_ms <= 1000:
        raise InvalidRequest("interval_ms must be in [0.5, 1000]", param="interval_ms")
    names = [n.strip() for n in threads.split(",") if n.strip()]
    if not names:
        raise InvalidRequest("name at least one thread (e.g. threads=mlx-lane)", param="threads")
    if _profiling.locked():
        raise Conflict("a profile is being taken already; retry when it ends", code="profile_running")
    async with _profiling:
        profile = await asyncio.to_thread(sample, names, seconds, interval_ms / 1e3)
    return json_response({"object": "profile", **profile.as_dict(top=max(1, min(top, 500)))})


@router.post("/admin/cache/clear")
async def cache_clear(request: Request):
    state = request.app.state.lane_state
    if state.core.next_turns is not None:  # a next-turn job running now would put its entry after the clear
        await state.core.next_turns.settle()
    return {"cleared_entries": state.prompt_cache.clear(), "tier": "ram",
            "note": "RAM tier only; the SSD tier keeps its files (delete the --ssd-cache dir to drop them)"}


@router.post("/admin/cache/flush")
async def cache_flush(request: Request, timeout: float = 10.0):
    state = request.app.state.lane_state
    if state.ssd is None:
        raise Conflict("The SSD cache is off (--no-ssd-cache): there is nothing to flush.", code="ssd_cache_disabled")
    timeout = min(max(timeout, 0.0), 600.0)
    if await asyncio.to_thread(state.ssd.flush, timeout):
        return {"durable": True}
    pending = state.ssd.pending()
    body = error_body(f"{len(pending)} cache entries are not durable yet (written within {timeout:g}s: "
                      "no); retry, or see /stats ssd_cache.failed", "server_error", None, "not_durable")
    body["pending"] = pending
    return json_response(body, 503)
