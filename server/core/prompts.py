"""Turn an internal request (server.core.request) into token ids, a grammar and the lane's sampling parameters.

Runs off the lane (the handler's thread pool): rendering a chat template and tokenizing is CPU work that must not
queue behind decoding. Every error is an ``InvalidRequest`` (400) naming the client's own parameter
(``GenerationRequest.param``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from models.loading.generation_defaults import NO_DEFAULTS, SamplingDefaults
from server.core.grammar import (
    CustomInput, GrammarSpec, check_custom_grammar, json_schema_grammar, tool_call_grammar,
)
from server.core.media import ImageLimits, PromptMedia, cache_key, decode, image_spans
from server.core.request import ROOM, GenerationRequest, MaxTokens
from server.core.template_input import template_messages, template_variables, writes_hermes
from server.core.token_cache import encoder_for

__all__ = ["render", "render_media", "chat_prompt", "render_chat", "render_chat_text", "template_variables",
           "breakpoint_positions", "breakpoint_marks", "BreakpointMarks", "NO_BREAKPOINTS", "history_end",
           "chat_grammar", "tokenize_completion", "sampling_params"]
from server.errors import ContextLengthExceeded, InvalidRequest
from server.lane.events import SamplingParams

log = logging.getLogger("mlx_lane.prompts")


def render(tokenizer, req: GenerationRequest, vocab_size: int) -> list[int]:
    """The request's prompt as token ids: its chat messages through the model's chat template (tools included),
    or a text completion's prompt (text tokenized as is, or token ids checked against the vocabulary)."""
    if req.prompt is not None:
        return tokenize_completion(tokenizer, req, vocab_size)
    return render_chat(tokenizer, req)


def render_media(slot, req: GenerationRequest, limits: ImageLimits) -> tuple[list[int], PromptMedia]:
    """A chat request with images (``req.images``): its prompt's cache key and what the model reads at its images
    (server.core.media). Each image is decoded within ``limits``; the chat template's text and the images go
    through the model's processor (mlx-vlm). Raises InvalidRequest for a model that takes no images, too many
    images, an image that does not decode or is too large (PayloadTooLarge for its bytes), or images the processor
    cannot pair with the template's placeholders, each naming the client's parameter of the image."""
    vision = getattr(slot, "vision", None)
    if vision is None:
        raise InvalidRequest(f"the model '{slot.name}' does not take images (a text-only model); send text only, "
                             "or pick a model whose /v1/models entry has \"vision\": true",
                             param=req.images[0].param, code="image_input_unsupported")
    if len(req.images) > limits.max_images:
        raise InvalidRequest(f"{len(req.images)} images; this server takes at most {limits.max_images} per request "
                             "(--max-images)", param=req.images[limits.max_images].param)
    decoded = [decode(ref, limits) for ref in req.images]
    text = render_chat_text(slot.tokenizer, req)
    try:
        prepared = vision.prepare(text, [d.image for d in decoded])
    except ValueError as exc:
        raise InvalidRequest(f"the model's processor refused the images: {exc}", param=req.images[0].param) from exc
    ids = list(prepared.input_ids)
    spans = image_spans(ids, vision.image_token_id)
    if len(spans) != len(decoded) or (spans and spans[-1][1] >= len(ids)):
        raise InvalidRequest(f"the prompt holds {len(spans)} image placeholders for {len(decoded)} images (does the "
                             "text spell the model's image token?)", param=req.param("messages"))
    digests = tuple(d.digest for d in decoded)
    media = PromptMedia(tuple(ids), tuple(spans), prepared.pixel_values, digests, getattr(prepared, "grid", None))
    return cache_key(ids, spans, digests), media


def chat_prompt(slot, req: GenerationRequest, limits: ImageLimits) -> list[int]:
    """A chat request's prompt as its generation computes it (its cache key when it has images): for counting."""
    return render_media(slot, req, limits)[0] if req.images else render_chat(slot.tokenizer, req)


