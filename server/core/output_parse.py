"""Split a model's reply into answer text, reasoning text and tool calls, per model family.

The formats are mlx-lm's: its tokenizer wrapper detects the model's tool-call family from the chat template
(``tool_parser``, ``tool_call_start``, ``tool_call_end``) and its thinking tags from the vocabulary
(``think_start``, ``think_end``). This module wraps, never re-implements, both halves of mlx-lm's own server:

- ``mlx_lm.generate.make_text_state_machine`` / ``TextStateMachine`` walk the streamed text, strip the markers
  and hold back a suffix that may still grow into one (so a client never sees a half marker);
- the family's ``parse_tool_call(text, tools)`` turns one buffered call into ``{"name", "arguments"}``
  (or a list of them).

What is ours: the choice of a fallback (the Hermes ``<tool_call>{json}</tool_call>`` format, read by mlx-lm's
``json_tools`` parser, for models whose template names no format: SmolLM2 and most small models), the OpenAI
shape of the calls, unparsable markup going back to the text verbatim (mlx-lm drops it), and the whitespace
rule: whitespace that borders markup which was consumed (a think block, a parsed call) is dropped, so
``"<think>\\nhm\\n</think>\\n\\nHi"`` reads as reasoning ``"hm"`` and text ``"Hi"``.

Contract (one ``OutputParser`` per request; pure Python, no model):
    feed(text) -> list[Piece]     the pieces safe to emit now, in order, same-kind neighbours merged
    finish() -> (pieces, calls)   the held-back rest, and every tool call in OpenAI shape
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Literal, Optional, Sequence

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.tool_parsers import json_tools

from server.core.request import custom_call

__all__ = [
    "Piece",
    "ToolFormat",
    "HERMES",
    "OutputParser",
    "make_output_parser",
    "parse_complete",
    "prompt_opens_thinking",
    "tool_format",
]

log = logging.getLogger("mlx_lane.output_parse")

# a call to a custom tool: {"name": NAME} on the first line, the raw input after it (server.core.grammar)
_CUSTOM_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*\}\n(.*)\Z', re.DOTALL)

ParseFn = Callable[[str, Optional[list]], Any]


@dataclass(frozen=True)
class Piece:
    kind: Literal["text", "reasoning"]
    text: str


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call family: its markers and mlx-lm's parser for the text between them."""

    name: str  # the mlx-lm parser module's name, e.g. "qwen3_coder"; "hermes" for the fallback
    start: str
    end: str  # "" when the family has no end marker (mistral): the call runs to the end of the reply
    parse: ParseFn


HERMES = ToolFormat("hermes", json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)


def tool_format(tokenizer) -> ToolFormat:
    """The family mlx-lm detected for this tokenizer (from its chat template / vocabulary), else Hermes."""
    parse = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    if not getattr(tokenizer, "has_tool_calling", False) or parse is None or not start:
        return HERMES
    name = getattr(parse, "__module__", "") or ""
    return ToolFormat(name.rsplit(".", 1)[-1] or "custom", start, getattr(tokenizer, "tool_call_end", "") or "", parse)


def prompt_opens_thinking(tokenizer, prompt: Sequence[int]) -> bool:
    """True when the rendered prompt leaves a think block open (templates that end with ``<think>\\n``), so the
    reply starts inside reasoning. The same test as mlx_lm.server (last think_start after last think_end)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    try:
        return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
    except (AttributeError, TypeError, ValueError):
        return False


def _machine_spec(tokenizer, fmt: ToolFormat, tools: bool) -> SimpleNamespace:
    """The attributes ``make_text_state_machine`` reads, with our tool format (or none) in place of the
    tokenizer's: the fallback needs markers the wrapper does not have, and tools=False needs none."""
    thinking = bool(getattr(tokenizer, "has_thinking", False)) and bool(getattr(tokenizer, "think_start", None))
    return SimpleNamespace(
        has_thinking=thinking,
        think_start=getattr(tokenizer, "think_start", None),
        think_end=getattr(tokenizer, "think_end", None),
        has_tool_calling=tools,
        tool_call_start=fmt.start,
        tool_call_end=fmt.end,
        # A think_end met outside reasoning (a tool call made while thinking returns mlx-lm's machine to
        # "normal" before the model closes its think block) is markup too: drop it, never show it.
        structural_markers=tuple(getattr(tokenizer, "structural_markers", ()) or ())
        + ((tokenizer.think_end,) if thinking and getattr(tokenizer, "think_end", None) else ()),
        response_transitions=dict(getattr(tokenizer, "response_transitions", {}) or {}),
    )


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _openai_calls(parsed: Any) -> list[dict]:
    """mlx-lm's parser result -> OpenAI tool_calls. Raises ValueError for anything that is not a named call."""
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        raise ValueError("no call in the parsed markup")
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f"not a tool call: {item!r:.80}")
        # Hermes-style models sometimes say "parameters"; mlx-lm's json_tools passes the object through as is.
        args = item.get("arguments", item.get("parameters", {}))
        if args is None:
            args = {}
        if isinstance(args, str):
            text = args  # some templates render arguments as JSON text already
        elif isinstance(args, dict):
            text = json.dumps(args, ensure_ascii=False)
        else:
            raise ValueError(f"tool call arguments are not an object: {args!r:.80}")
        calls.append({"id": _call_id(), "type": "function", "function": {"name": item["name"], "arguments": text}})
    return calls


