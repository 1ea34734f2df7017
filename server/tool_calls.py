"""Tool calls in the Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

``parse_tool_calls(text)`` splits a finished completion into the plain content and a list
of OpenAI ``tool_calls``. ``ToolCallFilter`` is its streaming twin: it passes content
through until a ``<tool_call>`` marker begins (holding back a partial marker) and
buffers everything from there, so a client never sees raw markup while streaming.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from server.stops import StopMatcher

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Return (content without tool-call blocks, tool_calls). Unparsable blocks stay as text."""
    if OPEN not in text:
        return text, []
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _decode_call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return content, calls


def _decode_call(payload: str) -> dict | None:
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": _call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}


@dataclass
class ToolCallFilter:
    """Streams content up to the first ``<tool_call>``; buffers the rest for parsing."""

    _marker: StopMatcher = field(default_factory=lambda: StopMatcher([OPEN]))
    _tail: list[str] = field(default_factory=list)

    def feed(self, text: str) -> str:
        if self._marker.stopped:
            self._tail.append(text)
            return ""
        before = self._marker._pending + text
        out = self._marker.feed(text)
        if self._marker.stopped:
            self._tail.append(before[len(out) :])
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to emit, tool calls) once generation has ended."""
        if not self._marker.stopped:
            return self._marker.flush(), []
        tail = "".join(self._tail)
        return parse_tool_calls(tail)
