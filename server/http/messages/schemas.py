"""Request types of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

A turn's role is user, assistant or system (a system turn mid-conversation, as Claude Code sends them; its
text blocks only). Content blocks are a tagged union on ``type``: ``text``, ``tool_use``, ``tool_result`` (content a string
or text and ``tool_reference`` blocks: the tools a client-side tool search loaded, as Claude Code's ToolSearch
answers), ``thinking`` (its text goes back with its turn) / ``redacted_thinking`` (accepted, not rendered). A tool may be marked
``defer_loading`` (kept out of the chat template's tool list, still callable). ``image`` blocks (base64 or URL
source; in a turn or a tool result) are read by a model that takes images (a text-only model answers a 400 naming
the block: server.core.prompts.render_media); document blocks are refused with a message saying why; an unknown
block type, a wrong type, a missing ``max_tokens`` or ``model`` is a 400 in Anthropic's error shape (mapped at the
app boundary). ``thinking`` and ``output_config.effort`` are validated (an unknown type or level is a 400) and mapped onto the chat template by
server.http.messages.translate. Unknown fields (``cache_control``, ``service_tier``, ``container`` ...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.errors import InvalidRequest

__all__ = [
    "TextBlock", "ImageBlock", "ToolReferenceBlock", "ToolUseBlock", "ToolResultBlock", "ThinkingBlock", "RedactedThinkingBlock", "MessageParam",
    "AnthropicTool", "ToolChoice", "ThinkingConfig", "OutputConfig", "EFFORTS", "CountTokensRequest",
    "MessagesRequest",
]

_MEDIA_BLOCKS = ("document", "search_result", "container_upload")  # images: ImageBlock
MAX_STOP_SEQUENCES = 16  # as for OpenAI's stop (server.http.chat.schemas)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


def _refuse_media(blocks):
    if isinstance(blocks, list):
        for block in blocks:
            if isinstance(block, dict) and block.get("type") in _MEDIA_BLOCKS:
                raise ValueError(f"content block type '{block['type']}' is not supported by this server; send "
                                 "text (and image) blocks")
    return blocks


class ImageSource(_Lenient):
    type: Literal["base64", "url"]
    media_type: Optional[str] = None
    data: Optional[str] = None  # base64
    url: Optional[str] = None  # fetched only with --allow-image-urls


class ImageBlock(_Lenient):
    """An image (``source`` base64 data or a URL): read by a model that takes images (server.core.media)."""

    type: Literal["image"]
    source: ImageSource

    def ref(self, param: str):
        from server.core.media import base64_ref, image_ref

        src = self.source
        if src.type == "base64":
            if src.data is None:
                raise InvalidRequest("a base64 image source needs data", param=f"{param}.source.data")
            return base64_ref(src.data, f"{param}.source.data")
        if src.url is None:
            raise InvalidRequest("a url image source needs url", param=f"{param}.source.url")
        return image_ref(src.url, f"{param}.source.url")


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]


class ToolReferenceBlock(_Lenient):
    """A tool a client-side tool search found (Anthropic's tool search; Claude Code's ToolSearch answers with
    them): only inside a ``tool_result``'s content. server.http.messages.translate renders it in place as the named
    tool's definition, taken from the request's ``tools``."""

    type: Literal["tool_reference"]
    tool_name: str = Field(min_length=1, max_length=128)


ToolResultContent = Annotated[Union[TextBlock, ToolReferenceBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: Union[str, list[ToolResultContent]] = ""
    is_error: Optional[bool] = None

    @field_validator("content", mode="before")
    @classmethod
    def _media(cls, v):
        return _refuse_media(v)


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
    Field(discriminator="type"),
]


class MessageParam(_Lenient):
    # "system" mid-conversation: Claude Code sends it (anthropic-beta mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]

    @field_validator("content", mode="before")
    @classmethod
    def _media(cls, v):
        return _refuse_media(v)


class AnthropicTool(_Lenient):
    type: Optional[Literal["custom"]] = None
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    # a tool the model learns of from a tool search's result (a tool_reference block), not from the tool list
    defer_loading: Optional[bool] = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(default=None, min_length=1, max_length=128)
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's 'name'")
        return self


class ThinkingConfig(_Lenient):
    """``thinking``: ``{"type": "enabled", "budget_tokens": N}``, ``{"type": "disabled"}`` or ``{"type":
    "adaptive"}`` (server.http.messages.translate maps it onto the model's chat template)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(default=None, ge=0)


EFFORTS = ("low", "medium", "high", "xhigh", "max")  # Anthropic's output_config.effort levels, lowest first


class OutputConfig(_Lenient):
    """``output_config``: ``effort`` is read (other members, e.g. ``format``, are ignored)."""

    effort: Optional[Literal[EFFORTS]] = None


class Metadata(_Lenient):
    user_id: Optional[str] = Field(default=None, max_length=1024)


class CountTokensRequest(_Lenient):
    """What ``/v1/messages/count_tokens`` reads: the prompt side of a Messages request."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageParam] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnthropicTool]] = Field(default=None, max_length=512)
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's template variables (server.core.request)

    @field_validator("system", mode="before")
    @classmethod
    def _system_media(cls, v):
        return _refuse_media(v)

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, v):
        if isinstance(v, list):
            for tool in v:
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind not in (None, "custom"):
                    raise ValueError(f"tool type '{kind}' is a server tool this server does not run; declare "
                                     "client tools ({\"name\", \"description\", \"input_schema\"})")
        return v


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: bool = False
    metadata: Optional[Metadata] = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, v):
        if v is None:
            return None
        if len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return [s for s in v if s]
