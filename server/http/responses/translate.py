"""Responses API <-> the internal request: pure functions, no I/O, no model.

``responses_request(req, history)`` builds the one internal request (server.core.request) of a Responses body that
continues ``history`` (the input items of a stored conversation, ``previous_response_id``): ``instructions`` become
the first system message, input items chat messages (``items_to_messages``: a message item its text, a
``function_call`` an assistant tool call (calls of one turn join the assistant message before them), a
``function_call_output`` a tool message, ``reasoning`` dropped: chat templates drop past thinking, and rendering it
would break the prefix match), ``text.format`` the answer schema, function tools (and the members of ``namespace``
groups) the offered functions. The same conversation sent whole or continued from a stored response renders the
same tokens, so the prefix cache hits either way. ``output_to_items`` goes back: what the model produced as output
items.

Errors name the Responses parameters: ``input``, ``max_output_tokens``, ``text.format`` (``RESPONSES_NAMES``).
"""

from __future__ import annotations

import uuid
from typing import Optional

from server.core.request import GenerationRequest, function_tool, template_message
from server.errors import InvalidRequest
from server.http.responses.schemas import (
    INPUT_ITEMS, FunctionCallItem, FunctionCallOutputItem, FunctionTool, MessageItem, NamespaceTool, ReasoningItem,
    ResponsesRequest,
)

__all__ = ["input_items", "items_to_messages", "answer_schema_of", "responses_request", "output_to_items",
           "function_tools", "tool_namespaces", "RESPONSES_NAMES"]

# the internal request's fields under their Responses names (server.core.request.GenerationRequest.param)
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def input_items(req: ResponsesRequest) -> list:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def items_to_messages(items) -> list[dict]:
    """Responses input items -> chat messages as chat templates read them (server.core.request.template_message)."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(template_message(item.role, item.text()))
        elif isinstance(item, FunctionCallItem):
            call = template_message("assistant", "", tool_calls=[(item.call_id, item.name, item.arguments)])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).extend(call["tool_calls"])  # one turn's text + calls: one message
            else:
                out.append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append(template_message("tool", item.text(), tool_call_id=item.call_id))
        elif isinstance(item, ReasoningItem):
            continue  # chat templates drop past thinking; rendering it would also break the prefix match
        else:  # the schema admits no other item; a new one must be rendered on purpose, not dropped
            raise InvalidRequest(f"input item type '{getattr(item, 'type', '?')}' is not supported", param="input")
    return out


def answer_schema_of(req: ResponsesRequest) -> Optional[dict]:
    """The JSON schema ``text.format`` asks the answer to follow (``None`` for plain text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    return fmt.schema_ or {}


def function_tools(req: ResponsesRequest) -> list[FunctionTool]:
    """Every function the model is offered: top-level function tools and the members of namespace groups."""
    out: list[FunctionTool] = []
    for tool in req.tools or ():
        out.extend(tool.tools if isinstance(tool, NamespaceTool) else [tool])
    return out


def tool_namespaces(req: ResponsesRequest) -> dict[str, str]:
    """Function name -> its namespace, for the ``namespace`` field of the calls the model makes."""
    return {f.name: tool.name for tool in req.tools or () if isinstance(tool, NamespaceTool) for f in tool.tools}


def responses_request(req: ResponsesRequest, history=(), *, session: Optional[str] = None,
                      adapter=None) -> GenerationRequest:
    """The internal request for ``req`` continuing ``history`` (items of the previous responses)."""
    messages: list[dict] = []
    if req.instructions:
        messages.append(template_message("system", req.instructions))
    messages.extend(items_to_messages([*history, *input_items(req)]))
    if not messages:
        raise InvalidRequest("Invalid value for 'input': the conversation is empty (send a message, or instructions)",
                             param="input")
    choice = req.tool_choice
    return GenerationRequest(
        messages=tuple(messages),
        tools=tuple(function_tool(t.name, t.description, t.parameters) for t in function_tools(req)),
        tool_choice=choice if isinstance(choice, str) else "auto",
        forced_tool=None if choice is None or isinstance(choice, str) else choice.name,
        parallel_tool_calls=req.parallel_tool_calls,
        answer_schema=answer_schema_of(req),
        max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        session=session, adapter=adapter, names=RESPONSES_NAMES,
    )


def output_to_items(text: str, reasoning: str, calls, status: str = "completed",
                    namespaces: Optional[dict] = None) -> list[dict]:
    """What the model produced as Responses output items (reasoning, then the message, then the calls),
    each with a fresh id; ``status`` is the message's (``incomplete`` when max_output_tokens cut it)."""
    items: list[dict] = []
    if reasoning:
        items.append(reasoning_item(reasoning))
    if text or not (reasoning or calls):
        items.append(message_item(text, status=status))
    for call in calls:
        items.append(function_call_item(call, namespaces=namespaces))
    return items


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
