"""Request types of OpenAI's Responses API (``POST /v1/responses``), the subset a text model can honour.

Input items are a tagged union on ``type`` (a message may omit it when it has a ``role``, as the SDK's
"easy input message" does): ``message`` (input_text / output_text / refusal parts, and ``input_image`` parts for a
model that takes images: server.core.media), ``function_call``,
``function_call_output``, ``custom_tool_call``, ``custom_tool_call_output``, ``tool_search_call``,
``tool_search_output``, ``reasoning`` (its ``reasoning_text`` content goes back with the assistant turn after it) and
``compaction`` (what ``/v1/responses/compact`` returned: its summary).
An unknown item or part type, a file or audio part (or an image in a tool's output), a malformed tool or a wrong type is a 400 naming the
parameter. Tools: ``function`` tools, ``namespace`` groups of them, ``custom`` (freeform) tools whose input is
free text or follows a Lark or regex grammar, and a client-executed ``tool_search`` (Codex CLI sends all of them
for models it knows). Tools that only OpenAI's own servers can run (``web_search``, ``file_search``,
``code_interpreter``, ``computer_use_preview``, ``image_generation``, ``mcp``, ``local_shell``, a server-executed
``tool_search`` ...) are not offered to the model, and the log says so once per kind: Codex CLI always sends
``web_search``, and refusing it would refuse every Codex request. Unknown top-level fields (``include``,
``truncation``, ``service_tier`` ...) are ignored.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator

from server.core.media import image_ref, parts_content
from server.core.template_facts import EFFORT_SCALE
from server.errors import InvalidRequest

__all__ = [
    "InputText", "OutputText", "Refusal", "InputImage", "MessageItem", "FunctionCallItem", "FunctionCallOutputItem",
    "ReasoningItem", "CompactionItem", "CustomToolCallItem", "CustomToolCallOutputItem", "ToolSearchCallItem", "ToolSearchOutputItem",
    "InputItem", "FunctionTool", "NamespaceTool", "CustomTool", "ToolSearchTool", "ToolChoiceFunction",
    "ToolChoiceCustom", "TextFormat", "TextConfig", "ResponsesRequest", "InputTokensRequest", "INPUT_ITEMS", "TOOLS",
]

log = logging.getLogger("mlx_lane.responses")

_MEDIA_PARTS = ("input_file", "input_audio", "image", "image_url")  # input_image: a message's image (InputImage)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputText(_Lenient):
    type: Literal["input_text"]
    text: str


class OutputText(_Lenient):
    type: Literal["output_text"]
    text: str


class Refusal(_Lenient):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Lenient):
    """An image in a message: ``image_url`` a base64 data: URI or an http(s) URL (fetched only with
    --allow-image-urls); a ``file_id`` (OpenAI's Files API) is not served here."""

    type: Literal["input_image"]
    image_url: Optional[str] = None
    file_id: Optional[str] = None
    detail: Optional[str] = None  # accepted; the model's processor decides the resolution


ContentPart = Annotated[Union[InputText, OutputText, Refusal], Field(discriminator="type")]
MessagePart = Annotated[Union[InputText, OutputText, Refusal, InputImage], Field(discriminator="type")]


def _refuse_media(parts, refused=_MEDIA_PARTS + ("input_image",)):
    """A clear 400 for image/file/audio parts (instead of pydantic's list of expected tags); a message's own
    ``input_image`` parts are read (``MessageItem``)."""
    if isinstance(parts, list):
        for part in parts:
            if isinstance(part, dict) and part.get("type") in refused:
                raise ValueError(f"content part type '{part['type']}' is not supported: this server serves "
                                 "text-only models; send input_text / output_text parts")
    return parts


def part_text(part) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[MessagePart]]

    @field_validator("content", mode="before")
    @classmethod
    def _media(cls, v):
        return _refuse_media(v, _MEDIA_PARTS)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part_text(p) for p in self.content if not isinstance(p, InputImage))

    def template_content(self, param: str = "input"):
        """The content as the chat template reads it: the text, or text and image parts when it holds images
        (server.core.media.parts_content); ``param``: where the item is (errors name it)."""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, p in enumerate(self.content):
            if not isinstance(p, InputImage):
                pieces.append(part_text(p))
            elif p.image_url is None:
                raise InvalidRequest("an input_image needs image_url (a base64 data: URI); file_id is not served "
                                     "here", param=f"{param}.content.{j}")
            else:
                pieces.append(image_ref(p.image_url, f"{param}.content.{j}.image_url"))
        return parts_content(pieces)[0]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    arguments: str = ""


class _ToolOutputItem(_Lenient):
    """What the client's run of a tool returned, for the call ``call_id`` (each kind adds its ``type``)."""

    call_id: str = Field(min_length=1, max_length=256)
    output: Union[str, list[ContentPart]]

    @field_validator("output", mode="before")
    @classmethod
    def _media(cls, v):
        return _refuse_media(v)

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part_text(p) for p in self.output)


class FunctionCallOutputItem(_ToolOutputItem):
    type: Literal["function_call_output"]


class CustomToolCallItem(_Lenient):
    """A call the model made to a custom (freeform) tool: its raw text ``input``."""

    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: str = ""


class CustomToolCallOutputItem(_ToolOutputItem):
    type: Literal["custom_tool_call_output"]


class ToolSearchCallItem(_Lenient):
    """A client-executed tool search the model asked for (its ``arguments``: the query)."""

    type: Literal["tool_search_call"]
    call_id: Optional[str] = Field(default=None, max_length=256)
    arguments: Any = None


