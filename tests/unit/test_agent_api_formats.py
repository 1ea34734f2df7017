"""Responses and Messages output formatting, validated against the official SDKs' own types (no model)."""

from __future__ import annotations

import json
import typing

import anthropic.types as at
import openai.types.responses as ot
import pytest

from server.catalog import is_served
from server.core.prompts import sampling_params
from server.core.request import GenerationRequest, MaxTokens
from server.errors import APIError, ContextLengthExceeded, InvalidRequest, ModelNotFound, PayloadTooLarge, QueueFull
from server.http.error_shapes import anthropic_error_body, shaped_error_body
from server.http.messages.format import MessagesStream, message_object, message_usage, stop_reason_of, tool_use_block
from server.http.responses.format import ResponsesStream, response_base, response_object
from server.http.responses.schemas import ResponsesRequest
from server.http.responses.store import ResponseStore, StoredResponse
from server.http.responses.translate import output_to_items
from server.lane.events import Finished


def _by_type(union) -> dict:
    """The SDK's event classes by their ``type`` literal (its unions are discriminated by the SDK, not pydantic)."""
    while typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    return {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in typing.get_args(union)}


class _EventValidator:
    def __init__(self, union):
        self.classes = _by_type(union)

    def validate_python(self, data: dict):
        return self.classes[data["type"]].model_validate(data)


RESPONSE_EVENT = _EventValidator(ot.ResponseStreamEvent)
MESSAGE_EVENT = _EventValidator(at.RawMessageStreamEvent)
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def finished(reason="stop", prompt=20, completion=5, cached=12) -> Finished:
    return Finished(reason, prompt, completion, cached, prompt - cached, 0.1, completion - 1, 0.2, 0.0)


def sse_events(chunks: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        out.append((head[7:], json.loads(data[6:])))
    return out


def base() -> dict:
    return response_base(ResponsesRequest.model_validate({"input": "x", "max_output_tokens": 9}), "resp_1", "m")


@pytest.mark.parametrize("reason,final", [("stop", "response.completed"), ("length", "response.incomplete")])
def test_responses_stream_sequence_validates_as_sdk_events(reason, final):
    fmt = ResponsesStream(base())
    chunks = fmt.start() + fmt.reasoning("Let me ") + fmt.reasoning("think.") + fmt.text("Hel") + fmt.text("lo")
    calls = fmt.calls([CALL]) if reason == "stop" else []
    closing, obj = fmt.finish(finished(reason), "tool_calls" if calls else reason, reasoning_tokens=3)
    events = sse_events(chunks + calls + closing)
    for name, data in events:
        assert name == data["type"]
        RESPONSE_EVENT.validate_python(data)  # the SDK's own discriminated union, strict about fields
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == final
    assert names.count("response.output_item.added") == names.count("response.output_item.done") == len(obj["output"])
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "Hello"
    assert [i["type"] for i in obj["output"]] == (["reasoning", "message", "function_call"] if calls
                                                  else ["reasoning", "message"])
    assert obj["usage"]["input_tokens_details"]["cached_tokens"] == 12
    assert obj["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    ot.Response.model_validate(obj)
    if calls:
        args = [d for n, d in events if n == "response.function_call_arguments.done"]
        assert args[0]["arguments"] == CALL["function"]["arguments"] and args[0]["name"] == "get_weather"
        assert obj["output"][2]["call_id"] == "call_abc"
    else:
        assert obj["status"] == "incomplete" and obj["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_empty_output_still_has_a_message_and_failure_is_response_failed():
    fmt = ResponsesStream(base())
    closing, obj = fmt.finish(finished(), "stop")
    assert [i["type"] for i in obj["output"]] == ["message"]
    failed = sse_events(ResponsesStream(base()).fail(APIError("boom")))
    assert failed[-1][0] == "response.failed" and failed[-1][1]["response"]["error"]["message"] == "boom"
    RESPONSE_EVENT.validate_python(failed[-1][1])


def test_response_object_validates():
    obj = response_object(base(), output_to_items("hi", "", [CALL]), "completed", finished=finished())
    r = ot.Response.model_validate(obj)
    assert r.output_text == "hi" and r.usage.total_tokens == 25


def test_messages_stream_validates_as_sdk_events():
    fmt = MessagesStream("msg_1", "claude-x", 20)
    chunks = fmt.start() + fmt.thinking("hmm") + fmt.text("Hi") + fmt.text("!") + fmt.finish(
        [CALL], "tool_calls", None, finished())
    events = sse_events(chunks)
    for name, data in events:
        assert name == data["type"]
        if name != "ping":
            MESSAGE_EVENT.validate_python(data)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert names.count("content_block_stop") == 3
    json_delta = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
                  and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(json_delta)) == {"city": "Paris"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == 20


def test_message_object_validates_and_counts_like_anthropic():
    obj = message_object("msg_1", "claude-x", "Hi", "", [CALL], "tool_calls", None, finished())
    m = at.Message.model_validate(obj)
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[1].input == {"city": "Paris"} and m.content[1].id.startswith("toolu_")
    assert m.stop_reason == "tool_use"
    usage = message_usage(finished())
    assert {k: usage[k] for k in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                                  "cache_creation_input_tokens")} == {"input_tokens": 8, "output_tokens": 5,
                                                                      "cache_read_input_tokens": 12,
                                                                      "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("reason,stop,expected", [
    ("stop", None, "end_turn"), ("stop", "END", "stop_sequence"), ("length", None, "max_tokens"),
    ("tool_calls", None, "tool_use")])
def test_stop_reason(reason, stop, expected):
    assert stop_reason_of(reason, stop) == expected


@pytest.mark.parametrize("arguments,expected", [
    ('{"a": 1}', {"a": 1}), ("", {}), ("[1, 2]", {"arguments": [1, 2]}), ("not json", {"arguments": "not json"})])
def test_tool_use_input_is_always_an_object(arguments, expected):
    block = tool_use_block({"id": "call_x", "function": {"name": "f", "arguments": arguments}})
    assert block["input"] == expected and block["id"] == "toolu_x"


@pytest.mark.parametrize("err,status,kind", [
    (InvalidRequest("bad"), 400, "invalid_request_error"), (ModelNotFound("no"), 404, "not_found_error"),
    (PayloadTooLarge("big"), 413, "invalid_request_error"), (QueueFull("busy"), 429, "rate_limit_error"),
    (APIError("oops"), 500, "api_error")])
def test_error_shapes_by_path(err, status, kind):
    assert shaped_error_body("/v1/messages", err) == {"type": "error", "error": {"type": kind, "message":
                                                                                  err.message}, "request_id": None}
    assert shaped_error_body("/v1/messages/count_tokens", err)["error"]["type"] == kind
    assert shaped_error_body("/v1/responses", err) == err.body()
    assert err.status_code == status
    assert anthropic_error_body(503, "x")["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("chunks,stops,expected", [
    (["Hello", " world", "!"], ["!"], "!"), (["Hello", " world"], ["!"], None),
    (["a ST", "OP b E", "ND"], ["END", "STOP"], "STOP")])
