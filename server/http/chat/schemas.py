"""Request types of the OpenAI API subset we serve (pydantic v2).

Unknown fields are accepted and ignored (clients send many: ``store``, ``metadata``,
``parallel_tool_calls`` ...); known fields are validated strictly enough that a wrong
type or an out-of-range value is a 400 naming the parameter. Fields we do not
implement in a way that would change the output (``n`` > 1, an unknown ``response_format``
type) are refused explicitly rather than ignored. ``response_format`` json_object / json_schema
and forced or strict tool calls are enforced by constrained decoding (server/core/grammar.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.core.media import image_ref, parts_content
from server.core.template_facts import EFFORT_SCALE

MAX_STOP_SEQUENCES = 16
MAX_LOGIT_BIAS_ENTRIES = 1024
TOOL_CHOICES = ("none", "auto", "required")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text", "input_text"]
    text: str


class ImageURL(_Lenient):
    url: str
    detail: Optional[str] = None  # accepted; the model's processor decides the resolution


class ImageURLPart(_Lenient):
    """An image: ``image_url.url`` a base64 data: URI, or an http(s) URL (fetched only with --allow-image-urls)."""

    type: Literal["image_url"]
    image_url: Union[ImageURL, str]

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[Union[TextPart, ImageURLPart], Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: str
    arguments: str = ""


class ToolCall(_Lenient):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # an assistant turn's thinking sent back as the reply gave it (``reasoning`` is mlx_lm.server's and newer vLLM's
    # name); rendered back into the prompt as the model produced it (server.core.prompts)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @model_validator(mode="after")
    def _content_required(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def past_reasoning(self) -> Optional[str]:
        """The thinking an assistant turn carries back (None: none sent)."""
        if self.role != "assistant":
            return None
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def template_content(self, index: int):
        """The content as the chat template reads it: the text, or text and image parts when it holds images
        (server.core.media.parts_content); ``index``: the message's place in ``messages`` (errors name it)."""
        if not isinstance(self.content, list):
            return self.text()
        pieces = [p.text if isinstance(p, TextPart) else image_ref(p.url, f"messages.{index}.content.{j}.image_url")
                  for j, p in enumerate(self.content)]
        return parts_content(pieces)[0]


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # true: a call's arguments are constrained to `parameters`


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    """``response_format.json_schema``; the schema is enforced whether ``strict`` is set or not."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class ResponseFormat(_Lenient):
    type: str
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _known(self) -> "ResponseFormat":
        if self.type not in RESPONSE_FORMATS:
            raise ValueError(f"response_format type '{self.type}' is not supported; use one of "
                             f"{', '.join(RESPONSE_FORMATS)}")
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format type 'json_schema' needs a 'json_schema' object "
                             "({\"name\": ..., \"schema\": {...}})")
        return self

    def target_schema(self) -> Optional[dict[str, Any]]:
        """The JSON schema to enforce, or None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_ if self.json_schema.schema_ is not None else {"type": "object"}
        return None


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)  # 0 keeps only the most likely token
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=10.0)
    logit_bias: Optional[dict[str, float]] = None
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(default=None, max_length=1024)
    prompt_cache_key: Optional[str] = Field(default=None, max_length=1024)
    # mlx-lane extension: cap the speculative draft length for this request (0 = decode plainly)
    num_draft_tokens: Optional[int] = Field(default=None, ge=0, le=64)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries are allowed")
        out = {}
        for key, bias in v.items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token < 0:
                raise ValueError(f"logit_bias token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
            out[str(token)] = float(bias)
        return out

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported by this server")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    # reasoning: OpenAI's effort, and vLLM's template variables (server.core.request.template_wishes)
    reasoning_effort: Optional[Literal[EFFORT_SCALE]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if isinstance(v, str) and v not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                             '{"type": "function", "function": {"name": ...}}')
        if isinstance(v, dict):
            fn = v.get("function")
            if v.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError('a tool_choice object must be {"type": "function", "function": {"name": ...}}')
        return v

    @model_validator(mode="after")
    def _checks(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def forced_tool(self) -> Optional[str]:
        """The function name when ``tool_choice`` names one, else None."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tools_enabled(self) -> bool:
        """Tools are offered to the model unless ``tool_choice`` is ``"none"``."""
        return bool(self.tools) and self.tool_choice != "none"


# A prompt of token ids, tried first and strictly: pydantic's smart union over ``str | list[str] | list[int]`` costs
# ~10x more than one strict ``list[int]`` (a 32k-token prompt: 3-8 ms on the 2-core dev CPU, ~20 ms of a served
# RAM hit's path once the lane's thread competes), and agents resend their whole conversation every turn. Left to
# right, each branch is what smart mode would have picked for the same input: exact ints, then text, then a list
# of texts, then ints written otherwise (1.0), which lax list[int] accepts as smart mode did.
TokenIds = list[Annotated[int, Strict()]]
Prompt = Annotated[Union[TokenIds, str, list[str], list[int]], Field(union_mode="left_to_right")]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_type(cls, v, handler):
        try:
            return handler(v)
        except ValidationError:  # the union's first branch's complaint alone would mislead: say what is accepted
            raise PydanticCustomError("prompt", "prompt must be a string, a list of one string, or a list of "
                                      "token ids (integers)") from None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
                v = v[0]
        if isinstance(v, str) and v == "":
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens
