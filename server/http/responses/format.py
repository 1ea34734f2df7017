"""Responses API output: the ``response`` object and its SSE event stream, as the OpenAI SDK parses them.

``response_object`` builds the object for both modes. ``ResponsesStream`` turns the generation core's
events into OpenAI's event sequence::

    response.created, response.in_progress,
    per output item: response.output_item.added,
        message:   response.content_part.added, response.output_text.delta*, response.output_text.done,
                   response.content_part.done
        reasoning: response.content_part.added, response.reasoning_text.delta*, response.reasoning_text.done,
                   response.content_part.done
        function_call: response.function_call_arguments.delta, response.function_call_arguments.done
        custom_tool_call: response.custom_tool_call_input.delta, response.custom_tool_call_input.done
        tool_search_call: (the item events only)
    response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens ran out; response.failed on an error)

Every event is ``event: <type>`` + ``data: {..., "type", "sequence_number"}`` (numbered from 0).
"""

from __future__ import annotations

import time
from typing import Optional

import orjson

from server.errors import APIError
from server.http.responses.schemas import ResponsesRequest
from server.http.responses.translate import ToolIndex, call_item, message_item, reasoning_item
from server.lane.events import Finished, SamplingParams

__all__ = ["response_base", "response_object", "response_usage", "tool_echo", "error_fields", "ResponsesStream"]


def response_base(req: ResponsesRequest, response_id: str, model: str,
                  params: Optional[SamplingParams] = None) -> dict:
    """Every field of the response object but status, output, usage, completed_at (the request's settings as this
    server used them: every field OpenAI's and the Open Responses schemas require, null where there is none).
    ``params``: the sampling the generation runs with (the model's defaults fill what the request left out);
    without them, the request's values or the API's defaults."""
    used = params or SamplingParams(max_tokens=0, temperature=1.0 if req.temperature is None else req.temperature,
                                    top_p=1.0 if req.top_p is None else req.top_p,
                                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)
    base = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "previous_response_id": req.previous_response_id,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "temperature": used.temperature,
        "top_p": used.top_p,
        "presence_penalty": used.presence_penalty or 0.0,
        "frequency_penalty": used.frequency_penalty or 0.0,
        "top_logprobs": 0,  # no logprobs are returned here (output_text.logprobs is always [])
        "tool_choice": _tool_choice_echo(req),
        "tools": [tool_echo(t) for t in req.tools or []],
        "text": text_echo(req),
        "reasoning": {"effort": None, "summary": None, **(req.reasoning or {})},
        "store": req.store,
        "background": False,  # background mode is refused (a 400)
        "service_tier": "default",  # one tier here
        "metadata": req.metadata or {},
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
        "truncation": "disabled",
        "error": None,
        "incomplete_details": None,
    }
    if req.user is not None:  # OpenAI's schema types it string (deprecated): absent rather than null
        base["user"] = req.user
    return base


def text_echo(req: ResponsesRequest) -> dict:
    """``text`` as sent, a json_schema format with the fields the schemas require (description "" when none was
    sent: Open Responses requires one, OpenAI's schema allows no null; strict true: the schema is always enforced
    here, by constrained decoding)."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    fmt = text.get("format") or {"type": "text"}
    if fmt["type"] == "json_schema":
        fmt = {"description": "", **fmt, "strict": True}
    return {**text, "format": fmt}


def tool_echo(tool) -> dict:
    """A tool of the request as the response echoes it: as sent, plus the fields the schemas require that the
    client left out (a function tool's description, parameters and strict: null; a namespace's description: "")."""
    out = tool.model_dump(exclude_none=True)
    if out["type"] == "function":
        out = {**out, **{k: getattr(tool, k) for k in ("description", "parameters", "strict")}}
    elif out["type"] == "namespace":
        out.setdefault("description", "")
    return out


def _tool_choice_echo(req: ResponsesRequest):
    if req.tool_choice is None:
        return "auto"
    return req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()


def response_usage(f: Finished, reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": f.prompt_tokens,
        # cache_write_tokens: prompt tokens this request newly put in the prefix cache
        "input_tokens_details": {"cached_tokens": f.cached_tokens, "cache_write_tokens": f.cache_write_tokens},
        "output_tokens": f.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, f.completion_tokens)},
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


def response_object(base: dict, output: list[dict], status: str, *, finished: Optional[Finished] = None,
                    reasoning_tokens: int = 0, error: Optional[APIError] = None) -> dict:
    """``status``: in_progress | completed | incomplete (max_output_tokens) | failed (``error`` set)."""
    obj = dict(base, status=status, completed_at=int(time.time()) if status == "completed" else None, output=output,
               usage=None)
    if finished is not None:
        obj["usage"] = response_usage(finished, reasoning_tokens)
    if status == "incomplete":
        obj["incomplete_details"] = {"reason": "max_output_tokens"}
    if error is not None:
        # the SDK knows a fixed set of codes: a full queue is rate_limit_exceeded, everything else server_error
        code = "rate_limit_exceeded" if error.status_code == 429 else "server_error"
        obj["error"] = {"code": code, "message": error.message}
    return obj


def error_fields(error: APIError) -> dict:
    """An error event's code, message and param (the code never null: Open Responses requires a string)."""
    return {"code": error.code or error.type, "message": error.message, "param": error.param}


