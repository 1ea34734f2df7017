"""Anthropic Messages API -> the internal request (pure functions, no model)."""

from __future__ import annotations

import json

import pydantic
import pytest

from server.core.request import MaxTokens
from server.errors import InvalidRequest
from server.http.chat.door import chat_request
from server.http.chat.schemas import ChatCompletionRequest
from server.http.messages.schemas import CountTokensRequest, MessagesRequest
from server.http.messages.translate import messages_request
from server.http.wire import validation_message

TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def translate(**body):
    return messages_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body}))


def dump(req) -> list[dict]:
    return list(req.messages)


def test_tool_round_trip_renders_like_the_same_chat_conversation():
    req = translate(
        system=[{"type": "text", "text": "Rules."}, {"type": "text", "text": "More rules.", "cache_control": {}}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ])
    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Rules.\nMore rules."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "hmm", "tool_calls": [{
            "id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "And tomorrow?"},
    ]})
    assert dump(req) == dump(chat_request(chat, {}))  # the thinking goes back with its turn through either door


def test_tool_result_only_turn_has_no_empty_user_message():
    req = translate(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok", "is_error": True}]},
    ])
    assert [m["role"] for m in dump(req)] == ["user", "assistant", "tool"]
    assert dump(req)[1]["content"] == ""  # an assistant turn of calls only: no text, as chat templates expect


def test_sampling_session_stops_and_tools():
    req = translate(messages=[{"role": "user", "content": "x"}], temperature=0.5, top_p=0.8, top_k=40,
                    stop_sequences=["END"], metadata={"user_id": "sess-1"}, tools=[TOOL],
                    tool_choice={"type": "tool", "name": "get_weather"})
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k) == (5, 0.5, 0.8, 40)
    assert req.max_tokens_over_room is MaxTokens.FIT  # Claude Code asks for 64,000: lowered to the room left
    assert req.stop == ("END",) and req.logprobs is False  # the lane reports which stop string fired
    assert req.tools[0]["function"]["parameters"] == TOOL["input_schema"]
    assert req.forced_tool == "get_weather" and req.param("stop") == "stop_sequences"
    assert translate(messages=[{"role": "user", "content": "x"}]).logprobs is False


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")])
def test_tool_choice(choice, expected):
    req = translate(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=choice)
    assert req.tool_choice == expected and req.forced_tool is None
    assert req.tools_enabled is (expected != "none")


def test_count_tokens_request_needs_no_max_tokens():
    req = messages_request(CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user",
                                                                                          "content": "x"}]}))
    assert dump(req) == [{"role": "user", "content": "x"}]


def test_tool_use_in_a_user_turn_is_refused():
    with pytest.raises(InvalidRequest):
        translate(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])


def test_too_many_stop_sequences_name_stop_sequences():
    with pytest.raises(pydantic.ValidationError) as exc:
        translate(messages=[{"role": "user", "content": "x"}], stop_sequences=[f"s{i}" for i in range(40)])
    message, param = validation_message(exc.value.errors())
    assert param == "stop_sequences" and "at most 16" in message


OK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,param,words", [
    ({"model": "m", "messages": OK}, "max_tokens", "required"),
    ({"max_tokens": 5, "messages": OK}, "model", "required"),
    ({"model": "m", "max_tokens": 0, "messages": OK}, "max_tokens", None),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages", None),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", None),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages.0.content.0", "video"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content", "not supported"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "messages.0.content", None),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}]}]},
     "messages.0.content.0.content", "not supported"),
    ({"model": "m", "max_tokens": 5, "messages": OK, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools", "server tool"),
    ({"model": "m", "max_tokens": 5, "messages": OK, "tools": [{"name": "f"}]}, "tools.0.input_schema", None),
    ({"model": "m", "max_tokens": 5, "messages": OK, "tool_choice": {"type": "tool"}}, "tool_choice", "name"),
    ({"model": "m", "max_tokens": 5, "messages": OK, "temperature": 1.5}, "temperature", None),
    ({"model": "m", "max_tokens": 5, "messages": OK, "system": 7}, "system", None),
])
def test_hostile_requests_name_the_parameter(body, param, words):
    with pytest.raises(pydantic.ValidationError) as exc:
        MessagesRequest.model_validate(body)
    message, got = validation_message(exc.value.errors())
    assert got == param, message
    if words:
        assert words in message


def test_mid_conversation_system_turn_stays_in_place():
    """Claude Code sends system turns between user turns (anthropic-beta mid-conversation-system)."""
    req = translate(system="Top.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Agent types: ..."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "Later."}])
    assert [(m["role"], m["content"]) for m in dump(req)] == [
        ("system", "Top."), ("user", "hi\n\nAgent types: ..."), ("user", "go"), ("assistant", "ok"),
        ("system", "Later.")]
    first = translate(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "u"}])
    assert [(m["role"], m["content"]) for m in dump(first)] == [("system", "S"), ("user", "u")]
    with pytest.raises(InvalidRequest):
        translate(messages=[{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}])


# -- Claude Code -------------------------------------------------------------------------------------------------
BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=sdk-cli;"}
EPHEMERAL = {"type": "ephemeral"}


def test_claude_codes_billing_header_is_dropped_unless_kept():
    system = [BILLING, {"type": "text", "text": "You are Claude Code.", "cache_control": EPHEMERAL}]
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": system,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert messages_request(body).messages[0]["content"] == "You are Claude Code."
    kept = messages_request(body, keep_billing_header=True).messages[0]["content"]
    assert kept.startswith("x-anthropic-billing-header:") and kept.endswith("You are Claude Code.")
    other = {**BILLING, "text": BILLING["text"].replace("a3f", "0c1")}  # the suffix changes with every prompt
    body2 = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": [other, system[1]],
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert messages_request(body2).messages == messages_request(body).messages  # the same prompt: shared


def test_cache_control_breakpoints_become_message_boundaries():
    marked = {"type": "text", "text": "Rules.", "cache_control": EPHEMERAL}
    req = translate(system=[marked], messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": EPHEMERAL}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "c", "cache_control": EPHEMERAL},
                                     {"type": "text", "text": "d"}]}])
    # after the system prompt; after the first turn (its last block is marked); before the last turn (an early block)
    assert req.breakpoints == (1, 2, 3)
    tools_only = translate(system="Rules.", tools=[{**TOOL, "cache_control": EPHEMERAL}],
                           messages=[{"role": "user", "content": "x"}])
    assert tools_only.breakpoints == (1,)  # a marked tool: the system prompt (tools render there) is the prefix
    assert translate(messages=[{"role": "user", "content": "x"}]).breakpoints == ()


@pytest.mark.parametrize("user_id,session", [
    ('{"device_id": "d", "account_uuid": "", "session_id": "s-123"}', "s-123"),  # Claude Code 2.1
    ("user_abc_account__session_9", "user_abc_account__session_9"),
    ('{"no": "session"}', '{"no": "session"}'),
    (None, None),
])
def test_the_session_of_metadata_user_id(user_id, session):
    from server.http.messages.translate import session_of_user_id

    assert session_of_user_id(user_id) == session


def test_usage_splits_the_prompt_into_read_created_and_the_rest():
    from server.http.messages.format import message_usage
    from server.lane.events import Finished

    f = Finished("stop", 100, 5, 60, 40, 0.1, 4, 0.1, 0.0, cache_write_tokens=40)
    u = message_usage(f)  # no breakpoint: what was not read is input, though the server cached it
    assert (u["cache_read_input_tokens"], u["cache_creation_input_tokens"], u["input_tokens"]) == (60, 0, 40)
    marked = message_usage(f, last_breakpoint=90)  # created: up to the last breakpoint, beyond what was read
    assert (marked["cache_read_input_tokens"], marked["cache_creation_input_tokens"], marked["input_tokens"]) == (
        60, 30, 10)
    off = message_usage(Finished("stop", 100, 5, 0, 100, 0.1, 4, 0.1, 0.0), 90)  # the cache off: nothing written
    assert (off["cache_creation_input_tokens"], off["input_tokens"]) == (0, 100)