class ToolSearchOutputItem(_Lenient):
    """What the client's tool search found: tool definitions offered to the model from then on."""

    type: Literal["tool_search_output"]
    call_id: Optional[str] = Field(default=None, max_length=256)
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=512)


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: Optional[list[dict[str, Any]]] = None
    encrypted_content: Optional[str] = None

    def reasoning_text(self) -> str:
        """The model's thinking as it produced it: the ``reasoning_text`` parts (a summary is not what it wrote)."""
        return "".join(part.get("text") or "" for part in self.content or ()
                       if isinstance(part, dict) and part.get("type") == "reasoning_text")


class CompactionItem(_Lenient):
    """A compacted conversation (what ``/v1/responses/compact`` returned): expanded into its summary
    (server.http.responses.capsule)."""

    type: Literal["compaction"]
    id: Optional[str] = None
    encrypted_content: str


def _item_tag(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("type") or ("message" if "role" in value else None)
    return getattr(value, "type", None)


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[CustomToolCallItem, Tag("custom_tool_call")],
        Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
        Annotated[ToolSearchCallItem, Tag("tool_search_call")],
        Annotated[ToolSearchOutputItem, Tag("tool_search_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
        Annotated[CompactionItem, Tag("compaction")],
    ],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_input_item",
        custom_error_message="each input item needs a known 'type' (message, function_call, function_call_output, "
                             "custom_tool_call, custom_tool_call_output, tool_search_call, tool_search_output, "
                             "reasoning, compaction) or a 'role'",
    ),
]

INPUT_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamespaceTool(_Lenient):
    """A named group of function tools; a call to one of them comes back with ``namespace`` set."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    tools: list[FunctionTool] = Field(max_length=512)


class TextInput(_Lenient):
    type: Literal["text"]


class GrammarInput(_Lenient):
    """The input follows a grammar: Lark (llguidance's dialect, a superset of what OpenAI accepts) or a regex."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1, max_length=200_000)


class CustomTool(_Lenient):
    """A freeform tool: one text input (Codex CLI's apply_patch takes a patch in its own Lark grammar)."""

    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    format: Optional[Annotated[Union[TextInput, GrammarInput], Field(discriminator="type")]] = None


class ToolSearchTool(_Lenient):
    """Tool search the client runs itself (``execution: "client"``): offered to the model like a function."""

    type: Literal["tool_search"]
    execution: Literal["client"] = "client"
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


Tool = Annotated[Union[FunctionTool, NamespaceTool, CustomTool, ToolSearchTool], Field(discriminator="type")]
TOOLS = TypeAdapter(list[Tool])
OFFERED_TOOL_TYPES = ("function", "namespace", "custom", "tool_search")

_not_offered_logged: set = set()  # hosted tool kinds already named in the log (once per process)


def _offered(tool) -> bool:
    """Can the model be offered this tool here? Hosted tools (run on OpenAI's servers) cannot."""
    if not (isinstance(tool, dict) and isinstance(tool.get("type"), str)):
        return True  # malformed: validation refuses it with a message
    kind = tool["type"]
    if kind == "tool_search" and tool.get("execution", "client") != "client":
        kind = "tool_search (server-executed)"
    elif kind in OFFERED_TOOL_TYPES:
        return True
    if kind not in _not_offered_logged:
        _not_offered_logged.add(kind)
        log.info("responses: tool type '%s' runs on OpenAI's servers and is not offered to the model here "
                 "(logged once)", kind)
    return False


class ToolChoiceFunction(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)


class ToolChoiceCustom(_Lenient):
    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=128)


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Lenient):
    format: Optional[TextFormat] = None


class ResponsesRequest(_Lenient):
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = Field(default=None, max_length=512)
    tool_choice: Union[Literal["auto", "none", "required"],
                       Annotated[Union[ToolChoiceFunction, ToolChoiceCustom], Field(discriminator="type")],
                       None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    max_tool_calls: Optional[int] = Field(default=None, ge=0)  # echoed: no hosted tools here to count
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    text: Optional[TextConfig] = None
    reasoning: Optional[dict[str, Any]] = None  # ``effort`` is read (server.core.template_facts), the rest ignored
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's template variables (server.core.request)
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = Field(default=None, max_length=1024)
    safety_identifier: Optional[str] = Field(default=None, max_length=1024)  # echoed
    prompt_cache_key: Optional[str] = Field(default=None, max_length=1024)

    @field_validator("tools", mode="before")
    @classmethod
    def _offered_tools_only(cls, v):
        """Drop the tools this server cannot offer the model (see the module docstring); keep anything
        malformed for validation to refuse."""
        if isinstance(v, list):
            return [t for t in v if _offered(t)]
        return v

    @field_validator("reasoning")
    @classmethod
    def _effort(cls, v):
        effort = v.get("effort") if isinstance(v, dict) else None
        if effort is not None and effort not in EFFORT_SCALE:
            raise ValueError(f"reasoning.effort must be one of {', '.join(EFFORT_SCALE)} (or null), got {effort!r}")
        return v

    def effort(self) -> Optional[str]:
        """The reasoning effort asked (``reasoning.effort``), or None."""
        return self.reasoning.get("effort") if self.reasoning else None

    @field_validator("background")
    @classmethod
    def _no_background(cls, v):
        if v:
            raise ValueError("background mode is not supported; send the request without 'background'")
        return v


class InputTokensRequest(ResponsesRequest):
    """What ``POST /v1/responses/input_tokens`` reads: a Responses create body whose ``input`` may be left out (a
    ``previous_response_id`` or ``instructions`` alone are counted too)."""

    input: Union[str, list[InputItem]] = Field(default_factory=list)
