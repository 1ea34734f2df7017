"""``POST /v1/embeddings`` (OpenAI's shape) over the embedding model (models.embedding).

Request: ``input`` = a string, a list of strings, a list of token ids, or a list of lists of token ids (ids of the
embedding model's own vocabulary, the text's tokens without [CLS]/[SEP], which are added as for text);
``encoding_format`` "float" (default) or "base64" (little-endian float32, as OpenAI sends); ``dimensions`` only as
the model's own size (all-MiniLM-L6-v2 is not trained for shortened vectors, so cutting them would be a silent
loss); ``model`` the embedding model's id (see /v1/models), "default", or a --model-alias pattern. Response:
``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}``.

Limits, each a 400 naming the input: at most ``MAX_INPUTS`` inputs, no empty input, no input longer than the
model's limit (``--embedding-max-tokens``, capped by the model: never a silent truncation), ids inside the
vocabulary.

The lane's rule: the embedding model runs on the lane thread (``Lane.call``), in tasks of at most
``TASK_TOKENS`` padded tokens, one task per tick between two decode steps, so a large embeddings request delays
running generations by one task's time per step, never by the whole request. Tokenizing is done off the lane.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from server.catalog import is_served
from server.errors import InvalidRequest, ModelNotFound, NotFound
from server.http.wire import json_response, parse_body

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's own limit per request
TASK_TOKENS = 2048  # padded tokens per lane task (all-MiniLM-L6-v2: ~0.1 s on this 2-core CPU)

Input = Union[str, list[str], list[int], list[list[int]]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients add fields of their own (e.g. "user"); ignored

    input: Input
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None


def _inputs(req_input) -> list:
    """Normalize ``input`` to a list whose items are str or list[int]."""
    if isinstance(req_input, str):
        return [req_input]
    if not req_input:
        raise InvalidRequest("'input' is empty: send a string, a list of strings or token ids", param="input")
    if all(isinstance(x, int) for x in req_input):
        return [list(req_input)]
    return list(req_input)


def tokenize_inputs(embedder, items: list) -> list[list[int]]:
    """Token ids (special tokens included) of each input; InvalidRequest for an empty, too long or out-of-vocabulary
    one (``param`` names it: ``input[i]``)."""
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"'input' has {len(items)} items; at most {MAX_INPUTS} per request", param="input")
    texts = [(i, x) for i, x in enumerate(items) if isinstance(x, str)]
    for i, text in texts:
        if not text:
            raise InvalidRequest(f"input[{i}] is an empty string; every input needs some text", param=f"input[{i}]")
    encoded = dict(zip([i for i, _ in texts], embedder.tokenize([t for _, t in texts]))) if texts else {}
    out = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            ids = encoded[i]
        else:
            if not x:
                raise InvalidRequest(f"input[{i}] is an empty list of token ids", param=f"input[{i}]")
            bad = next((t for t in x if not 0 <= t < embedder.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"input[{i}] has token id {bad}, outside the embedding model's vocabulary "
                                     f"(0..{embedder.vocab_size - 1})", param=f"input[{i}]")
            ids = embedder.wrap_ids(x)
        if len(ids) > embedder.max_tokens:
            raise InvalidRequest(
                f"input[{i}] is {len(ids)} tokens; the embedding model {embedder.model_id} takes at most "
                f"{embedder.max_tokens} (special tokens included). Split the text into smaller pieces.",
                param=f"input[{i}]", code="context_length_exceeded")
        out.append(ids)
    return out


def plan_tasks(lengths: list[int], budget: int = TASK_TOKENS) -> list[list[int]]:
    """Input indices grouped into lane tasks: sorted by length (little padding), each task at most ``budget``
    padded tokens (a single input longer than the budget is a task of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    tasks, current = [], []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > budget:  # sorted: lengths[i] is the padded width
            tasks.append(current)
            current = []
        current.append(i)
    if current:
        tasks.append(current)
    return tasks


def _check_model(state, requested: Optional[str]) -> None:
    e = state.embedder
    if not requested or requested in (e.model_id, "default", f"sentence-transformers/{e.model_id}"):
        return
    if is_served(set(), state.model_aliases, requested):
        return
    raise ModelNotFound(f"The embedding model '{requested}' does not exist on this server. Served: {e.model_id} "
                        "(or start the server with --model-alias PATTERN)", param="model")


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    state = request.app.state.lane_state
    if state.embedder is None:
        raise NotFound("Embeddings are off on this server: start it with --embedding-model default (or a "
                       "sentence-transformers directory)", param="model", code="embeddings_disabled")
    req = await parse_body(request, EmbeddingRequest, state.max_body_bytes)
    embedder = state.embedder
    _check_model(state, req.model)
    if req.dimensions is not None and req.dimensions != embedder.dims:
        raise InvalidRequest(f"'dimensions' must be {embedder.dims} for {embedder.model_id} (it is not trained "
                             "for shortened vectors); leave it out", param="dimensions")
    items = _inputs(req.input)
    batch = await run_in_threadpool(tokenize_inputs, embedder, items)
    vectors = [None] * len(batch)
    for task in plan_tasks([len(ids) for ids in batch]):
        rows = [batch[i] for i in task]
        out = await asyncio.wrap_future(state.lane.call(lambda rows=rows: embedder.embed(rows)))
        for i, v in zip(task, out):
            vectors[i] = v
    tokens = sum(len(ids) for ids in batch)
    state.stats.embeddings.add(inputs=len(batch), tokens=tokens)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": embedder.model_id,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encode(vector, fmt: str):
    import numpy as np

    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]
