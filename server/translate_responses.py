"""Responses API <-> the internal chat request: pure functions, no I/O, no model.

- ``responses_to_chat(req, history)``: a ``ResponsesRequest`` (plus the stored items of its
  ``previous_response_id`` chain) -> one ``ChatCompletionRequest``. ``instructions`` become the first
  system message (they are not carried over from a previous response, as OpenAI documents);
  ``function_call`` items join the assistant message before them as ``tool_calls`` and
  ``function_call_output`` items become ``tool`` messages, so a conversation renders exactly as the same
  conversation sent to chat completions: the prefix cache hits across turns and across the two APIs.
- ``output_to_items(result)``: what the model produced, as Responses output item dicts.
"""

from __future__ import annotations

import uuid
from typing import Optional

from pydantic import ValidationError

from server.errors import InvalidRequest
from server.http_util import validation_message
from server.schemas import ChatCompletionRequest
from server.schemas_responses import (
    INPUT_ITEMS, FunctionCallItem, FunctionCallOutputItem, FunctionTool, MessageItem, NamespaceTool, ReasoningItem,
    ResponsesRequest,
)

__all__ = ["input_items", "items_to_messages", "response_format_of", "responses_to_chat", "output_to_items",
           "function_tools", "tool_namespaces"]


def input_items(req: ResponsesRequest) -> list:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def items_to_messages(items) -> list[dict]:
    """Responses input items -> chat messages (dicts in the chat completions request shape)."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # text + calls of one turn: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif isinstance(item, ReasoningItem):
            continue  # chat templates drop past thinking; rendering it would also break the prefix match
        else:  # the schema admits no other item; a new one must be rendered on purpose, not dropped
            raise InvalidRequest(f"input item type '{getattr(item, 'type', '?')}' is not supported", param="input")
    return out


def response_format_of(req: ResponsesRequest) -> Optional[dict]:
    """``text.format`` in the chat request's ``response_format`` shape (``None`` for plain text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_ or {}}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def function_tools(req: ResponsesRequest) -> list[FunctionTool]:
    """Every function the model is offered: top-level function tools and the members of namespace groups."""
    out: list[FunctionTool] = []
    for tool in req.tools or ():
        out.extend(tool.tools if isinstance(tool, NamespaceTool) else [tool])
    return out


def tool_namespaces(req: ResponsesRequest) -> dict[str, str]:
    """Function name -> its namespace, for the ``namespace`` field of the calls the model makes."""
    return {f.name: tool.name for tool in req.tools or () if isinstance(tool, NamespaceTool) for f in tool.tools}


def responses_to_chat(req: ResponsesRequest, history=()) -> ChatCompletionRequest:
    """The internal request for ``req`` continuing ``history`` (items of the previous responses)."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages.extend(items_to_messages([*history, *input_items(req)]))
    body: dict = {
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "tool_choice": _tool_choice(req.tool_choice),
        "response_format": response_format_of(req),
    }
    tools = function_tools(req)
    if tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                ("parameters", t.parameters)) if v is not None}}
            for t in tools
        ]
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        param = {"response_format": "text.format", "max_tokens": "max_output_tokens"}.get(param, param)
        if param == "messages":
            message = "Invalid value for 'input': the conversation is empty (send a message, or instructions)"
            param = "input"
        raise InvalidRequest(message.replace("'response_format'", "'text.format'"), param=param) from None


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
