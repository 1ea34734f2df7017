"""Responses API -> the internal request, and back (pure functions, no model)."""

from __future__ import annotations

import pydantic
import pytest

from server.errors import InvalidRequest
from server.http.chat.door import chat_request
from server.http.chat.schemas import ChatCompletionRequest
from server.http.responses.schemas import ResponsesRequest
from server.http.responses.translate import (
    answer_schema_of, function_tools, items_for_history, output_to_items, responses_request, tool_namespaces,
)
from server.http.wire import validation_message

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}


def translate(body: dict, history=()):
    return responses_request(ResponsesRequest.model_validate(body), history)


def chat_messages(body: dict, history=()) -> list[dict]:
    return list(translate(body, history).messages)


def test_string_input_and_instructions():
    assert chat_messages({"input": "hi", "instructions": "Be brief."}) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_items_render_like_the_same_chat_conversation():
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20C"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
    ]
    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]})
    assert chat_messages({"input": items}) == list(chat_request(chat, {}).messages)


def test_previous_response_history_equals_a_full_resend():
    output = output_to_items("Hi there.", "", [])
    history = tuple(items_for_history([{"role": "user", "content": "Hello"}, *output]))
    resent = [{"role": "user", "content": "Hello"}, *output, {"role": "user", "content": "More"}]
    assert chat_messages({"input": "More", "instructions": "I"}, history) == chat_messages(
        {"input": resent, "instructions": "I"})


def test_namespaces_are_flattened_and_hosted_tools_not_offered():
    """What Codex CLI sends: function tools, a namespace group of functions, and OpenAI's hosted web_search."""
    req = ResponsesRequest.model_validate({"input": "x", "tools": [
        TOOL, {"type": "web_search", "external_web_access": False}, {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [
            {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}]})
    assert [t.name for t in function_tools(req)] == ["get_weather", "spawn_agent"]
    assert responses_request(req).function_names == ["get_weather", "spawn_agent"]
    assert tool_namespaces(req) == {"spawn_agent": "agents"}
    calls = [{"id": "call_1", "type": "function", "function": {"name": n, "arguments": "{}"}}
             for n in ("spawn_agent", "get_weather")]
    items = output_to_items("", "", calls, namespaces=tool_namespaces(req))
    assert items[0]["namespace"] == "agents" and "namespace" not in items[1]


def test_sampling_tools_and_choice_map_onto_the_internal_request():
    req = translate({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                     "max_output_tokens": 7, "temperature": 0.2, "top_p": 0.9, "parallel_tool_calls": False})
    assert req.max_tokens == 7 and req.temperature == 0.2 and req.top_p == 0.9
    assert req.tools[0] == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city", "parameters": TOOL["parameters"]}}
    assert req.forced_tool == "get_weather" and req.parallel_tool_calls is False
    assert translate({"input": "x", "tools": [TOOL], "tool_choice": "none"}).tools_enabled is False
    # errors the core raises name the Responses parameters
    assert (req.param("max_tokens"), req.param("response_format"), req.param("messages")) == (
        "max_output_tokens", "text.format", "input")


@pytest.mark.parametrize("fmt,expected", [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "json_schema", "name": "pt", "schema": {"type": "object", "required": ["a"]}, "strict": True},
     {"type": "object", "required": ["a"]}),
])
def test_text_format_becomes_the_answer_schema(fmt, expected):
    body = {"input": "x"} if fmt is None else {"input": "x", "text": {"format": fmt}}
    assert answer_schema_of(ResponsesRequest.model_validate(body)) == expected
    assert translate(body).answer_schema == expected


def test_empty_conversation_is_a_400_naming_input():
    with pytest.raises(InvalidRequest) as exc:
        translate({"input": []})
    assert exc.value.param == "input"


def test_output_items_shapes():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    items = output_to_items("text", "why", calls, status="completed")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[1]["content"][0] == {"type": "output_text", "text": "text", "annotations": [], "logprobs": []}
    assert items[2]["call_id"] == "call_1" and items[2]["arguments"] == '{"a": 1}' and items[2]["id"].startswith("fc_")
    assert [i["type"] for i in output_to_items("", "", [])] == ["message"]  # never an empty output
    assert [i["type"] for i in output_to_items("", "", calls)] == ["function_call"]
    assert output_to_items("cut", "", [], status="incomplete")[0]["status"] == "incomplete"


@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"type": "web_search_call"}]}, "input.0", "known 'type'"),
    ({"input": [{"content": "no role"}]}, "input.0", "known 'type'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input.0.content",
     "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]}, "input.0.content.0", "bogus"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id", "required"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role", None),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools.0.function.name", "required"),
    ({"input": "x", "tools": [{"name": "no_type"}]}, "tools.0", "type"),
    ({"input": "x", "tool_choice": "always"}, "tool_choice", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": 5}, "input", None),
    ({}, "input", "required"),
])
def test_hostile_requests_name_the_parameter(body, param, words):
    with pytest.raises(pydantic.ValidationError) as exc:
        ResponsesRequest.model_validate(body)
    message, got = validation_message(exc.value.errors())
    assert got == param, message
    if words:
        assert words in message
