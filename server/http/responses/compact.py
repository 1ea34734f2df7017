"""``POST /v1/responses/compact``: a long conversation replaced by a compacted one (OpenAI's ``responses.compact``,
what Codex CLI calls when its context fills up; mlx-vlm 0.7.10 serves the same endpoint).

The body is a Responses create body (``model``, ``input``, ``instructions``, ``previous_response_id``, ``tools``
...; nothing is streamed). The model summarizes the conversation: the conversation as ``/v1/responses`` renders it
(its instructions and tools too, so the prefix cache serves all of it), then ``SUMMARY_REQUEST`` as the user's last
message, greedy, thinking off, at most ``max_output_tokens`` tokens (default ``SUMMARY_TOKENS``). The answer is OpenAI's compacted response::

    {"id": "resp_...", "object": "response.compaction", "created_at": ..., "usage": {...},
     "output": [the system / developer messages, the latest user messages (at most KEEP_USER_TOKENS of them),
                {"id": "cmp_...", "type": "compaction", "encrypted_content": "mlx-lane.compaction.v1...."}]}

The client continues with that output as its conversation; the compaction item expands into the summary
(server.http.responses.capsule). The compacted response is stored like any response (``previous_response_id`` may
name it: the stored conversation is the compacted one), and the opening every next turn shares (instructions, tools,
the compacted conversation) is computed into the prefix cache at once (server.core.next_turn), so the first turn after
compaction does not prefill it. Errors are OpenAI's: an unknown ``previous_response_id`` is a 404 with
``code: previous_response_not_found``; an empty conversation a 400; a model that writes no summary a 500 with
``code: compaction_failed`` (the client keeps its conversation).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from server.core.generation import open_generation
from server.core.request import MaxTokens
from server.errors import APIError, InvalidRequest
from server.http.responses.capsule import seal
from server.http.responses.door import history_of
from server.http.responses.format import response_usage
from server.http.responses.schemas import InputTokensRequest, MessageItem
from server.http.responses.store import StoredResponse
from server.http.responses.translate import input_items, items_for_history, responses_request
from server.http.target import resolve_target
from server.http.wire import json_response, parse_body, request_id, session_of

__all__ = ["router", "SUMMARY_REQUEST", "SUMMARY_TOKENS", "KEEP_USER_TOKENS", "kept_messages"]

router = APIRouter()

SUMMARY_REQUEST = (
    "Stop here and write a summary of this whole conversation for whoever continues the work without seeing it. "
    "Give the goal and the user's requirements, what was decided, what was done (files, commands, results), what "
    "is left to do next, and every exact name, path, value and error message that will be needed. Do not call any "
    "tool and do not continue the task: answer with the summary only.")
SUMMARY_TOKENS = 1024  # the summary's length at most (lowered to the room the conversation leaves)
KEEP_USER_TOKENS = 20_000  # the latest user messages kept beside the summary, at most (a quarter of the context)


def kept_messages(items, count, budget: int) -> list[dict]:
    """The messages a compacted conversation keeps, in their order, as output items: every system / developer
    message (the instructions agents send as messages) and the latest user messages whose text fits ``budget``
    tokens (``count(text) -> int``)."""
    keep: set[int] = set()
    left = budget
    for i in range(len(items) - 1, -1, -1):
        item = items[i]
        if not isinstance(item, MessageItem):
            continue
        if item.role in ("system", "developer"):
            keep.add(i)
        elif item.role == "user" and left > 0:
            cost = count(item.text())
            if cost <= left:
                keep.add(i)
                left -= cost
            else:
                left = 0  # older ones would leave a gap: the latest that fit, and no others
    return [_message_output(items[i]) for i in sorted(keep)]


def _message_output(item: MessageItem) -> dict:
    parts = ([{"type": "input_text", "text": item.content}] if isinstance(item.content, str)
             else [p.model_dump(exclude_none=True) for p in item.content])
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": item.role, "status": "completed",
            "content": parts}


@router.post("/v1/responses/compact")
async def compact(request: Request):
    state = request.app.state.lane_state
    body = await parse_body(request, InputTokensRequest, state.max_body_bytes)
    items = [*history_of(state, body), *input_items(body)]  # an unknown previous_response_id: a 404 here
    if not items:
        raise InvalidRequest("Invalid value for 'input': there is no conversation to compact", param="input")
    session = session_of(request.headers, body.prompt_cache_key, body.user)
    ask = body.model_copy(update={"input": [*items, MessageItem(role="user", content=SUMMARY_REQUEST)],
                                  "previous_response_id": None, "text": None, "temperature": 0.0, "top_p": None})
    size = body.max_output_tokens or SUMMARY_TOKENS
    req = dataclasses.replace(responses_request(ask, session=session), max_tokens=size,
                              max_tokens_over_room=MaxTokens.FIT, enable_thinking=False, reasoning_effort=None,
                              answer_schema=None)
    target = await resolve_target(state, body.model)
    try:
        gen = await open_generation(state.core, request, dataclasses.replace(req, target=target),
                                    request_id(request, "resp_"), next_turn=False)  # the summary's chat ends here
        async with gen:
            result = await gen.collect()
        summary = result.text.strip()
        if not summary:
            raise APIError("The model wrote no summary of the conversation; keep the conversation as it is, or "
                           "retry.", code="compaction_failed")
        budget = min(KEEP_USER_TOKENS, target.slot.context_length // 4)
        kept = await run_in_threadpool(kept_messages, items, lambda t: len(target.tokenizer.encode(t)), budget)
        output = [*kept, seal(summary)]
        obj = {"id": "resp_" + uuid.uuid4().hex, "object": "response.compaction", "created_at": int(time.time()),
               "output": output, "usage": response_usage(result.finished)}
        compacted = tuple(items_for_history(output))
        state.responses.put(obj["id"], StoredResponse(response=obj, history=compacted))
        if state.core.next_turns is not None and target.lease is None:  # the next turn's opening, cached now
            after = body.model_copy(update={"input": list(compacted), "previous_response_id": None})
            state.core.next_turns.prefill(state.core, gen, responses_request(after, session=session))
    finally:
        target.release()
    return json_response(obj, headers={"X-Request-Id": gen.id})
