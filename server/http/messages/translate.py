"""Anthropic Messages API -> the internal request (server.core.request): pure functions, no I/O, no model.

``messages_request(req)`` maps ``system`` (string or text blocks) to the first system message; a user
turn's ``tool_result`` blocks to ``tool`` messages (before the turn's text, the order Anthropic requires);
an assistant turn's ``tool_use`` blocks to ``tool_calls`` (input as JSON text); its ``thinking`` blocks' text is the
turn's reasoning, rendered back as the model produced it (server.core.prompts; the other doors carry it the same
way, so a conversation renders the same whichever API carries it), ``redacted_thinking`` blocks are dropped (they hold
no text). Text blocks of one turn join with a newline. The same
conversation therefore renders the same tokens every turn, so the prefix cache hits across turns.
A system turn mid-conversation stays where it is: it joins the user message before it, or stays a system message
after a tool or assistant turn (see ``_append``); it is never hoisted into the system prompt, which would move it in
every later request (Claude Code sends one after every tool result). ``metadata.user_id`` names the cache session
(``messages_session``); ``stop_sequences`` are the stop strings; a ``max_tokens`` past the room the prompt leaves
is lowered to that room (Anthropic clients size it for Claude). Errors name the Messages parameters
(``MESSAGES_NAMES``).

``thinking`` and ``output_config.effort`` become the chat template's reasoning variables (``reasoning_wish``):
``thinking.type`` "enabled" turns the template's thinking on (``enable_thinking``, or the name the template uses),
"disabled" off, "adaptive" leaves the template's default; ``output_config.effort`` becomes ``reasoning_effort``
("low" / "medium" / "high"; "xhigh" and "max" are "high"), read by templates that have such a variable (gpt-oss).
``budget_tokens`` is accepted and not enforced: thinking and answer share ``max_tokens``, as at Anthropic.

Tool search (Anthropic's ``defer_loading``; Claude Code's ToolSearch tool): a tool marked ``defer_loading`` is left
out of the chat template's tool list but stays callable (``GenerationRequest.deferred_tools``), and a
``tool_reference`` block in a tool result is rendered in place as the named tool's definition, in the encoding
ToolSearch's own description promises: ``<functions>`` holding one ``<function>{"description", "name",
"parameters"}</function>`` line per tool (``reference_text``). Claude Code adds a tool it loaded to ``tools`` from the
next request on; the prompt's opening (system prompt and tool list) stays the same, so the prefix cache keeps
serving the session, and the loaded tool costs only its definition's tokens where the search returned it.

The cache session (``messages_session``): a session header, else ``metadata.user_id`` (Claude Code's JSON string
holding ``session_id``), else Claude Code's ``X-Claude-Code-Session-Id``; a Claude Code subagent, which sends its
main agent's session id, is told apart by ``X-Claude-Code-Agent-Id`` and keyed ``<session>/<agent id>``, so its
requests do not take over the main agent's session entry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import groupby
from typing import Optional

from server.core.request import GenerationRequest, MaxTokens, function_tool, template_message, template_wishes
from server.errors import InvalidRequest
from server.core.media import parts_content
from server.http.messages.schemas import (
    AnthropicTool, CountTokensRequest, ImageBlock, MessageParam, MessagesRequest, TextBlock, ThinkingBlock,
    ToolReferenceBlock, ToolResultBlock, ToolUseBlock,
)
from server.http.wire import session_of

__all__ = ["messages_request", "turn_to_messages", "system_text", "system_blocks", "session_of_user_id",
           "messages_session", "tool_result_text", "reference_text", "reasoning_wish", "MESSAGES_NAMES",
           "BILLING_HEADER", "THINKING_SWITCH", "CLAUDE_CODE_SESSION_HEADER",
           "CLAUDE_CODE_AGENT_HEADER"]

# the internal request's fields under their Messages names (server.core.request.GenerationRequest.param)
MESSAGES_NAMES = {"stop": "stop_sequences"}


BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block (see system_blocks)
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"  # the session_id of metadata.user_id, as a header
CLAUDE_CODE_AGENT_HEADER = "x-claude-code-agent-id"  # set by a subagent (the Agent tool), beside its main's session

# thinking.type -> the template's reasoning switch (None: not passed, the template's default holds)
THINKING_SWITCH = {"enabled": True, "disabled": False, "adaptive": None}


def reasoning_wish(req: CountTokensRequest) -> tuple[Optional[bool], Optional[str]]:
    """(enable_thinking, the effort asked) of the internal request: see the module docstring."""
    switch = THINKING_SWITCH[req.thinking.type] if req.thinking is not None else None
    effort = req.output_config.effort if req.output_config is not None else None
    return switch, effort


def system_blocks(system, *, keep_billing_header: bool = False) -> list:
    """The system prompt's text blocks. Claude Code's first block is ``x-anthropic-billing-header:
    cc_version=2.1.197.<3 hex>; ...``, whose suffix changes with the prompt: every new session would differ from
    every other at token ~10 and recompute the whole system prompt and tool list. It carries nothing a model uses,
    so it is dropped (``keep_billing_header`` keeps it: ``--keep-billing-header``)."""
    if system is None:
        return []
    blocks = [TextBlock(type="text", text=system)] if isinstance(system, str) else list(system)
    if not keep_billing_header:
        blocks = [b for b in blocks if not b.text.lstrip().startswith(BILLING_HEADER)]
    return blocks


def system_text(system, *, keep_billing_header: bool = False) -> str:
    return "\n".join(b.text for b in system_blocks(system, keep_billing_header=keep_billing_header))


def _marked(block) -> bool:
    """Does a block carry a ``cache_control`` breakpoint?"""
    extra = getattr(block, "model_extra", None) or {}
    return isinstance(extra.get("cache_control"), dict)


def session_of_user_id(user_id: Optional[str]) -> Optional[str]:
    """The cache session ``metadata.user_id`` names: Claude Code sends a JSON string holding ``session_id``; any
    other value is the session as it is."""
    if not user_id:
        return None
    if user_id.lstrip().startswith("{"):
        try:
            value = json.loads(user_id)
        except json.JSONDecodeError:
            return user_id
        if isinstance(value, dict) and isinstance(value.get("session_id"), str) and value["session_id"]:
            return value["session_id"]
    return user_id


def messages_session(headers: Mapping[str, str], user_id: Optional[str]) -> Optional[str]:
    """The prefix cache's session of a Messages request (``headers`` read with lower-case names, as Starlette's
    are): a session header (server.http.wire.session_header), else ``metadata.user_id`` (``session_of_user_id``),
    else ``X-Claude-Code-Session-Id``. Claude Code's subagents send their main agent's session id; the
    ``X-Claude-Code-Agent-Id`` header tells them apart, and keys the session ``<session>/<agent id>``: a session
    maps to the one entry last put with it, so a subagent's request under the main agent's key would take that
    entry's O(1) lookup and its session-bound eviction protection away from the main agent."""
    session = session_of(headers, session_of_user_id(user_id), headers.get(CLAUDE_CODE_SESSION_HEADER))
    agent = headers.get(CLAUDE_CODE_AGENT_HEADER)
    return f"{session}/{agent}" if session and agent else session


