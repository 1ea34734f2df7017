"""Turn validated requests into token ids and sampling parameters (runs off the lane)."""

from __future__ import annotations

import json
from typing import Optional

from server.errors import ContextLengthExceeded, InvalidRequest
from server.jobs import SamplingParams
from server.schemas import ChatCompletionRequest, CompletionRequest, Message

# OpenAI's legacy /v1/completions default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


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
) -> SamplingParams:
    """Validate lengths against the context and build the lane's parameters."""
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
        num_draft_tokens=req.num_draft_tokens,
    )


def session_of(header_value: Optional[str], req) -> Optional[str]:
    """The cache session: ``X-Session-Id`` header, else ``prompt_cache_key``, else ``user``."""
    return header_value or req.prompt_cache_key or req.user or None
