"""Turn validated requests into token ids and sampling parameters (runs off the lane)."""

from __future__ import annotations

import json
import logging
from typing import Optional

from server.errors import ContextLengthExceeded, InvalidRequest
from server.grammar import TOOL_CALL_OPEN, GrammarSpec, json_schema_grammar, tool_call_grammar
from server.jobs import SamplingParams
from server.schemas import ChatCompletionRequest, CompletionRequest, Message

# OpenAI's legacy /v1/completions default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

log = logging.getLogger("mlx_lane.prompts")


def _message_dict(m: Message) -> dict:
    role = "system" if m.role == "developer" else m.role
    d: dict = {"role": role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": _maybe_json(tc.function.arguments)},
            }
            for tc in m.tool_calls
        ]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    return d


def _maybe_json(s: str):
    try:
        return json.loads(s)
    except (json.JSONDecodeError, TypeError):
        return s


def render_chat(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """Apply the model's chat template (tools included) and tokenize."""
    messages = [_message_dict(m) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools_enabled() else None
    kwargs = {"add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    try:
        ids = tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as exc:  # jinja raises for roles/orders a template refuses
        raise InvalidRequest(f"the chat template rejected these messages: {exc}", param="messages") from exc
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def chat_grammar(tokenizer, req: ChatCompletionRequest) -> Optional[GrammarSpec]:
    """The grammar a chat request's output must follow, or None for free text (compiled here, off the lane).

    - ``tool_choice`` names a function: exactly one call to it; ``"required"``: one call, or several (one per
      line) unless ``parallel_tool_calls`` is false. Arguments follow each function's ``parameters``.
    - ``tool_choice`` auto (or omitted) with a ``strict`` tool: the answer (free text, or the response_format's
      JSON) or calls; strict tools' arguments follow their schema, the others' are any JSON object.
    - otherwise ``response_format`` json_object / json_schema: one JSON value.
    Calls use the Hermes ``<tool_call>{json}</tool_call>`` format (server/tool_calls.py). Raises InvalidRequest
    for a schema that does not compile, a tool_choice naming an unknown function, or a forced call on a model
    whose chat template uses another tool-call format.
    """
    answer = req.response_format.target_schema() if req.response_format is not None else None
    forced, choice = req.forced_tool(), req.tool_choice
    names = [t.function.name for t in req.tools or ()]
    if forced is not None and forced not in names:
        raise InvalidRequest(f"tool_choice names the function '{forced}', which is not in 'tools'",
                             param="tool_choice")
    if choice == "required" and not names:
        raise InvalidRequest("tool_choice 'required' needs at least one tool in 'tools'", param="tool_choice")
    required = forced is not None or choice == "required"
    strict = req.tools_enabled() and any(t.function.strict for t in req.tools)
    if (required or strict) and not _hermes(tokenizer):
        if required:
            raise InvalidRequest(
                f"this model's chat template writes tool calls as '{tokenizer.tool_call_start}...', which mlx-lane "
                "cannot constrain yet; use tool_choice 'auto'", param="tool_choice")
        log.info("strict tools are not enforced for this model's tool-call format")
        strict = False
    if required or strict:
        if forced is not None:
            tools = [(t.function.name, t.function.parameters) for t in req.tools if t.function.name == forced][:1]
        else:
            tools = [(t.function.name, t.function.parameters if (t.function.strict or required) else {"type": "object"})
                     for t in req.tools]
        parallel = forced is None and req.parallel_tool_calls is not False
        grammar = _build(tool_call_grammar, tools, answer=None if required else (answer or "text"), parallel=parallel)
        return GrammarSpec.compile(tokenizer, grammar, param="tools")
    if answer is not None:
        return GrammarSpec.compile(tokenizer, _build(json_schema_grammar, answer), param="response_format")
    return None


def _hermes(tokenizer) -> bool:
    """True when the model's tool calls (as mlx-lm detected them from the chat template) are Hermes ones, or
    unknown (then server/tool_calls.py parses the Hermes format)."""
    start = getattr(tokenizer, "tool_call_start", None)
    return start is None or start == TOOL_CALL_OPEN


def _build(fn, *args, **kwargs) -> str:
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:  # llguidance refuses JSON it cannot serialize
        raise InvalidRequest(f"Invalid schema: {exc}", param="response_format") from exc


def tokenize_completion(tokenizer, req: CompletionRequest, vocab_size: int) -> list[int]:
    if isinstance(req.prompt, str):
        return list(tokenizer.encode(req.prompt))
    ids = list(req.prompt)
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
    return ids


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    context_length: int,
    *,
    default_max_tokens: int,
    vocab_size: int,
    grammar: Optional[GrammarSpec] = None,
) -> SamplingParams:
    """Validate lengths against the context and build the lane's parameters.

    A request with a ``grammar`` does not speculate (drafts are not verified under the grammar's mask)."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty after tokenization", param="messages")
    if prompt_len >= context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"messages resulted in {prompt_len} tokens. Please reduce the length of the messages.",
            param="messages",
        )
    requested = req.requested_max_tokens()
    room = context_length - prompt_len
    if requested is not None and requested > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    if requested is None:
        requested = min(room, default_max_tokens)

    logit_bias = None
    if req.logit_bias:
        logit_bias = {int(k): v for k, v in req.logit_bias.items()}
        too_big = [t for t in logit_bias if t >= vocab_size]
        if too_big:
            raise InvalidRequest(f"logit_bias token id {too_big[0]} is outside the vocabulary", param="logit_bias")

    if isinstance(req, ChatCompletionRequest):
        want_logprobs, top = req.logprobs, (req.top_logprobs or 0)
    else:
        want_logprobs, top = req.logprobs is not None, (req.logprobs or 0)

    temperature = 1.0 if req.temperature is None else req.temperature
    if req.top_p == 0.0:  # nucleus of zero mass: only the most likely token, i.e. greedy
        temperature = 0.0
    return SamplingParams(
        max_tokens=requested,
        temperature=temperature,
        top_p=1.0 if not req.top_p else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=tuple(req.stop or ()),
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty not in (None, 1.0) else None,
        logit_bias=logit_bias,
        logprobs=want_logprobs,
        top_logprobs=top,
        num_draft_tokens=0 if grammar is not None else req.num_draft_tokens,
        grammar=grammar,
    )


def session_header(headers) -> Optional[str]:
    """The session a request's headers name: ``X-Session-Id``, else ``session_id`` (what Codex CLI sends; the
    replicas' proxy routes on both, deploy/haproxy.cfg.in)."""
    return headers.get("x-session-id") or headers.get("session_id") or None


def session_of(header_value: Optional[str], req) -> Optional[str]:
    """The cache session: ``X-Session-Id`` header, else ``prompt_cache_key``, else ``user``."""
    return header_value or req.prompt_cache_key or req.user or None
