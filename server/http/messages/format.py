"""Anthropic Messages API output: the ``message`` object and its SSE event stream, as Anthropic's SDK parses them.

Stream::

    message_start (usage: the prompt, split as if nothing were read from the cache), ping,
    per content block: content_block_start, content_block_delta* (thinking_delta | text_delta |
        input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, final usage), message_stop
    (event: error {"type": "error", "error": {...}} when the generation fails; nothing follows)

Usage as Anthropic counts it (``prompt_split``): the three numbers add up to the rendered prompt (what
/v1/messages/count_tokens answers). ``cache_read_input_tokens`` = prompt tokens served from the prefix cache (any
tier, breakpoints or not); ``cache_creation_input_tokens`` = the tokens up to the request's last ``cache_control``
breakpoint that were not read, as far as the request put them in the cache (none without a breakpoint, whatever
the server itself keeps: it caches every prompt; none when the cache is off); ``input_tokens`` = the rest,
everything after the last breakpoint included. In a stream the cache hit is known only once the lane admits the
request, after ``message_start`` is sent: ``message_start`` carries the split with nothing read (its sum is
already the prompt), ``message_delta`` the true split (cumulative, as Anthropic's: the SDK's final message takes
its numbers).
"""

from __future__ import annotations

import json
from typing import Optional

import orjson

from server.errors import APIError
from server.http.error_shapes import anthropic_error_body
from server.lane.events import Finished

__all__ = ["stop_reason_of", "prompt_split", "message_usage", "tool_use_block", "message_object", "MessagesStream",
           "PING"]

PING = b'event: ping\ndata: {"type": "ping"}\n\n'
DIRECT = {"type": "direct"}  # a tool_use block's caller: the model itself (no server-side code execution here)


def stop_reason_of(reason: str, stop_sequence: Optional[str]) -> str:
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def prompt_split(prompt_tokens: int, cached: int, last_breakpoint: int, written: Optional[int] = None) -> dict:
    """Anthropic's three prompt counts, adding up to ``prompt_tokens``: ``cached`` tokens read; created: the tokens
    before ``last_breakpoint`` (the last ``cache_control`` breakpoint's token position, 0 for none) not read, as far
    as the request did put them in the cache (``written``: prompt tokens it stored beyond those read; None: not
    known yet, taken as all of them; 0 when the cache is off); and the rest."""
    read = max(0, min(cached, prompt_tokens))
    created = max(0, min(last_breakpoint, prompt_tokens) - read)
    if written is not None:
        created = min(created, max(0, written))
    return {"input_tokens": prompt_tokens - read - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read}


def usage_object(split: dict, output_tokens: int, thinking_tokens: int = 0) -> dict:
    """Anthropic's whole ``usage`` of a ``prompt_split`` and the output: ``cache_creation`` by TTL (this cache has no
    TTL of its own: what a request writes counts as the default 5-minute kind), ``output_tokens_details`` (the
    thinking's tokens), and nulls for what never happens here (server tools, an inference region)."""
    return {
        **split,
        "cache_creation": {"ephemeral_5m_input_tokens": split["cache_creation_input_tokens"],
                           "ephemeral_1h_input_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"thinking_tokens": min(thinking_tokens, output_tokens)},
        "server_tool_use": None,
        "service_tier": "standard",
        "inference_geo": None,
    }


def message_usage(f: Finished, last_breakpoint: int = 0, thinking_tokens: int = 0) -> dict:
    """The ``usage`` of a finished message (``prompt_split`` of its prompt, plus its output tokens)."""
    split = prompt_split(f.prompt_tokens, f.cached_tokens, last_breakpoint, f.cache_write_tokens)
    return usage_object(split, f.completion_tokens, thinking_tokens)


def tool_use_block(call: dict) -> dict:
    """An OpenAI-shaped tool call as a ``tool_use`` block (``input`` must be an object: anything else the
    model wrote is wrapped, never dropped)."""
    args = call["function"]["arguments"]
    try:
        value = json.loads(args) if args else {}
    except json.JSONDecodeError:
        value = {"arguments": args}
    if not isinstance(value, dict):
        value = {"arguments": value}
    call_id = call["id"] if call["id"].startswith("toolu_") else "toolu_" + call["id"].removeprefix("call_")
    return {"type": "tool_use", "id": call_id, "name": call["function"]["name"], "input": value,
            "caller": DIRECT}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text, "citations": None}


def message_object(message_id: str, model: str, text: str, reasoning: str, calls, reason: str,
                   stop_sequence: Optional[str], f: Finished, last_breakpoint: int = 0,
                   thinking_tokens: int = 0) -> dict:
    content: list[dict] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        content.append(text_block(text))
    content.extend(tool_use_block(c) for c in calls)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason_of(reason, stop_sequence),
        "stop_sequence": stop_sequence,
        "stop_details": None,  # only a refusal has details
        "usage": message_usage(f, last_breakpoint, thinking_tokens),
        "container": None,  # no code execution container here
    }


def _event(type_: str, obj: dict) -> bytes:
    return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps({"type": type_, **obj}) + b"\n\n"


class MessagesStream:
    """Stateful formatter of one streamed message (see the module docstring)."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, last_breakpoint: int = 0):
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.last_breakpoint = last_breakpoint
        self._index = -1  # index of the last block opened
        self._open: Optional[str] = None  # "text" | "thinking"

    def start(self) -> list[bytes]:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "stop_details": None,
                   # the cache hit is not known yet: nothing read; message_delta carries the true split
                   "usage": usage_object(prompt_split(self.prompt_tokens, 0, self.last_breakpoint), 0),
                   "container": None}
        return [_event("message_start", {"message": message}), PING]

    def text(self, delta: str) -> list[bytes]:
        return self._delta("text", {"type": "text_delta", "text": delta})

    def thinking(self, delta: str) -> list[bytes]:
        return self._delta("thinking", {"type": "thinking_delta", "thinking": delta})

    def _delta(self, kind: str, delta: dict) -> list[bytes]:
        out = []
        if self._open != kind:
            out += self._close()
            self._index += 1
            self._open = kind
            block = text_block("") if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
            out.append(_event("content_block_start", {"index": self._index, "content_block": block}))
        out.append(_event("content_block_delta", {"index": self._index, "delta": delta}))
        return out

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self._index})]

    def finish(self, calls, reason: str, stop_sequence: Optional[str], f: Finished,
               thinking_tokens: int = 0) -> list[bytes]:
        out = self._close()
        for call in calls:
            block = tool_use_block(call)
            self._index += 1
            out.append(_event("content_block_start", {"index": self._index, "content_block": dict(block, input={})}))
            out.append(_event("content_block_delta", {"index": self._index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
            out.append(_event("content_block_stop", {"index": self._index}))
        delta = {"stop_reason": stop_reason_of(reason, stop_sequence), "stop_sequence": stop_sequence,
                 "stop_details": None, "container": None}
        out.append(_event("message_delta", {"delta": delta,
                                            "usage": message_usage(f, self.last_breakpoint, thinking_tokens)}))
        out.append(_event("message_stop", {}))
        return out

    def fail(self, error: APIError) -> list[bytes]:
        return self.error_event(error)

    @staticmethod
    def error_event(error: APIError) -> list[bytes]:
        """Anthropic's error event (also before message_start: a stream that failed before its first event)."""
        body = anthropic_error_body(error.status_code, error.message)
        return [_event("error", {"error": body["error"], "request_id": body["request_id"]})]
