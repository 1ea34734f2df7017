"""Hermes-format tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``): the old API.

Kept as thin wrappers over ``server.output_parse`` (which handles every mlx-lm family and reasoning text) so
existing callers keep working: ``parse_tool_calls(text) -> (content, calls)`` for a finished reply and
``ToolCallFilter`` (``feed(text) -> str``, ``finish() -> (rest, calls)``) for a stream. New code should call
``server.output_parse.make_output_parser`` with the model's tokenizer instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from server.output_parse import HERMES, OutputParser, make_output_parser, parse_complete

__all__ = ["OPEN", "CLOSE", "parse_tool_calls", "ToolCallFilter"]

OPEN, CLOSE = HERMES.start, HERMES.end
# A tokenizer that names no tool format and has no thinking tags: the parser falls back to Hermes.
_PLAIN = SimpleNamespace(has_tool_calling=False, has_thinking=False)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Return (content without tool-call blocks, tool_calls). Unparsable blocks stay as text."""
    _, content, calls = parse_complete(_PLAIN, text, tools=True)
    return content, calls


@dataclass
class ToolCallFilter:
    """Streams content up to a ``<tool_call>``; buffers calls for parsing (text pieces only)."""

    _parser: OutputParser = field(default_factory=lambda: make_output_parser(_PLAIN, tools=True))

    def feed(self, text: str) -> str:
        return "".join(p.text for p in self._parser.feed(text))

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to emit, tool calls) once generation has ended."""
        pieces, calls = self._parser.finish()
        return "".join(p.text for p in pieces), calls