class OutputParser:
    """Fed the detokenized deltas of one reply in order; see the module docstring for the contract."""

    def __init__(self, tokenizer, *, tools: bool, in_reasoning: bool = False,
                 tool_specs: Optional[list[dict]] = None, custom_tools: Sequence[str] = ()) -> None:
        self.format = tool_format(tokenizer)
        spec = _machine_spec(tokenizer, self.format, tools)
        self._tools = tools
        self._tool_specs = tool_specs
        self._custom = frozenset(custom_tools)
        self._passthrough = not (spec.has_thinking or tools or spec.structural_markers or spec.response_transitions)
        self._sm = make_text_state_machine(spec)
        initial = getattr(tokenizer, "response_initial_state", None)
        if not isinstance(initial, str):
            initial = "reasoning" if (in_reasoning and spec.has_thinking) else "normal"
        self._state = self._sm.make_state(initial)
        self._where = initial  # the state name the machine is in
        self._body: list[str] = []  # text of the tool call being buffered
        self._calls: list[dict] = []
        self._out: list[Piece] = []
        self._ws = ""  # trailing whitespace held back: dropped if markup follows, else emitted
        self._ws_kind: str = "text"
        self._trim_next = initial == "reasoning"  # drop leading whitespace of the next piece
        self._finished = False

    # -- public ---------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        if self._finished:
            raise RuntimeError("OutputParser.feed() after finish()")
        if self._passthrough:
            return [Piece("text", text)] if text else []
        self._state, segments = TextStateMachine.split(self._state, text)
        self._take_segments(segments)
        return self._drain()

    def finish(self) -> tuple[list[Piece], list[dict]]:
        if self._finished:
            return [], list(self._calls)
        self._finished = True
        if self._passthrough:
            return [], []
        self._state, rest, where = TextStateMachine.flush(self._state)
        self._take(where, rest)
        if where == "tool":
            # Cut short (max_tokens, a stop string) or a family without an end marker (mistral): parse what
            # we have; a truncated call fails and goes back to the text.
            self._close_call(closed=False)
        if self._ws:
            self._out.append(Piece(self._ws_kind, self._ws))  # type: ignore[arg-type]
            self._ws = ""
        return self._drain(), list(self._calls)

    def complete(self, text: str) -> tuple[str, str, list[dict]]:
        """A whole reply at once: (reasoning, content, calls) = feed(text) + finish(), joined by kind."""
        pieces = self.feed(text)
        rest, calls = self.finish()
        pieces += rest
        return ("".join(p.text for p in pieces if p.kind == "reasoning"),
                "".join(p.text for p in pieces if p.kind == "text"), calls)

    # -- internals ------------------------------------------------------------------------------------------
    def _take_segments(self, segments: list[tuple[Optional[str], str]]) -> None:
        for i, (where, text) in enumerate(segments):
            if i:  # consecutive segments are separated by one consumed marker
                self._transition(self._where, where)
            self._where = where
            self._take(where, text)

    def _take(self, where: Optional[str], text: str) -> None:
        if not text:
            return
        if where == "normal":
            self._emit("text", text)
        elif where == "reasoning":
            self._emit("reasoning", text)
        elif where == "tool":
            self._body.append(text)
        # other states (a response format's message headers, e.g. muse_spark) are structure: dropped, as mlx-lm does

    def _transition(self, old: Optional[str], new: Optional[str]) -> None:
        if old == "tool":
            self._close_call(closed=True)
        elif new != "tool":
            self._consumed_markup()
        # entering "tool": keep held whitespace until we know the call parses

    def _close_call(self, *, closed: bool) -> None:
        body = "".join(self._body)
        self._body = []
        raw = self.format.start + body + (self.format.end if closed else "")
        if not self._tools:
            self._emit("text", raw)  # a response format's tool state while tools are off: plain text
            return
        custom = self._custom_call(body)
        if custom is not None:
            self._calls.append(custom)
            self._consumed_markup()
            return
        try:
            calls = [self._as_custom(c) for c in _openai_calls(self.format.parse(body, self._tool_specs))]
        except Exception as exc:  # noqa: BLE001 - foreign parsers raise anything on model output; it is text then
            log.info("tool-call markup did not parse (%s: %s); returned as text", type(exc).__name__, exc)
            self._emit("text", raw)
            return
        self._calls.extend(calls)
        self._consumed_markup()

    def _custom_call(self, body: str) -> Optional[dict]:
        """A call to a custom tool written ``{"name": NAME}`` + newline + the raw input (server.core.grammar), or
        None when the body is not one."""
        if not self._custom:
            return None
        m = _CUSTOM_CALL.match(body)
        if m is None:
            return None
        try:
            name = json.loads(m.group(1))
        except json.JSONDecodeError:
            return None
        if name not in self._custom:
            return None
        text = m.group(2)
        return custom_call(_call_id(), name, text[:-1] if text.endswith("\n") else text)  # the close's newline

    def _as_custom(self, call: dict) -> dict:
        """A function-shaped call to a custom tool (a model that wrote JSON: ``{"input": ...}``) as a custom call."""
        name = call["function"]["name"]
        if name not in self._custom:
            return call
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = call["function"]["arguments"]
        text = args.get("input", "") if isinstance(args, dict) else str(args)
        return custom_call(call["id"], name, text if isinstance(text, str) else json.dumps(text, ensure_ascii=False))

    def _consumed_markup(self) -> None:
        self._ws = ""
        self._trim_next = True

    def _emit(self, kind: str, text: str) -> None:
        if self._trim_next:
            text = text.lstrip()
            if not text:
                return
            self._trim_next = False
        if self._ws and kind != self._ws_kind:
            self._out.append(Piece(self._ws_kind, self._ws))  # type: ignore[arg-type]
            self._ws = ""
        text = self._ws + text
        core = text.rstrip()
        self._ws, self._ws_kind = text[len(core):], kind
        if core:
            self._out.append(Piece(kind, core))  # type: ignore[arg-type]

    def _drain(self) -> list[Piece]:
        out: list[Piece] = []
        for p in self._out:
            if out and out[-1].kind == p.kind:
                out[-1] = Piece(p.kind, out[-1].text + p.text)
            elif p.text:
                out.append(p)
        self._out = []
        return out