def reference_text(names: list[str], tools: Mapping[str, AnthropicTool]) -> str:
    """The definitions of the tools a tool search found, as Claude Code's ToolSearch describes its result: a
    ``<functions>`` block with one ``<function>{"description": ..., "name": ..., "parameters": ...}</function>``
    line per tool, the input schema as the request's tool list holds it. A name ``tools`` lacks is shown as just
    its name. The same request tools render the same text every turn (the prefix cache hits past it)."""
    lines = []
    for name in names:
        tool = tools.get(name)
        fields = {"name": name} if tool is None else {
            **({"description": tool.description} if tool.description is not None else {}),
            "name": tool.name, "parameters": tool.input_schema}
        lines.append(f"<function>{json.dumps(fields, ensure_ascii=False)}</function>")
    return "<functions>\n" + "\n".join(lines) + "\n</functions>"


def tool_result_text(block: ToolResultBlock, tools: Mapping[str, AnthropicTool], param: str = "messages"):
    """A tool result's content as the tool message's text: text blocks join with a newline (one text block reads
    like a string); each run of ``tool_reference`` blocks is the referenced tools' definitions, in place
    (``reference_text``); with ``image`` blocks (a screenshot a tool took), text and image parts
    (server.core.media.parts_content). ``param``: where the block is (errors name it)."""
    if isinstance(block.content, str):
        return block.content
    parts: list = []
    for references, run in groupby(enumerate(block.content), key=lambda b: isinstance(b[1], ToolReferenceBlock)):
        if references:
            parts.append(reference_text([b.tool_name for _, b in run], tools))
        else:
            parts.extend(b.ref(f"{param}.content.{j}") if isinstance(b, ImageBlock) else b.text for j, b in run)
    return parts_content(parts, sep="\n")[0]


