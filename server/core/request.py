"""The internal request: what a front door asks the generation core for, whatever API it came through.

A door (server.http.*) validates its own wire body with its own pydantic schema, once, and builds one
``GenerationRequest``: chat messages as chat templates read them (or a raw completion prompt), the offered tools,
the output constraints and the sampling wishes, with ``None`` meaning "the default". The core (server.core.prompts,
server.core.generation) turns it into token ids and the lane's ``SamplingParams``; it never sees a wire type.

Errors the core raises name the client's own parameter: ``GenerationRequest.param(field)`` maps an internal field
("messages", "max_tokens", "response_format", "tools", "tool_choice", "stop", "logit_bias", "prompt") to the name
the door's API uses for it (``names``), so a Responses client reads "max_output_tokens" and an Anthropic one
"stop_sequences", with no string rewriting afterwards.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from server.core.media import IMAGE_KEY
from server.errors import InvalidRequest
from server.lane.target import Target

__all__ = ["GenerationRequest", "MaxTokens", "ROOM", "REASONING_KEY", "CustomTool", "template_message",
           "function_tool", "custom_call", "system_breakpoint", "TemplateWishes", "template_wishes",
           "RESERVED_TEMPLATE_KWARGS"]


REASONING_KEY = "reasoning_content"  # an assistant message's past thinking (what Qwen3-style templates read)
ROOM = "room"  # a default max_tokens: the whole room the prompt leaves in the context (OpenAI's Responses API)


class MaxTokens(enum.Enum):
    """What a ``max_tokens`` larger than the room the prompt leaves in the context means."""

    REFUSE = "refuse"  # a 400 naming it (OpenAI's chat and text completions)
    FIT = "fit"  # lowered to the room (Anthropic clients size it for Claude: Claude Code asks for 64,000)


@dataclass(frozen=True)
class CustomTool:
    """A freeform tool (OpenAI's ``custom`` tools): its one input is raw text, free (``syntax`` None) or following a
    grammar (``syntax`` "lark" or "regex", ``definition``). Chat templates know only JSON tools: they are shown one
    as a function whose single string parameter is ``input`` (``as_function``); server.core.prompts decides how a
    call to it is written and rendered."""

    name: str
    description: Optional[str] = None
    syntax: Optional[str] = None
    definition: Optional[str] = None

    def as_function(self) -> dict:
        what = "raw text" if self.syntax is None else f"raw text in the tool's own {self.syntax} grammar"
        description = (self.description or "").strip()
        note = f"(A freeform tool: its input is {what}, not JSON.)"
        return function_tool(self.name, f"{description} {note}".strip(), {
            "type": "object", "properties": {"input": {"type": "string", "description": f"The input, {what}."}},
            "required": ["input"]})


@dataclass(frozen=True)
class GenerationRequest:
    messages: tuple[dict, ...] = ()  # chat messages as the template reads them (see template_message)
    prompt: Union[str, tuple[int, ...], None] = None  # a text completion's prompt instead of messages
    tools: tuple[dict, ...] = ()  # offered functions: {"type": "function", "function": {"name", ...}}
    deferred_tools: tuple[str, ...] = ()  # names of ``tools`` the chat template's tool list leaves out (Anthropic's
    # defer_loading): the conversation shows them (a tool search's result), calls to them parse like any other's
    custom_tools: tuple[CustomTool, ...] = ()  # offered freeform tools (Responses ``custom`` tools)
    tool_choice: str = "auto"  # "auto" | "none" | "required"
    forced_tool: Optional[str] = None  # the tool (a function or a custom tool) every call must name
    parallel_tool_calls: Optional[bool] = None
    answer_schema: Optional[dict] = None  # the JSON schema the answer must follow (response_format)
    max_tokens: Optional[int] = None
    max_tokens_over_room: MaxTokens = MaxTokens.REFUSE
    default_max_tokens: Union[int, str, None] = None  # when max_tokens is None: this, ROOM (all the room the
    # prompt leaves in the context), or None (the server's --default-max-tokens)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[Mapping[int, float]] = None
    logprobs: bool = False
    top_logprobs: int = 0
    num_draft_tokens: Optional[int] = None  # mlx-lane extension: cap the speculative draft (0: none)
    session: Optional[str] = None  # the prefix cache's session (header, prompt_cache_key, user ...)
    breakpoints: tuple[int, ...] = ()  # cache hints: the prefix of the first N messages is kept as its own entry
    enable_thinking: Optional[bool] = None  # the chat template's reasoning switch (None: the template's default);
    # mlx-lm's tokenizer passes it under the template's own name (``thinking`` for some renderers)
    reasoning_effort: Optional[str] = None  # the effort asked (a level of server.core.template_facts.EFFORT_SCALE);
    # the template variable ``reasoning_effort`` gets the nearest level the template takes (none when it reads none)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the client's own template variables (vLLM's
    # chat_template_kwargs) besides the reasoning switch and effort, which are read into the two fields above
    target: Optional[Target] = None  # the model that computes it: set by the pipeline from the request's model
    # name (server.http.target), never None once the request reaches the core
    names: Mapping[str, str] = field(default_factory=dict)  # internal field -> the client's parameter name

    def param(self, name: str) -> str:
        """The client's name of an internal field, for an error's ``param`` and message."""
        return self.names.get(name, name)

    @property
    def images(self) -> tuple:
        """The images of ``messages`` (server.core.media.ImageRef, in message and part order: the order chat
        templates render them in)."""
        return tuple(part[IMAGE_KEY] for m in self.messages if isinstance(m.get("content"), list)
                     for part in m["content"] if isinstance(part, dict) and IMAGE_KEY in part)

    @property
    def tools_enabled(self) -> bool:
        """Tools are offered to the model unless ``tool_choice`` is ``"none"``."""
        return bool(self.tools or self.custom_tools) and self.tool_choice != "none"

    @property
    def template_tools(self) -> list[dict]:
        """The tool list the chat template renders: the offered functions but the deferred ones, then the custom
        tools as functions; empty when tools are off. A deferred tool loaded mid-session (its definition added to
        ``tools``) thus leaves the prompt's opening as it was, and the prefix cache keeps serving it."""
        if not self.tools_enabled:
            return []
        deferred = set(self.deferred_tools)
        return ([t for t in self.tools if t["function"]["name"] not in deferred]
                + [c.as_function() for c in self.custom_tools])

    @property
    def function_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def custom_names(self) -> list[str]:
        return [c.name for c in self.custom_tools]


def template_message(role: str, content, *, name: Optional[str] = None, tool_calls=(),
                     tool_call_id: Optional[str] = None, reasoning: Optional[str] = None) -> dict:
    """One chat message in the shape chat templates read: ``developer`` is ``system``, no content is ""; a content
    with images is a list of parts (server.core.media.parts_content);
    ``tool_calls`` given as ``(id, name, arguments JSON text)`` become ``{"id", "type", "function": {"name",
    "arguments"}}`` with the arguments parsed back into a JSON value when they are JSON (templates render objects,
    not quoted strings); a call given as a dict (``custom_call``) is kept as it is. ``reasoning``: an assistant
    turn's thinking as the model produced it (``REASONING_KEY``; server.core.prompts renders it the way this model's
    template reads it)."""
    d: dict = {"role": "system" if role == "developer" else role, "content": content or ""}
    if reasoning is not None and d["role"] == "assistant":
        d[REASONING_KEY] = reasoning
    if name:
        d["name"] = name
    if tool_calls:
        d["tool_calls"] = [call if isinstance(call, dict) else
                           {"id": call[0], "type": "function", "function": {"name": call[1],
                                                                           "arguments": _maybe_json(call[2])}}
                           for call in tool_calls]
    if tool_call_id:
        d["tool_call_id"] = tool_call_id
    return d


def function_tool(name: str, description: Optional[str] = None, parameters: Optional[dict] = None) -> dict:
    """An offered function in OpenAI's chat shape (what chat templates and the grammar read)."""
    fn = {k: v for k, v in (("name", name), ("description", description), ("parameters", parameters)) if v is not None}
    return {"type": "function", "function": fn}


def system_breakpoint(messages) -> tuple[int, ...]:
    """The implicit cache breakpoint of an OpenAI request: after its leading system (developer) messages, the part
    agents share across sessions (instructions, tool rules), when anything follows them."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    return (n,) if 0 < n < len(messages) else ()


# template arguments the server sets itself: a client's chat_template_kwargs may not name them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "chat_template", "return_dict",
                                      "return_tensors", "padding", "truncation", "max_length"})


@dataclass(frozen=True)
class TemplateWishes:
    """What a request asks of the chat template: the reasoning switch, the effort, and other variables."""

    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


def template_wishes(kwargs: Optional[Mapping[str, Any]], *, enable_thinking: Optional[bool] = None,
                    effort: Optional[str] = None, param: str = "chat_template_kwargs") -> TemplateWishes:
    """A request's chat template variables: the door's own reasoning fields (``enable_thinking``, ``effort``) win
    over the same ones in ``kwargs`` (vLLM's ``chat_template_kwargs``: ``enable_thinking`` and ``reasoning_effort``
    are read as the switch and the effort; the rest pass to the template as they are). Raises InvalidRequest naming ``param`` for a variable the server sets itself, or an effort that is not
    a string."""
    rest = dict(kwargs or {})
    bad = sorted(k for k in rest if k in RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise InvalidRequest(f"'{param}' may not set '{bad[0]}': the server sets it from the request itself",
                             param=f"{param}.{bad[0]}")
    switch = rest.pop("enable_thinking", None)
    if enable_thinking is None and switch is not None:
        enable_thinking = bool(switch)
    asked = rest.pop("reasoning_effort", None)
    if asked is not None and not isinstance(asked, str):
        raise InvalidRequest(f"'{param}.reasoning_effort' must be a string such as \"low\", \"medium\" or "
                             "\"high\"", param=f"{param}.reasoning_effort")
    return TemplateWishes(enable_thinking, effort if effort is not None else asked, rest)


def custom_call(call_id: str, name: str, text: str) -> dict:
    """A call to a custom tool, in OpenAI's shape: ``{"id", "type": "custom", "custom": {"name", "input"}}``."""
    return {"id": call_id, "type": "custom", "custom": {"name": name, "input": text}}


def _maybe_json(s):
    try:
        return json.loads(s)
    except (json.JSONDecodeError, TypeError):
        return s