def make_output_parser(tokenizer, *, tools: bool, in_reasoning: bool = False,
                       tool_specs: Optional[list[dict]] = None, custom_tools: Sequence[str] = ()) -> OutputParser:
    """Choose the tool-call format from mlx-lm's tokenizer wrapper (falls back to Hermes) and the thinking tags
    when the model has them. ``tools=False``: tool markup is plain text. ``in_reasoning``: the prompt left a
    think block open (see ``prompt_opens_thinking``), so the reply starts as reasoning. ``tool_specs``: the
    request's tools (OpenAI shape), which some families' parsers use to type argument values. ``custom_tools``: the
    names of the request's custom (freeform) tools: their calls come back as ``{"type": "custom", "custom": {"name",
    "input"}}`` with the raw input text."""
    return OutputParser(tokenizer, tools=tools, in_reasoning=in_reasoning, tool_specs=tool_specs,
                        custom_tools=custom_tools)


def parse_complete(tokenizer, text: str, *, tools: bool, in_reasoning: bool = False,
                   tool_specs: Optional[list[dict]] = None) -> tuple[str, str, list[dict]]:
    """(reasoning, content, calls) of a finished reply: ``feed(text)`` + ``finish()`` joined by kind."""
    return make_output_parser(tokenizer, tools=tools, in_reasoning=in_reasoning, tool_specs=tool_specs).complete(text)
