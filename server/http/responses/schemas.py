"""Request types of OpenAI's Responses API (``POST /v1/responses``), the subset a text model can honour.

Input items are a tagged union on ``type`` (a message may omit it when it has a ``role``, as the SDK's
"easy input message" does): ``message`` (input_text / output_text / refusal parts), ``function_call``,
``function_call_output`` and ``reasoning`` (accepted, not rendered: chat templates drop past thinking).
An unknown item or part type, an image or file part, a malformed function tool or a wrong type is a 400
naming the parameter. Tools: ``function`` tools, and ``namespace`` groups of them (Codex CLI sends both);
tools the model could only use through OpenAI's own servers or a client-side grammar (``web_search``,
``file_search``, ``code_interpreter``, ``mcp``, ``custom``, ``local_shell`` ...) are not offered to the model:
Codex CLI always sends ``web_search``, and refusing it would refuse every Codex request. Unknown top-level
fields (``include``, ``truncation``, ``service_tier`` ...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator

__all__ = [
    "InputText", "OutputText", "Refusal", "MessageItem", "FunctionCallItem", "FunctionCallOutputItem",
    "ReasoningItem", "InputItem", "FunctionTool", "NamespaceTool", "ToolChoiceFunction", "TextFormat", "TextConfig",
    "ResponsesRequest", "INPUT_ITEMS",
]

_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image", "image_url")


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


ContentPart = Annotated[Union[InputText, OutputText, Refusal], Field(discriminator="type")]


def _refuse_media(parts):
    """A clear 400 for image/file/audio parts (instead of pydantic's list of expected tags)."""
    if isinstance(parts, list):
        for part in parts:
            if isinstance(part, dict) and part.get("type") in _MEDIA_PARTS:
                raise ValueError(f"content part type '{part['type']}' is not supported: this server serves "
                                 "text-only models; send input_text / output_text parts")
    return parts


def part_text(part) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]

    @field_validator("content", mode="before")
    @classmethod
    def _media(cls, v):
        return _refuse_media(v)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part_text(p) for p in self.content)


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    arguments: str = ""


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
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


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: Optional[list[dict[str, Any]]] = None
    encrypted_content: Optional[str] = None


def _item_tag(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("type") or ("message" if "role" in value else None)
    return getattr(value, "type", None)


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_input_item",
        custom_error_message="each input item needs a known 'type' (message, function_call, function_call_output, "
                             "reasoning) or a 'role'",
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


OFFERED_TOOL_TYPES = ("function", "namespace")


class ToolChoiceFunction(_Lenient):
    type: Literal["function"]
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
    tools: Optional[list[Annotated[Union[FunctionTool, NamespaceTool], Field(discriminator="type")]]] = Field(
        default=None, max_length=512)
    tool_choice: Union[Literal["auto", "none", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    text: Optional[TextConfig] = None
    reasoning: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = Field(default=None, max_length=1024)
    prompt_cache_key: Optional[str] = Field(default=None, max_length=1024)

    @field_validator("tools", mode="before")
    @classmethod
    def _offered_tools_only(cls, v):
        """Drop the tools this server cannot offer the model (see the module docstring); keep anything
        malformed for validation to refuse."""
        if isinstance(v, list):
            return [t for t in v if not (isinstance(t, dict) and isinstance(t.get("type"), str)
                                         and t["type"] not in OFFERED_TOOL_TYPES)]
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v):
        if v:
            raise ValueError("background mode is not supported; send the request without 'background'")
        return v