def test_the_stop_matcher_says_which_stop_string_fired(chunks, stops, expected):
    from server.lane.stops import StopMatcher

    m = StopMatcher(stops)
    for c in chunks:
        m.feed(c)
    assert m.matched == expected and m.stopped == (expected is not None)


def test_model_aliases():
    names = {"default", "SmolLM2"}
    assert is_served(names, (), "default")
    assert not is_served(names, (), "claude-sonnet-4-5")
    assert is_served(names, ("claude-*",), "claude-sonnet-4-5")
    assert not is_served(names, ("claude-*",), "Claude-sonnet")  # case-sensitive
    assert is_served(names, ("gpt-?o", "claude-*"), "gpt-4o")


def test_response_store_is_an_lru_by_count():
    store = ResponseStore(max_entries=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, ()))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", StoredResponse({"id": "c"}, ()))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and store.get("a") is None and not store.delete("a")
    with pytest.raises(ValueError):
        ResponseStore(0)


@pytest.mark.parametrize("asked,prompt,context,expected", [
    (64000, 100, 8192, 8092), (16, 100, 8192, 16), (None, 100, 8192, 2048), (None, 8000, 8192, 192)])
def test_a_fitted_max_tokens_is_lowered_to_the_room_left(asked, prompt, context, expected):
    req = GenerationRequest(max_tokens=asked, max_tokens_over_room=MaxTokens.FIT)
    params = sampling_params(req, prompt, context, default_max_tokens=2048, vocab_size=100)
    assert params.max_tokens == expected
    with pytest.raises(ContextLengthExceeded):  # a prompt that fills the context leaves no room at all
        sampling_params(req, context, context, default_max_tokens=2048, vocab_size=100)
    if asked is not None and asked > context - prompt:  # a refusing door names its own parameter
        names = {"max_tokens": "max_output_tokens"}
        with pytest.raises(ContextLengthExceeded) as exc:
            sampling_params(GenerationRequest(max_tokens=asked, names=names), prompt, context,
                            default_max_tokens=2048, vocab_size=100)
        assert exc.value.param == "max_output_tokens"
