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

__all__ = ["GenerationRequest", "MaxTokens", "template_message", "function_tool"]


class MaxTokens(enum.Enum):
    """What a ``max_tokens`` larger than the room the prompt leaves in the context means."""

    REFUSE = "refuse"  # a 400 naming it (OpenAI's chat and text completions)
    FIT = "fit"  # lowered to the room (Anthropic clients size it for Claude: Claude Code asks for 64,000)


@dataclass(frozen=True)
class GenerationRequest:
    messages: tuple[dict, ...] = ()  # chat messages as the template reads them (see template_message)
    prompt: Union[str, tuple[int, ...], None] = None  # a text completion's prompt instead of messages
    tools: tuple[dict, ...] = ()  # offered functions: {"type": "function", "function": {"name", ...}}
    tool_choice: str = "auto"  # "auto" | "none" | "required"
    forced_tool: Optional[str] = None  # the function every call must name (tool_choice naming one)
    parallel_tool_calls: Optional[bool] = None
    answer_schema: Optional[dict] = None  # the JSON schema the answer must follow (response_format)
    max_tokens: Optional[int] = None
    max_tokens_over_room: MaxTokens = MaxTokens.REFUSE
    default_max_tokens: Optional[int] = None  # when max_tokens is None (None: the server's --default-max-tokens)
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
    adapter: Optional[Any] = None  # the LoRA adapter the request's model name selected (None: the base model)
    names: Mapping[str, str] = field(default_factory=dict)  # internal field -> the client's parameter name

    def param(self, name: str) -> str:
        """The client's name of an internal field, for an error's ``param`` and message."""
        return self.names.get(name, name)

    @property
    def tools_enabled(self) -> bool:
        """Tools are offered to the model unless ``tool_choice`` is ``"none"``."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def function_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def template_message(role: str, content: Optional[str], *, name: Optional[str] = None, tool_calls=(),
                     tool_call_id: Optional[str] = None) -> dict:
    """One chat message in the shape chat templates read: ``developer`` is ``system``, no content is "";
    ``tool_calls`` given as ``(id, name, arguments JSON text)`` become ``{"id", "type", "function": {"name",
    "arguments"}}`` with the arguments parsed back into a JSON value when they are JSON (templates render objects,
    not quoted strings)."""
    d: dict = {"role": "system" if role == "developer" else role, "content": content or ""}
    if name:
        d["name"] = name
    if tool_calls:
        d["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": fn, "arguments": _maybe_json(args)}}
                           for call_id, fn, args in tool_calls]
    if tool_call_id:
        d["tool_call_id"] = tool_call_id
    return d


def function_tool(name: str, description: Optional[str] = None, parameters: Optional[dict] = None) -> dict:
    """An offered function in OpenAI's chat shape (what chat templates and the grammar read)."""
    fn = {k: v for k, v in (("name", name), ("description", description), ("parameters", parameters)) if v is not None}
    return {"type": "function", "function": fn}


def _maybe_json(s):
    try:
        return json.loads(s)
    except (json.JSONDecodeError, TypeError):
        return s
