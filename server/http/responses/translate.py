"""Responses API <-> the internal request: pure functions, no I/O, no model.

``responses_request(req, history)`` builds the one internal request (server.core.request) of a Responses body that
continues ``history`` (the input items of a stored conversation, ``previous_response_id``): ``instructions`` become
the first system message, input items chat messages (``items_to_messages``: a message item its text, a
``function_call`` an assistant tool call (calls of one turn join the assistant message before them), a
``function_call_output`` a tool message, a ``reasoning`` item's text the thinking of the assistant turn after it,
rendered back as the model produced it: server.core.prompts), a ``compaction`` item the summary it holds (an assistant
message: server.http.responses.capsule), ``text.format`` the answer schema, function tools (and the members of ``namespace``
groups) the offered functions. The same conversation sent whole or continued from a stored response renders the
same tokens, so the prefix cache hits either way. ``output_to_items`` goes back: what the model produced as output
items.

Errors name the Responses parameters: ``input``, ``max_output_tokens``, ``text.format`` (``RESPONSES_NAMES``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

from server.core.request import (
    REASONING_KEY, ROOM, CustomTool, GenerationRequest, custom_call, function_tool, system_breakpoint, template_message,
    template_wishes,
)
from server.errors import InvalidRequest
from server.http.responses.capsule import expand, summary_message_text
from server.http.responses.schemas import TOOLS
from server.http.responses.schemas import CustomTool as CustomToolSpec
from server.http.responses.schemas import (
    INPUT_ITEMS, CompactionItem, CustomToolCallItem, CustomToolCallOutputItem, FunctionCallItem,
    FunctionCallOutputItem, FunctionTool,
    MessageItem, NamespaceTool, ReasoningItem, ResponsesRequest, ToolSearchCallItem, ToolSearchOutputItem,
    ToolSearchTool,
)

__all__ = ["input_items", "items_to_messages", "answer_schema_of", "responses_request", "output_to_items",
           "call_item", "function_tools", "custom_tools", "offered_tools", "tool_index", "tool_namespaces", "ToolIndex",
           "RESPONSES_NAMES", "SEARCH_NAME"]

# the internal request's fields under their Responses names (server.core.request.GenerationRequest.param)
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
SEARCH_NAME = "tool_search"  # a client-executed tool search, offered to the model as a function of this name


def input_items(req: ResponsesRequest) -> list:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def items_to_messages(items) -> list[dict]:
    """Responses input items -> chat messages as chat templates read them (server.core.request.template_message).

    Calls (``function_call``, ``custom_tool_call``, ``tool_search_call``) join the assistant message before them
    (one turn's text and calls: one message); their outputs are tool messages. A tool search's output is shown as
    the tools it found (name and description; the tools themselves are offered from then on: ``offered_tools``)."""
    out: list[dict] = []
    thinking: list[str] = []  # a reasoning item's text, for the assistant turn that follows it

    def reasoning() -> Optional[str]:
        text = "".join(thinking)
        thinking.clear()
        return text or None

    def call(entry) -> None:
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and not (thinking and REASONING_KEY in last):
            msg = template_message("assistant", "", tool_calls=[entry])
            last.setdefault("tool_calls", []).extend(msg["tool_calls"])
            if thinking:
                last[REASONING_KEY] = reasoning()
        else:
            out.append(template_message("assistant", "", tool_calls=[entry], reasoning=reasoning()))

    def thought_only() -> None:  # a turn of thinking alone (no text, no call): an assistant message of its own
        if thinking:
            out.append(template_message("assistant", "", reasoning=reasoning()))

    for i, item in enumerate(items):
        if not isinstance(item, (ReasoningItem, FunctionCallItem, CustomToolCallItem, ToolSearchCallItem)) and not (
                isinstance(item, MessageItem) and item.role == "assistant"):
            thought_only()
        if isinstance(item, MessageItem):
            out.append(template_message(item.role, item.template_content(f"input.{i}"),
                                        reasoning=reasoning() if item.role == "assistant" else None))
        elif isinstance(item, FunctionCallItem):
            call((item.call_id, item.name, item.arguments))
        elif isinstance(item, CustomToolCallItem):
            call(custom_call(item.call_id, item.name, item.input))
        elif isinstance(item, ToolSearchCallItem):
            call((item.call_id or "tool_search", SEARCH_NAME, json.dumps(item.arguments or {}, ensure_ascii=False)))
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            out.append(template_message("tool", item.text(), tool_call_id=item.call_id))
        elif isinstance(item, ToolSearchOutputItem):
            found = [{"name": t.get("name"), "description": t.get("description")} for t in item.tools]
            out.append(template_message("tool", json.dumps(found, ensure_ascii=False),
                                        tool_call_id=item.call_id or "tool_search"))
        elif isinstance(item, CompactionItem):  # the turns it replaced, as their summary
            out.append(template_message("assistant", summary_message_text(
                expand(item.encrypted_content, f"input.{i}.encrypted_content"))))
        elif isinstance(item, ReasoningItem):
            if item.reasoning_text():  # the model's own thinking goes back with its turn (a summary alone: no)
                thinking.append(item.reasoning_text())
        else:  # the schema admits no other item; a new one must be rendered on purpose, not dropped
            raise InvalidRequest(f"input item type '{getattr(item, 'type', '?')}' is not supported", param="input")
    thought_only()
    return out


def answer_schema_of(req: ResponsesRequest) -> Optional[dict]:
    """The JSON schema ``text.format`` asks the answer to follow (``None`` for plain text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    return fmt.schema_ or {}


def offered_tools(req: ResponsesRequest, items=()) -> list:
    """The tools the model is offered: the request's, then those a client-side tool search loaded in the
    conversation (``tool_search_output`` items), once each by name (the request's own win)."""
    tools = list(req.tools or ())
    names = {getattr(t, "name", None) for t in tools}
    for item in items:
        if isinstance(item, ToolSearchOutputItem):
            for tool in TOOLS.validate_python([t for t in item.tools if _offered_kind(t)]):
                if getattr(tool, "name", None) not in names:
                    tools.append(tool)
                    names.add(getattr(tool, "name", None))
    return tools


def _offered_kind(tool) -> bool:
    return isinstance(tool, dict) and tool.get("type") in ("function", "namespace", "custom")


def function_tools(req: ResponsesRequest, items=()) -> list[FunctionTool]:
    """Every function the model is offered: function tools, the members of namespace groups, and a client-side
    tool search (a function named ``tool_search``)."""
    out: list = []
    for tool in offered_tools(req, items):
        if isinstance(tool, NamespaceTool):
            out.extend(tool.tools)
        elif isinstance(tool, ToolSearchTool):
            out.append(FunctionTool(type="function", name=SEARCH_NAME, description=tool.description,
                                    parameters=tool.parameters))
        elif isinstance(tool, FunctionTool):
            out.append(tool)
    return out


def custom_tools(req: ResponsesRequest, items=()) -> list[CustomTool]:
    """The custom (freeform) tools offered, as the internal request's ``CustomTool``."""
    out = []
    for tool in offered_tools(req, items):
        if isinstance(tool, CustomToolSpec):
            fmt = tool.format
            grammar = fmt if fmt is not None and fmt.type == "grammar" else None
            out.append(CustomTool(tool.name, tool.description, grammar.syntax if grammar else None,
                                  grammar.definition if grammar else None))
    return out


@dataclass(frozen=True)
class ToolIndex:
    """What the formatter needs to know of the offered tools to write the model's calls as output items."""

    namespaces: dict = field(default_factory=dict)  # function name -> its namespace group
    searches: frozenset = frozenset()  # function names that are a client-side tool search


def tool_index(req: ResponsesRequest, items=()) -> ToolIndex:
    tools = offered_tools(req, items)
    namespaces = {f.name: t.name for t in tools if isinstance(t, NamespaceTool) for f in t.tools}
    searches = frozenset(SEARCH_NAME for t in tools if isinstance(t, ToolSearchTool))
    return ToolIndex(namespaces, searches)


def tool_namespaces(req: ResponsesRequest, items=()) -> dict[str, str]:
    """Function name -> its namespace, for the ``namespace`` field of the calls the model makes."""
    return tool_index(req, items).namespaces


def responses_request(req: ResponsesRequest, history=(), *, session: Optional[str] = None,
                      max_tokens_cap: Optional[int] = None) -> GenerationRequest:
    """The internal request for ``req`` continuing ``history`` (items of the previous responses). Without
    ``max_output_tokens`` the reply may use all the room the prompt leaves in the context (OpenAI's rule: Codex CLI
    sends none, and a reply cut at a default is an "incomplete response" to it), or ``max_tokens_cap`` (an
    operator's explicit --default-max-tokens)."""
    items = [*history, *input_items(req)]
    messages: list[dict] = []
    if req.instructions:
        messages.append(template_message("system", req.instructions))
    messages.extend(items_to_messages(items))
    if not messages:
        raise InvalidRequest("Invalid value for 'input': the conversation is empty (send a message, or instructions)",
                             param="input")
    choice = req.tool_choice
    wishes = template_wishes(req.chat_template_kwargs, effort=req.effort())
    return GenerationRequest(
        messages=tuple(messages),
        tools=tuple(function_tool(t.name, t.description, t.parameters) for t in function_tools(req, items)),
        custom_tools=tuple(custom_tools(req, items)),
        tool_choice=choice if isinstance(choice, str) else "auto",
        forced_tool=None if choice is None or isinstance(choice, str) else choice.name,
        parallel_tool_calls=req.parallel_tool_calls,
        answer_schema=answer_schema_of(req),
        max_tokens=req.max_output_tokens, default_max_tokens=max_tokens_cap if max_tokens_cap is not None else ROOM,
        temperature=req.temperature, top_p=req.top_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        session=session, breakpoints=system_breakpoint(messages), names=RESPONSES_NAMES,
        enable_thinking=wishes.enable_thinking, reasoning_effort=wishes.reasoning_effort,
        template_kwargs=wishes.template_kwargs,
    )


def output_to_items(text: str, reasoning: str, calls, status: str = "completed",
                    namespaces: Optional[dict] = None, tools: Optional[ToolIndex] = None) -> list[dict]:
    """What the model produced as Responses output items (reasoning, then the message, then the calls),
    each with a fresh id; ``status`` is the message's (``incomplete`` when max_output_tokens cut it)."""
    tools = tools or ToolIndex(namespaces or {})
    items: list[dict] = []
    if reasoning:
        items.append(reasoning_item(reasoning))
    if text or not (reasoning or calls):
        items.append(message_item(text, status=status))
    for call in calls:
        items.append(call_item(call, tools, status))  # a reply cut by max_output_tokens: its calls are incomplete
    return items


def call_item(call: dict, tools: ToolIndex, status: str = "completed") -> dict:
    """A call the model made as its Responses output item: ``function_call``, ``custom_tool_call`` (the raw input),
    or ``tool_search_call`` (a client-side tool search: the client runs it and answers with a
    ``tool_search_output``)."""
    if call.get("type") == "custom":
        return {"id": _new_id("ctc_"), "type": "custom_tool_call", "call_id": call["id"],
                "name": call["custom"]["name"], "input": call["custom"]["input"], "status": status}
    if call["function"]["name"] in tools.searches:
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = {"query": call["function"]["arguments"]}
        return {"id": _new_id("tsc_"), "type": "tool_search_call", "call_id": call["id"], "execution": "client",
                "arguments": arguments, "status": status}
    return function_call_item(call, status, tools.namespaces)


def reasoning_item(text: str, item_id: Optional[str] = None, status: str = "completed") -> dict:
    return {"id": item_id or _new_id("rs_"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, item_id: Optional[str] = None, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id or _new_id("msg_"), "type": "message", "role": "assistant", "status": status,
            "content": content}


def function_call_item(call: dict, status: str = "completed", namespaces: Optional[dict] = None) -> dict:
    """An OpenAI chat ``tool_call`` dict as a Responses ``function_call`` item (its call id kept; ``namespace``
    set when the function came from a namespace group)."""
    name = call["function"]["name"]
    item = {"id": _new_id("fc_"), "type": "function_call", "call_id": call["id"], "name": name,
            "arguments": call["function"]["arguments"], "status": status}
    if namespaces and name in namespaces:
        item["namespace"] = namespaces[name]
    return item


def items_for_history(output: list[dict]) -> list:
    """Output item dicts -> validated input items, to continue the conversation from a stored response."""
    return INPUT_ITEMS.validate_python(output)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
