"""Anthropic Messages API -> the internal chat request: pure functions, no I/O, no model.

``messages_to_chat(req)`` maps ``system`` (string or text blocks) to the first system message; a user
turn's ``tool_result`` blocks to ``tool`` messages (before the turn's text, the order Anthropic requires);
an assistant turn's ``tool_use`` blocks to ``tool_calls`` (input as JSON text); ``thinking`` blocks are
dropped (chat templates drop past thinking). Text blocks of one turn join with a newline. The same
conversation therefore renders the same tokens every turn, so the prefix cache hits across turns.
A system turn mid-conversation joins the user message before it (see ``_append``). ``metadata.user_id``
becomes the cache session; ``stop_sequences`` the stop strings.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from server.errors import InvalidRequest
from server.http_util import validation_message
from server.schemas import ChatCompletionRequest
from server.schemas_messages import (
    CountTokensRequest, MessageParam, MessagesRequest, TextBlock, ToolResultBlock, ToolUseBlock,
)

__all__ = ["messages_to_chat", "turn_to_messages", "system_text", "tool_choice_of"]

_PARAM_NAMES = {"stop": "stop_sequences", "messages": "messages", "tool_choice": "tool_choice"}


def system_text(system) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def turn_to_messages(turn: MessageParam) -> list[dict]:
    """One Anthropic turn -> chat messages (dicts in the chat completions request shape)."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    texts = [b.text for b in turn.content if isinstance(b, TextBlock)]
    if turn.role == "system":
        if len(texts) != len(turn.content):
            raise InvalidRequest("a system turn holds text blocks only", param="messages")
        return [{"role": "system", "content": "\n".join(texts)}]
    if turn.role == "assistant":
        calls = [
            {"id": b.id, "type": "function",
             "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in turn.content if isinstance(b, ToolUseBlock)
        ]
        message: dict = {"role": "assistant", "content": "\n".join(texts) if (texts or not calls) else None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
           for b in turn.content if isinstance(b, ToolResultBlock)]
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    if any(isinstance(b, ToolUseBlock) for b in turn.content):
        raise InvalidRequest("tool_use blocks belong to assistant turns; a user turn answers them with "
                             "tool_result blocks", param="messages")
    return out


def _append(messages: list[dict], message: dict) -> None:
    """Append one chat message; a system turn mid-conversation joins the user message before it (or the
    system prompt when it comes first). Many chat templates refuse a system message anywhere but first, or
    two user messages in a row (Gemma, Qwen3); joining keeps the rendering valid and, because it only ever
    changes the message before it, the same every turn (the prefix cache still hits). A system turn after
    an assistant turn stays a system message."""
    last = messages[-1] if messages else None
    if message["role"] == "system" and messages and last["role"] in ("user", "system") and not last.get("tool_call_id"):
        last["content"] = (last["content"] or "") + "\n\n" + message["content"]
    else:
        messages.append(message)


def tool_choice_of(req: CountTokensRequest):
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def messages_to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The internal request for ``req`` (a ``MessagesRequest``, or the prompt side of one for counting)."""
    messages: list[dict] = []
    system = system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for turn in req.messages:
        for message in turn_to_messages(turn):
            _append(messages, message)
    body: dict = {"messages": messages, "tool_choice": tool_choice_of(req)}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                ("parameters", t.input_schema)) if v is not None}}
            for t in req.tools
        ]
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stop=req.stop_sequences,
                    user=req.metadata.user_id if req.metadata else None)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        name = _PARAM_NAMES.get((param or "").split(".")[0])
        if name and name != param:
            message, param = message.replace(f"'{param}'", f"'{name}'"), name
        raise InvalidRequest(message, param=param) from None