def turn_to_messages(turn: MessageParam, tools: Optional[Mapping[str, AnthropicTool]] = None,
                     param: str = "messages") -> list[dict]:
    """One Anthropic turn -> chat messages as chat templates read them (server.core.request.template_message);
    ``tools``: the request's tools by name (what a tool result's ``tool_reference`` blocks show); ``param``: where
    the turn is (``messages.N``: errors about its images name it)."""
    if isinstance(turn.content, str):
        return [template_message(turn.role, turn.content)]
    texts = [b.text for b in turn.content if isinstance(b, TextBlock)]
    if turn.role != "system" and any(isinstance(b, ImageBlock) for b in turn.content):
        # text and images in order (text blocks join with a newline, as without images)
        texts = parts_content([b.ref(f"{param}.content.{j}") if isinstance(b, ImageBlock) else b.text
                               for j, b in enumerate(turn.content) if isinstance(b, (TextBlock, ImageBlock))],
                              sep="\n")[0]
        texts = [texts] if isinstance(texts, str) else texts
    if turn.role == "system":
        if len(texts) != len(turn.content):
            raise InvalidRequest("a system turn holds text blocks only", param="messages")
        return [template_message("system", "\n".join(texts))]
    if turn.role == "assistant":
        calls = [(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                 for b in turn.content if isinstance(b, ToolUseBlock)]
        thinking = "\n".join(b.thinking for b in turn.content if isinstance(b, ThinkingBlock)) or None
        return [template_message("assistant", _joined(texts) if (texts or not calls) else None, tool_calls=calls,
                                 reasoning=thinking)]
    out = [template_message("tool", tool_result_text(b, tools or {}, f"{param}.content.{j}"),
                            tool_call_id=b.tool_use_id)
           for j, b in enumerate(turn.content) if isinstance(b, ToolResultBlock)]
    if texts or not out:
        out.append(template_message("user", _joined(texts)))
    if any(isinstance(b, ToolUseBlock) for b in turn.content):
        raise InvalidRequest("tool_use blocks belong to assistant turns; a user turn answers them with "
                             "tool_result blocks", param="messages")
    return out


def _joined(texts: list):
    """A turn's text blocks joined with a newline, or its text and image parts as they are."""
    return texts if texts and isinstance(texts[0], dict) else "\n".join(texts)


def _append(messages: list[dict], message: dict) -> None:
    """Append one chat message; a system turn mid-conversation joins the user message before it (or the
    system prompt when it comes first). Many chat templates refuse a system message anywhere but first, or
    two user messages in a row (Gemma, Qwen3); joining keeps the rendering valid and, because it only ever
    changes the message before it, the same every turn (the prefix cache still hits). A system turn after
    an assistant turn stays a system message."""
    last = messages[-1] if messages else None
    if message["role"] == "system" and messages and last["role"] in ("user", "system") and not last.get("tool_call_id"):
        if isinstance(last["content"], list):  # text and image parts: the system text joins as a text part
            last["content"] = last["content"] + [{"type": "text", "text": "\n\n" + message["content"]}]
        else:
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


def messages_request(req: CountTokensRequest, *, session: Optional[str] = None,
                     keep_billing_header: bool = False) -> GenerationRequest:
    """The internal request for ``req`` (a ``MessagesRequest``, or the prompt side of one for counting);
    ``session``: the prefix cache's session (the door's ``messages_session``). Each ``cache_control``
    breakpoint becomes a breakpoint of the internal request at the message boundary at or before it: on the system
    prompt or a tool, after the system prompt; on a turn's last block, after that turn; on an earlier block, before
    that turn (the rest of a turn changes with it)."""
    messages: list[dict] = []
    breakpoints: set[int] = set()
    blocks = system_blocks(req.system, keep_billing_header=keep_billing_header)
    if blocks:
        messages.append(template_message("system", "\n".join(b.text for b in blocks)))
    if messages and (any(_marked(b) for b in blocks) or any(_marked(t) for t in req.tools or ())):
        breakpoints.add(1)
    tools = list(req.tools or ())
    by_name = {t.name: t for t in tools}
    for index, turn in enumerate(req.messages):
        before = len(messages)
        for message in turn_to_messages(turn, by_name, f"messages.{index}"):
            _append(messages, message)
        if isinstance(turn.content, list) and any(_marked(b) for b in turn.content):
            breakpoints.add(len(messages) if _marked(turn.content[-1]) else before)
    choice, forced = _tool_choice(req)
    fields: dict = {}
    if isinstance(req, MessagesRequest):
        fields = dict(max_tokens=req.max_tokens, max_tokens_over_room=MaxTokens.FIT, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stop=tuple(req.stop_sequences or ()))
    parallel = None if req.tool_choice is None or req.tool_choice.disable_parallel_tool_use is None else (
        not req.tool_choice.disable_parallel_tool_use)
    thinking, effort = reasoning_wish(req)
    wishes = template_wishes(req.chat_template_kwargs, enable_thinking=thinking, effort=effort)
    return GenerationRequest(
        messages=tuple(messages),
        tools=tuple(function_tool(t.name, t.description, t.input_schema) for t in tools),
        deferred_tools=tuple(t.name for t in tools if t.defer_loading),
        tool_choice=choice, forced_tool=forced, parallel_tool_calls=parallel, session=session,
        breakpoints=tuple(sorted(b for b in breakpoints if b > 0)), enable_thinking=wishes.enable_thinking,
        reasoning_effort=wishes.reasoning_effort, template_kwargs=wishes.template_kwargs, names=MESSAGES_NAMES,
        **fields)