def render_chat(tokenizer, req: GenerationRequest, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """Apply the model's chat template (tools included: custom tools as functions of one ``input`` string, deferred
    tools left out: ``GenerationRequest.template_tools``; the request's template variables: ``template_variables``)
    and tokenize. Calls to custom tools in the history are written the way this model writes them
    (server.core.template_input). A generation always adds the generation prompt; /tokenize may ask for the conversation
    alone, or for its last message left open (``continue_final_message``)."""
    ids = _apply_template(tokenizer, req, {}, add_generation_prompt, continue_final_message)
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def render_chat_text(tokenizer, req: GenerationRequest, *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> str:
    """``render_chat``'s rendering as text, before tokenization."""
    return _apply_template(tokenizer, req, {"tokenize": False}, add_generation_prompt, continue_final_message)


def _apply_template(tokenizer, req: GenerationRequest, extra: dict, add_generation_prompt: bool,
                    continue_final_message: bool):
    kwargs = {"add_generation_prompt": add_generation_prompt, **template_variables(req, tokenizer), **extra}
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools := req.template_tools:
        kwargs["tools"] = tools
    messages = template_messages(tokenizer, req.messages)
    try:
        return _templated(tokenizer, messages, kwargs)
    except Exception as exc:  # jinja raises for roles/orders a template refuses
        raise InvalidRequest(f"the chat template rejected these messages: {exc}", param=req.param("messages")) from exc


def _templated(tokenizer, messages: list[dict], kwargs: dict):
    """``tokenizer.apply_chat_template(messages, **kwargs)``; tokenized (the default), the text is rendered and then
    tokenized from the pieces earlier prompts already tokenized (server.core.token_cache: the same ids)."""
    if kwargs.get("tokenize", True) is False:
        return tokenizer.apply_chat_template(messages, **kwargs)
    encoder = encoder_for(tokenizer)
    if encoder is None or not encoder.enabled:
        return tokenizer.apply_chat_template(messages, **kwargs)
    text = tokenizer.apply_chat_template(messages, **{**kwargs, "tokenize": False})
    if not isinstance(text, str):
        return tokenizer.apply_chat_template(messages, **kwargs)
    return encoder.encode(text)


def breakpoint_positions(tokenizer, req: GenerationRequest, prompt: list[int]) -> tuple[int, ...]:
    """Token positions of the request's cache breakpoints in ``prompt`` that are kept as cache entries of their
    own (anchors): those of ``breakpoint_marks`` that leave something to compute and cover something."""
    return breakpoint_marks(tokenizer, req, prompt).anchors


@dataclass(frozen=True)
class BreakpointMarks:
    """Where a request's cache breakpoints fall in its prompt (token positions)."""

    anchors: tuple[int, ...] = ()  # kept as cache entries of their own: 0 < position < len(prompt) - 1
    last: int = 0  # the last breakpoint's position, wherever it falls (0: the request has none, or none renders)


NO_BREAKPOINTS = BreakpointMarks()


def breakpoint_marks(tokenizer, req: GenerationRequest, prompt: list[int]) -> BreakpointMarks:
    """The token positions of the request's cache breakpoints in ``prompt``: for each, the prefix of the first N
    messages rendered alone (same tools, no generation prompt), as far as it agrees with the whole prompt (a
    template may close a turn differently at the end). ``last`` is the greatest (where what Anthropic's usage
    calls cache creation ends); a breakpoint after the last message counts there but is no anchor, nor is a
    position that leaves nothing to compute or covers nothing. A cut the template refuses marks nothing."""
    positions: dict[int, int] = {}  # message count -> token position
    kwargs = {"add_generation_prompt": False, **template_variables(req, tokenizer)}
    if tools := req.template_tools:
        kwargs["tools"] = tools
    for n in sorted(set(req.breakpoints)):
        if not 0 < n <= len(req.messages):
            continue
        messages = template_messages(tokenizer, req.messages[:n])
        end = _end_of_messages(tokenizer, messages, kwargs, prompt) if n == len(req.messages) else None
        if end is not None:
            positions[n] = end
            continue
        try:
            ids = _templated(tokenizer, messages, kwargs)
        except Exception:  # noqa: BLE001 - a template may refuse a conversation cut short: no breakpoint then
            continue
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        positions[n] = next((i for i, (a, b) in enumerate(zip(ids, prompt)) if a != b), min(len(ids), len(prompt)))
    # after the last message the prompt's own entry serves (an anchor there would pin one entry per turn)
    anchors = {p for n, p in positions.items() if n < len(req.messages) and 0 < p < len(prompt) - 1}
    return BreakpointMarks(tuple(sorted(anchors)), max(positions.values(), default=0))


def history_end(tokenizer, req: GenerationRequest, prompt: list[int]) -> Optional[int]:
    """Where the conversation ends in a chat prompt, before the generation prompt (the assistant turn's opening, and
    what a thinking template puts there, e.g. ``<think>``): the position past which the next turn's prompt usually
    parts from this one (it renders this turn's reply, often without its reasoning). None for a raw completion, or a
    template whose text does not split there. A model whose caches cannot be cut back keeps a checkpoint here."""
    if req.prompt is not None or not req.messages:
        return None
    kwargs = {"add_generation_prompt": False, **template_variables(req, tokenizer)}
    if tools := req.template_tools:
        kwargs["tools"] = tools
    messages = template_messages(tokenizer, req.messages)
    end = _end_of_messages(tokenizer, messages, kwargs, prompt)
    return end if end is not None and 0 < end < len(prompt) - 1 else None


def _end_of_messages(tokenizer, messages: list[dict], kwargs: dict, prompt: list[int]) -> Optional[int]:
    """Where all of ``messages`` (the whole conversation) end in ``prompt``: before the tokens of the text the
    generation prompt adds. Found from the template's text, because tokenizing the whole conversation once more
    costs ~2 ms per 1k tokens on every request that marks its last turn (Claude Code marks every one). None when
    the text does not split that way (the caller then renders the cut in tokens)."""
    try:
        whole = tokenizer.apply_chat_template(messages, **{**kwargs, "add_generation_prompt": True}, tokenize=False)
        cut = tokenizer.apply_chat_template(messages, **kwargs, tokenize=False)
        if not (isinstance(whole, str) and isinstance(cut, str) and whole.startswith(cut)):
            return None
        tail = list(tokenizer.encode(whole[len(cut):], add_special_tokens=False)) if whole != cut else []
    except Exception:  # noqa: BLE001 - a tokenizer without text rendering: the token path decides
        return None
    if len(tail) > len(prompt) or prompt[len(prompt) - len(tail):] != tail:
        return None
    return len(prompt) - len(tail)


def chat_grammar(tokenizer, req: GenerationRequest) -> Optional[GrammarSpec]:
    """The grammar a chat request's output must follow, or None for free text (compiled here, off the lane).

    - a forced tool: exactly one call to it; ``tool_choice`` ``"required"``: one call, or several (one per line)
      unless ``parallel_tool_calls`` is false. Arguments follow each function's ``parameters``.
    - ``tool_choice`` auto with a ``strict`` tool: the answer (free text, or the answer schema's JSON) or calls;
      strict tools' arguments follow their schema, the others' are any JSON object.
    - custom tools whose input has a grammar: whenever they are offered, the input of a call to one follows that
      grammar, forced or not (with tool_choice auto the answer is free text or calls, as with strict tools).
    - otherwise an ``answer_schema`` (response_format json_object / json_schema): one JSON value.
    Calls use the Hermes ``<tool_call>{json}</tool_call>`` format (server/core/output_parse.py). Raises InvalidRequest
    for a schema or custom grammar that does not compile (naming the tool), a tool_choice naming an unknown tool, or
    a forced call on a model whose chat template uses another tool-call format.
    """
    answer = req.answer_schema
    forced, choice = req.forced_tool, req.tool_choice
    names = req.function_names + req.custom_names
    tools_param, choice_param = req.param("tools"), req.param("tool_choice")
    if forced is not None and forced not in names:
        raise InvalidRequest(f"{choice_param} names the tool '{forced}', which is not in '{tools_param}'",
                             param=choice_param)
    if choice == "required" and not names:
        raise InvalidRequest(f"{choice_param} 'required' needs at least one tool in '{tools_param}'", param=choice_param)
    custom = [CustomInput(c.name, c.syntax, c.definition) for c in req.custom_tools] if req.tools_enabled else []
    for tool in custom:
        why = check_custom_grammar(tool)
        if why:
            raise InvalidRequest(f"the {tool.syntax} grammar of custom tool '{tool.name}' does not compile: {why}",
                                 param=tools_param)
    required = forced is not None or choice == "required"
    functions = [t["function"] for t in req.tools]
    strict = req.tools_enabled and (any(f.get("strict") for f in functions) or any(c.syntax for c in custom))
    if (required or strict) and not writes_hermes(tokenizer):
        if required:
            raise InvalidRequest(
                f"this model's chat template writes tool calls as '{tokenizer.tool_call_start}...', which mlx-lane "
                f"cannot constrain yet; use {choice_param} 'auto'", param=choice_param)
        log.info("strict tools and custom tool grammars are not enforced for this model's tool-call format")
        strict = False
    if required or strict:
        if forced is not None:
            tools = [(f["name"], f.get("parameters")) for f in functions if f["name"] == forced][:1]
            custom = [c for c in custom if c.name == forced][:1] if not tools else []
        else:
            tools = [(f["name"], f.get("parameters") if (f.get("strict") or required) else {"type": "object"})
                     for f in functions]
        parallel = forced is None and req.parallel_tool_calls is not False
        grammar = _build(req, tool_call_grammar, tools, answer=None if required else (answer or "text"),
                         parallel=parallel, custom=custom)
        return GrammarSpec.compile(tokenizer, grammar, param=tools_param)
    if answer is not None:
        fmt_param = req.param("response_format")
        return GrammarSpec.compile(tokenizer, _build(req, json_schema_grammar, answer), param=fmt_param)
    return None


def _build(req: GenerationRequest, fn, *args, **kwargs) -> str:
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:  # llguidance refuses JSON it cannot serialize
        raise InvalidRequest(f"Invalid schema: {exc}", param=req.param("response_format")) from exc


def _given(requested, declared, api_default):
    """A sampling field: the request's, else the model's declared default, else the API's."""
    if requested is not None:
        return requested
    return declared if declared is not None else api_default


def tokenize_completion(tokenizer, req: GenerationRequest, vocab_size: int) -> list[int]:
    if isinstance(req.prompt, str):
        return list(tokenizer.encode(req.prompt))
    ids = list(req.prompt)
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param=req.param("prompt"))
    return ids


def sampling_params(req: GenerationRequest, prompt_len: int, context_length: int, *, default_max_tokens: int,
                    vocab_size: int, grammar: Optional[GrammarSpec] = None,
                    defaults: SamplingDefaults = NO_DEFAULTS) -> SamplingParams:
    """Validate lengths against the context and build the lane's parameters.

    ``max_tokens``: the request's; past the room the prompt leaves, a 400 or the room (``max_tokens_over_room``);
    absent, the door's default or ``default_max_tokens`` (the server's), never past the room. A request with a
    ``grammar`` does not speculate (drafts are not verified under the grammar's mask). A sampling field the request
    leaves out (``None``) takes the model's declared default (``defaults``: its generation_config.json), else the
    API's (temperature 1.0, no top-p / top-k / min-p cut, no repetition penalty)."""
    messages, max_param = req.param("messages"), req.param("max_tokens")
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty after tokenization", param=messages)
    if prompt_len >= context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"messages resulted in {prompt_len} tokens. Please reduce the length of the messages.",
            param=messages,
        )
    room = context_length - prompt_len
    requested = req.max_tokens
    if requested is not None and requested > room:
        if req.max_tokens_over_room is MaxTokens.FIT:
            requested = room
        else:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context_length} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
                f"completion). Please reduce the length of the messages or completion.",
                param=max_param,
            )
    if requested is None:
        default = req.default_max_tokens if req.default_max_tokens is not None else default_max_tokens
        requested = room if default == ROOM else min(room, default)

    logit_bias = None
    if req.logit_bias:
        logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        too_big = [t for t in logit_bias if t >= vocab_size]
        if too_big:
            raise InvalidRequest(f"logit_bias token id {too_big[0]} is outside the vocabulary",
                                 param=req.param("logit_bias"))

    temperature = _given(req.temperature, defaults.temperature, 1.0)
    top_p = _given(req.top_p, defaults.top_p, 1.0)
    if top_p == 0.0:  # nucleus of zero mass: only the most likely token, i.e. greedy
        temperature, top_p = 0.0, 1.0
    top_k = _given(req.top_k, defaults.top_k, 0)
    repetition_penalty = _given(req.repetition_penalty, defaults.repetition_penalty, None)
    return SamplingParams(
        max_tokens=requested,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k and top_k < vocab_size else 0,  # K >= the vocabulary keeps every token
        min_p=_given(req.min_p, defaults.min_p, 0.0),
        seed=req.seed,
        stop=tuple(req.stop),
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        repetition_penalty=repetition_penalty if repetition_penalty not in (None, 1.0) else None,
        logit_bias=logit_bias,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        num_draft_tokens=0 if grammar is not None else req.num_draft_tokens,
        grammar=grammar,
        raw_text=req.prompt is not None,
    )
