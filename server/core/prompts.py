"""Turn an internal request (server.core.request) into token ids, a grammar and the lane's sampling parameters.

Runs off the lane (the handler's thread pool): rendering a chat template and tokenizing is CPU work that must not
queue behind decoding. Every error is an ``InvalidRequest`` (400) naming the client's own parameter
(``GenerationRequest.param``).
"""

from __future__ import annotations

import logging
from typing import Optional

from server.core.grammar import TOOL_CALL_OPEN, GrammarSpec, json_schema_grammar, tool_call_grammar
from server.core.request import GenerationRequest, MaxTokens
from server.errors import ContextLengthExceeded, InvalidRequest
from server.lane.events import SamplingParams

log = logging.getLogger("mlx_lane.prompts")


def render(tokenizer, req: GenerationRequest, vocab_size: int) -> list[int]:
    """The request's prompt as token ids: its chat messages through the model's chat template (tools included),
    or a text completion's prompt (text tokenized as is, or token ids checked against the vocabulary)."""
    if req.prompt is not None:
        return tokenize_completion(tokenizer, req, vocab_size)
    return render_chat(tokenizer, req)


def render_chat(tokenizer, req: GenerationRequest) -> list[int]:
    """Apply the model's chat template (tools included) and tokenize."""
    kwargs = {"add_generation_prompt": True}
    if req.tools_enabled:
        kwargs["tools"] = list(req.tools)
    try:
        ids = tokenizer.apply_chat_template(list(req.messages), **kwargs)
    except Exception as exc:  # jinja raises for roles/orders a template refuses
        raise InvalidRequest(f"the chat template rejected these messages: {exc}", param=req.param("messages")) from exc
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def chat_grammar(tokenizer, req: GenerationRequest) -> Optional[GrammarSpec]:
    """The grammar a chat request's output must follow, or None for free text (compiled here, off the lane).

    - a forced tool: exactly one call to it; ``tool_choice`` ``"required"``: one call, or several (one per line)
      unless ``parallel_tool_calls`` is false. Arguments follow each function's ``parameters``.
    - ``tool_choice`` auto with a ``strict`` tool: the answer (free text, or the answer schema's JSON) or calls;
      strict tools' arguments follow their schema, the others' are any JSON object.
    - otherwise an ``answer_schema`` (response_format json_object / json_schema): one JSON value.
    Calls use the Hermes ``<tool_call>{json}</tool_call>`` format (server/core/output_parse.py). Raises InvalidRequest
    for a schema that does not compile, a tool_choice naming an unknown function, or a forced call on a model
    whose chat template uses another tool-call format.
    """
    answer = req.answer_schema
    forced, choice = req.forced_tool, req.tool_choice
    names = req.function_names
    tools_param, choice_param = req.param("tools"), req.param("tool_choice")
    if forced is not None and forced not in names:
        raise InvalidRequest(f"{choice_param} names the function '{forced}', which is not in '{tools_param}'",
                             param=choice_param)
    if choice == "required" and not names:
        raise InvalidRequest(f"{choice_param} 'required' needs at least one tool in '{tools_param}'", param=choice_param)
    required = forced is not None or choice == "required"
    functions = [t["function"] for t in req.tools]
    strict = req.tools_enabled and any(f.get("strict") for f in functions)
    if (required or strict) and not _hermes(tokenizer):
        if required:
            raise InvalidRequest(
                f"this model's chat template writes tool calls as '{tokenizer.tool_call_start}...', which mlx-lane "
                f"cannot constrain yet; use {choice_param} 'auto'", param=choice_param)
        log.info("strict tools are not enforced for this model's tool-call format")
        strict = False
    if required or strict:
        if forced is not None:
            tools = [(f["name"], f.get("parameters")) for f in functions if f["name"] == forced][:1]
        else:
            tools = [(f["name"], f.get("parameters") if (f.get("strict") or required) else {"type": "object"})
                     for f in functions]
        parallel = forced is None and req.parallel_tool_calls is not False
        grammar = _build(req, tool_call_grammar, tools, answer=None if required else (answer or "text"),
                         parallel=parallel)
        return GrammarSpec.compile(tokenizer, grammar, param=tools_param)
    if answer is not None:
        fmt_param = req.param("response_format")
        return GrammarSpec.compile(tokenizer, _build(req, json_schema_grammar, answer), param=fmt_param)
    return None


def _hermes(tokenizer) -> bool:
    """True when the model's tool calls (as mlx-lm detected them from the chat template) are Hermes ones, or
    unknown (then server/core/output_parse.py parses the Hermes format)."""
    start = getattr(tokenizer, "tool_call_start", None)
    return start is None or start == TOOL_CALL_OPEN


def _build(req: GenerationRequest, fn, *args, **kwargs) -> str:
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:  # llguidance refuses JSON it cannot serialize
        raise InvalidRequest(f"Invalid schema: {exc}", param=req.param("response_format")) from exc


def tokenize_completion(tokenizer, req: GenerationRequest, vocab_size: int) -> list[int]:
    if isinstance(req.prompt, str):
        return list(tokenizer.encode(req.prompt))
    ids = list(req.prompt)
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param=req.param("prompt"))
    return ids


def sampling_params(req: GenerationRequest, prompt_len: int, context_length: int, *, default_max_tokens: int,
                    vocab_size: int, grammar: Optional[GrammarSpec] = None) -> SamplingParams:
    """Validate lengths against the context and build the lane's parameters.

    ``max_tokens``: the request's; past the room the prompt leaves, a 400 or the room (``max_tokens_over_room``);
    absent, the door's default or ``default_max_tokens`` (the server's), never past the room. A request with a
    ``grammar`` does not speculate (drafts are not verified under the grammar's mask)."""
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
        requested = min(room, default)

    logit_bias = None
    if req.logit_bias:
        logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        too_big = [t for t in logit_bias if t >= vocab_size]
        if too_big:
            raise InvalidRequest(f"logit_bias token id {too_big[0]} is outside the vocabulary",
                                 param=req.param("logit_bias"))

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
        stop=tuple(req.stop),
        presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty not in (None, 1.0) else None,
        logit_bias=logit_bias,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        num_draft_tokens=0 if grammar is not None else req.num_draft_tokens,
        grammar=grammar,
        adapter=req.adapter,
    )
