"""Anthropic Messages API -> the internal request (server.core.request): pure functions, no I/O, no model.

``messages_request(req)`` maps ``system`` (string or text blocks) to the first system message; a user
turn's ``tool_result`` blocks to ``tool`` messages (before the turn's text, the order Anthropic requires);
an assistant turn's ``tool_use`` blocks to ``tool_calls`` (input as JSON text); ``thinking`` blocks are
dropped (chat templates drop past thinking). Text blocks of one turn join with a newline. The same
conversation therefore renders the same tokens every turn, so the prefix cache hits across turns.
A system turn mid-conversation joins the user message before it (see ``_append``). ``metadata.user_id``
becomes the cache session; ``stop_sequences`` the stop strings; a ``max_tokens`` past the room the prompt leaves
is lowered to that room (Anthropic clients size it for Claude). Errors name the Messages parameters
(``MESSAGES_NAMES``).
"""

from __future__ import annotations

import json
from typing import Optional

from server.core.request import GenerationRequest, MaxTokens, function_tool, template_message
from server.errors import InvalidRequest
from server.http.messages.schemas import (
    CountTokensRequest, MessageParam, MessagesRequest, TextBlock, ToolResultBlock, ToolUseBlock,
)

__all__ = ["messages_request", "turn_to_messages", "system_text", "MESSAGES_NAMES"]

# the internal request's fields under their Messages names (server.core.request.GenerationRequest.param)
MESSAGES_NAMES = {"stop": "stop_sequences"}


def system_text(system) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def turn_to_messages(turn: MessageParam) -> list[dict]:
    """One Anthropic turn -> chat messages as chat templates read them (server.core.request.template_message)."""
    if isinstance(turn.content, str):
        return [template_message(turn.role, turn.content)]
    texts = [b.text for b in turn.content if isinstance(b, TextBlock)]
    if turn.role == "system":
        if len(texts) != len(turn.content):
            raise InvalidRequest("a system turn holds text blocks only", param="messages")
        return [template_message("system", "\n".join(texts))]
    if turn.role == "assistant":
        calls = [(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                 for b in turn.content if isinstance(b, ToolUseBlock)]
        return [template_message("assistant", "\n".join(texts) if (texts or not calls) else None, tool_calls=calls)]
    out = [template_message("tool", b.text(), tool_call_id=b.tool_use_id)
           for b in turn.content if isinstance(b, ToolResultBlock)]
    if texts or not out:
        out.append(template_message("user", "\n".join(texts)))
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


def _tool_choice(req: CountTokensRequest) -> tuple[str, Optional[str]]:
    """(tool_choice, forced tool) of the internal request."""
    choice = req.tool_choice
    if choice is None:
        return "auto", None
    if choice.type == "tool":
        return "auto", choice.name
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], None


def messages_request(req: CountTokensRequest, *, session: Optional[str] = None, adapter=None) -> GenerationRequest:
    """The internal request for ``req`` (a ``MessagesRequest``, or the prompt side of one for counting);
    ``session``: the prefix cache's session (the door's header, else ``metadata.user_id``)."""
    messages: list[dict] = []
    system = system_text(req.system)
    if system:
        messages.append(template_message("system", system))
    for turn in req.messages:
        for message in turn_to_messages(turn):
            _append(messages, message)
    choice, forced = _tool_choice(req)
    fields: dict = {}
    if isinstance(req, MessagesRequest):
        fields = dict(max_tokens=req.max_tokens, max_tokens_over_room=MaxTokens.FIT, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stop=tuple(req.stop_sequences or ()))
    parallel = None if req.tool_choice is None or req.tool_choice.disable_parallel_tool_use is None else (
        not req.tool_choice.disable_parallel_tool_use)
    return GenerationRequest(
        messages=tuple(messages),
        tools=tuple(function_tool(t.name, t.description, t.input_schema) for t in req.tools or ()),
        tool_choice=choice, forced_tool=forced, parallel_tool_calls=parallel, session=session, adapter=adapter,
        names=MESSAGES_NAMES, **fields)