def status_of(reason: str) -> str:
    return "incomplete" if reason == "length" else "completed"


class ResponsesStream:
    """Stateful formatter of one streamed response (see the module docstring). ``output`` holds the finished
    output items, for the final object and the response store."""

    def __init__(self, base: dict, tools=None):
        self.base = base
        # what the calls are (server.http.responses.translate.ToolIndex; a plain dict: function -> namespace group)
        self.tools = tools if isinstance(tools, ToolIndex) else ToolIndex(tools or {})
        self.output: list[dict] = []
        self._seq = 0
        self._open: Optional[dict] = None  # the item being streamed: {"kind", "item", "parts"}

    def _event(self, type_: str, **payload) -> bytes:
        obj = {"type": type_, **payload, "sequence_number": self._seq}
        self._seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    def start(self) -> list[bytes]:
        snapshot = response_object(self.base, [], "in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def text(self, delta: str) -> list[bytes]:
        return self._delta("message", delta)

    def reasoning(self, delta: str) -> list[bytes]:
        return self._delta("reasoning", delta)

    def _delta(self, kind: str, delta: str) -> list[bytes]:
        out = []
        if self._open is not None and self._open["kind"] != kind:
            out += self._close()
        if self._open is None:
            out += self._begin(kind)
        self._open["parts"].append(delta)
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(event, item_id=self._open["item"]["id"], output_index=len(self.output),
                               content_index=0, delta=delta, **extra))
        return out

    def _begin(self, kind: str) -> list[bytes]:
        if kind == "message":
            item = message_item("", status="in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item, part = reasoning_item("", status="in_progress"), {"type": "reasoning_text", "text": ""}
        added = dict(item, content=[])
        self._open = {"kind": kind, "item": item, "parts": []}
        idx = len(self.output)
        return [self._event("response.output_item.added", output_index=idx, item=added),
                self._event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                            part=part)]

    def _close(self, status: str = "completed") -> list[bytes]:
        if self._open is None:
            return []
        kind, item, text = self._open["kind"], self._open["item"], "".join(self._open["parts"])
        self._open = None
        idx = len(self.output)
        if kind == "message":
            done = message_item(text, item_id=item["id"], status=status)
            part = done["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=text, logprobs=[])]
        else:
            done = reasoning_item(text, item_id=item["id"])
            part = done["content"][0]
            events = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=text)]
        events.append(self._event("response.content_part.done", item_id=item["id"], output_index=idx,
                                  content_index=0, part=part))
        events.append(self._event("response.output_item.done", output_index=idx, item=done))
        self.output.append(done)
        return events

    def calls(self, calls) -> list[bytes]:
        out = self._close()
        for call in calls:
            done = call_item(call, self.tools)
            idx = len(self.output)
            if done["type"] == "custom_tool_call":
                out.append(self._event("response.output_item.added", output_index=idx,
                                       item=dict(done, input="", status="in_progress")))
                out.append(self._event("response.custom_tool_call_input.delta", item_id=done["id"], output_index=idx,
                                       delta=done["input"]))
                out.append(self._event("response.custom_tool_call_input.done", item_id=done["id"], output_index=idx,
                                       input=done["input"]))
            elif done["type"] == "tool_search_call":
                out.append(self._event("response.output_item.added", output_index=idx,
                                       item=dict(done, status="in_progress")))
            else:
                out.append(self._event("response.output_item.added", output_index=idx,
                                       item=dict(done, arguments="", status="in_progress")))
                out.append(self._event("response.function_call_arguments.delta", item_id=done["id"],
                                       output_index=idx, delta=done["arguments"]))
                out.append(self._event("response.function_call_arguments.done", item_id=done["id"],
                                       output_index=idx, name=done["name"], arguments=done["arguments"]))
            out.append(self._event("response.output_item.done", output_index=idx, item=done))
            self.output.append(done)
        return out

    def finish(self, finished: Finished, reason: str, reasoning_tokens: int = 0) -> tuple[list[bytes], dict]:
        """The closing events and the final response object."""
        status = status_of(reason)
        out = self._close(status)
        if not self.output:  # a response always has its message, even an empty one (OpenAI does the same)
            out += self._begin("message") + self._close(status)
        obj = response_object(self.base, self.output, status, finished=finished, reasoning_tokens=reasoning_tokens)
        out.append(self._event("response.completed" if status == "completed" else "response.incomplete",
                               response=obj))
        return out, obj

    @staticmethod
    def error_event(error: APIError) -> list[bytes]:
        """The Responses API's ``error`` event: a stream that failed before its first event (no response yet). The
        error's fields at the top (OpenAI's ResponseErrorEvent) and under ``error`` (Open Responses'
        ErrorStreamingEvent): both specs' readers find them."""
        fields = error_fields(error)
        obj = {"type": "error", **fields, "error": {"type": error.type, **fields}, "sequence_number": 0}
        return [b"event: error\ndata: " + orjson.dumps(obj) + b"\n\n"]

    def fail(self, error: APIError) -> list[bytes]:
        out = self._close()
        obj = response_object(self.base, self.output, "failed", error=error)
        out.append(self._event("response.failed", response=obj))
        return out
