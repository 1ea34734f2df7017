"""OpenAI Responses API (/v1/responses) on the real default model through a live server (openai SDK + httpx)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
INSTRUCTIONS = ("You are a helpful assistant for a software team. Answer briefly and precisely. "
                "Prefer plain words, no lists, no markdown.")


def test_create_json(client):
    r = client.responses.create(model="default", input="Say hello and introduce yourself.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text"
    assert r.output_text.strip()
    assert 1 <= r.usage.output_tokens <= 12
    assert r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 <= r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_stream_events_match_the_json_response(client):
    kw = dict(model="default", input="Name three colors.", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for needed in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                   "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert needed in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"][0]
    final = events[-1].response
    assert text and done.text == text and final.output_text == text
    assert final.usage.output_tokens <= 10
    assert client.responses.create(**kw).output_text == text  # greedy: streamed and JSON agree


def test_raw_sse_has_event_lines_and_no_done_marker(server):
    body = {"input": "Hi", "max_output_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln and not ln.startswith(":")]
    assert "data: [DONE]" not in lines
    pairs = list(zip(lines[::2], lines[1::2]))
    assert len(pairs) * 2 == len(lines)
    for event, data in pairs:
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]


def test_function_calling_round_trip(client):
    first = client.responses.create(model="default", input="What is the weather in Paris? Use the tool.",
                                    tools=TOOLS, max_output_tokens=16, temperature=0)
    for item in first.output:
        assert item.type in ("message", "function_call")
        if item.type == "function_call":  # the small model may or may not call it
            assert item.call_id and item.name == "get_weather" and isinstance(item.arguments, str)
    history = [
        {"role": "user", "content": "What is the weather in Paris? Use the tool."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"},
    ]
    second = client.responses.create(model="default", input=history, tools=TOOLS, max_output_tokens=8,
                                     temperature=0)
    assert second.status in ("completed", "incomplete")
    # the call and its output were rendered into the prompt
    assert second.usage.input_tokens > first.usage.input_tokens


def test_multi_turn_hits_the_prefix_cache_resent_or_chained(client):
    turn1_input = [{"role": "user", "content": "Tell me something about the moon."}]
    r1 = client.responses.create(model="default", instructions=INSTRUCTIONS, input=turn1_input,
                                 max_output_tokens=12, temperature=0)
    # turn 2 the way agents do it: resend everything, the previous output items included
    resent = turn1_input + [item.model_dump(exclude_none=True) for item in r1.output] + [
        {"role": "user", "content": "And about the sun?"}]
    r2 = client.responses.create(model="default", instructions=INSTRUCTIONS, input=resent, max_output_tokens=8,
                                 temperature=0)
    assert r2.usage.input_tokens_details.cached_tokens > r1.usage.input_tokens / 2
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens - 1
    # the same turn 2 through previous_response_id renders the same prompt and hits the cache too
    r3 = client.responses.create(model="default", instructions=INSTRUCTIONS, previous_response_id=r1.id,
                                 input="And about the sun?", max_output_tokens=8, temperature=0)
    assert r3.previous_response_id == r1.id
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens > r1.usage.input_tokens / 2
    assert r3.output_text == r2.output_text


def test_store_get_and_previous_response_not_found(client, server):
    r = client.responses.create(model="default", input="Hi", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    unstored = client.responses.create(model="default", input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    body = {"input": "Hi", "max_output_tokens": 3, "previous_response_id": unstored.id}
    resp = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, 2]}, "input.0"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
     "input.0.content.0.image_url"),  # a malformed data: URI (images themselves: tests/integration/test_vision_live.py)
    ({"input": [{"role": "user", "content": [{"type": "nope"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": 7, "arguments": "{}"}]}, "input.0.name"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools.0.function.name"),
    ({"input": "x", "tools": "get_weather"}, "tools"),
    ({"input": "x", "tool_choice": 3}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "previous_response_id": 12}, "previous_response_id"),
    ({"input": []}, "input"),
])
def test_hostile_input_is_a_400_in_openai_shape(server, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body)
    r = httpx.post(server.url + "/v1/responses", content=content, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err


def test_unknown_model_oversize_and_the_server_keeps_serving(server, client):
    r = httpx.post(server.url + "/v1/responses", json={"model": "gpt-5", "input": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    big = json.dumps({"input": "x" * (9 << 20)})  # over the default --max-body-bytes (8M)
    r = httpx.post(server.url + "/v1/responses", content=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    after = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    assert after.status in ("completed", "incomplete") and 1 <= after.usage.output_tokens <= 2
    assert client.responses.retrieve(after.id).id == after.id  # served, and stored, as usual


# A few-shot conversation that makes the default model (greedy) reply with a real Hermes tool call
# (the same one tests/integration/test_tool_calls_live.py uses for chat completions).
CALL = '<tool_call>{"name": "now"}</tool_call>'
FEW_SHOT = [
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": CALL},
    {"role": "user", "content": "And now?"},
    {"role": "assistant", "content": CALL},
    {"role": "user", "content": "Tell me the time please."},
]
NOW = [{"type": "function", "name": "now", "description": "The current time",
        "parameters": {"type": "object", "properties": {}}}]


def test_real_function_call_json_stream_and_round_trip(client):
    kw = dict(model="default", instructions="You call tools. Reply only with " + CALL, input=FEW_SHOT, tools=NOW,
              max_output_tokens=16, temperature=0)
    r = client.responses.create(**kw)
    calls = [i for i in r.output if i.type == "function_call"]
    assert [c.name for c in calls] == ["now"] and json.loads(calls[0].arguments) == {}
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    assert "<tool_call>" not in r.output_text
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.output_text.delta" not in types
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {}
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[-1].item.type == "function_call" and added[-1].item.name == "now"
    final = events[-1].response
    assert events[-1].type == "response.completed" and [i.type for i in final.output] == ["function_call"]
    # turn 2: the call and its output go back as items, chained through previous_response_id
    follow = client.responses.create(model="default", previous_response_id=r.id, tools=NOW, max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "It is 10:42."}],
                                     instructions=kw["instructions"], temperature=0)
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens_details.cached_tokens > r.usage.input_tokens / 2


def test_text_format_json_schema_is_enforced(client):
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 16},
                             "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
    r = client.responses.create(model="default", input="Plan a short trip.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "trip", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    with pytest.raises(openai.BadRequestError) as err:  # a schema the grammar library cannot compile
        client.responses.create(model="default", input="x", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "bad", "schema": {"type": "strin"}}})
    assert err.value.body["param"] == "text.format"
