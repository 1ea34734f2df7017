"""Stand-in for ``server/output_parse.py`` (the tool-parsers branch) with the same interface.

Until that module lands, the generation core parses output through this adapter over
``server/tool_calls.py`` (Hermes ``<tool_call>{json}</tool_call>``, no reasoning split). The shapes
(``Piece``, ``feed`` / ``finish``, ``make_output_parser(tokenizer, *, tools)``) are the ones fixed in
/work/briefs/interfaces.md, so swapping the import is the whole migration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from server.tool_calls import ToolCallFilter

__all__ = ["Piece", "OutputParser", "make_output_parser"]


@dataclass(frozen=True)
class Piece:
    kind: Literal["text", "reasoning"]
    text: str


class OutputParser:
    """Fed detokenized deltas in order; holds back a partial ``<tool_call>`` marker and everything after it."""

    def __init__(self, tools: bool):
        self._filter = ToolCallFilter() if tools else None

    def feed(self, text: str) -> list[Piece]:
        out = self._filter.feed(text) if self._filter else text
        return [Piece("text", out)] if out else []

    def finish(self) -> tuple[list[Piece], list[dict]]:
        if self._filter is None:
            return [], []
        rest, calls = self._filter.finish()
        return ([Piece("text", rest)] if rest else []), calls


def make_output_parser(tokenizer, *, tools: bool) -> OutputParser:  # noqa: ARG001 - same signature as output_parse
    return OutputParser(tools)
