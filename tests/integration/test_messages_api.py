"""Anthropic Messages API (/v1/messages) on the real default model through a live server (anthropic SDK + httpx)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

HI = [{"role": "user", "content": "Say hello and introduce yourself."}]
TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
SYSTEM = ("You are a helpful assistant for a software team. Answer briefly and precisely. "
          "Prefer plain words, no lists, no markdown.")
FAULT = "KABOOM-4417"
# current anthropic SDKs dropped `temperature` from messages.create (newer Claude models ignore it); the API
# field still exists and this server honours it (default 1.0, as Anthropic's): send it as an extra body field
GREEDY = {"temperature": 0}


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def guarded(default_model_dir):
    """A server with --api-key, --model-alias 'claude-*', a small body cap and fault injection."""
    srv = ServerProc("--model", "default", "--api-key", "sekret", "--model-alias", "claude-*",
                     "--max-body-bytes", "64K", env={"MLX_LANE_FAULT_MARKER": FAULT})
    yield srv
    assert srv.stop() == 0, srv.log()


def test_create_text(claude):
    m = claude.messages.create(model="default", max_tokens=12, messages=HI, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 12
    prompt = claude.messages.count_tokens(model="default", messages=HI).input_tokens
    # Anthropic's split of the prompt: read from the cache + created up to the last cache_control breakpoint + the
    # rest (tests/integration/test_messages_usage.py tests it exactly)
    assert m.usage.input_tokens + m.usage.cache_creation_input_tokens + m.usage.cache_read_input_tokens == prompt
    assert m.usage.cache_creation_input_tokens == 0  # no breakpoint: what was not read is input


def test_stream_matches_create(claude):
    kw = dict(model="default", max_tokens=10, messages=HI, extra_body=GREEDY)
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens <= 10
    assert claude.messages.create(**kw).content[0].text == text


def test_raw_event_sequence(server):
    body = {"model": "default", "max_tokens": 4, "temperature": 0, "stream": True, "messages": HI}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120,
                      headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    pairs = list(zip(lines[::2], lines[1::2]))
    names = []
    for event, data in pairs:
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
        names.append(event[7:])
    assert names[:2] == ["message_start", "ping"]
    # more keep-alive pings may come anywhere (a slow prefill on a loaded machine): Anthropic's stream allows them
    core = [n for n in names if n != "ping"]
    assert core[:2] == ["message_start", "content_block_start"]
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(core[2:-3]) == {"content_block_delta"}


def test_tool_use_round_trip_and_count_tokens(claude):
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "18C, sunny"}]},
            {"type": "text", "text": "Summarize it."}]},
    ]
    m = claude.messages.create(model="default", max_tokens=8, messages=history, tools=TOOLS, extra_body=GREEDY)
    for block in m.content:
        assert block.type in ("text", "tool_use")
        if block.type == "tool_use":  # the small model may or may not call it
            assert block.id.startswith("toolu_") and block.name == "get_weather" and isinstance(block.input, dict)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model="default", messages=history, tools=TOOLS).input_tokens
    assert m.usage.input_tokens + m.usage.cache_creation_input_tokens + m.usage.cache_read_input_tokens == counted
    string_result = history[:2] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18C, sunny", "is_error": False}]}]
    assert claude.messages.count_tokens(model="default", messages=string_result, tools=TOOLS).input_tokens > 0
    # the same conversation through chat completions renders the same prompt
    chat = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": "18C, sunny"},
            {"role": "user", "content": "Summarize it."}]
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in TOOLS]
    r = httpx.post(str(claude.base_url).rstrip("/") + "/v1/chat/completions", timeout=120,
                   json={"messages": chat, "tools": chat_tools, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == counted


def test_multi_turn_hits_the_prefix_cache(claude):
    turn1 = [{"role": "user", "content": "Tell me something about the moon."}]
    kw = dict(model="default", system=SYSTEM, extra_body=GREEDY, metadata={"user_id": "test-session-moon"})
    r1 = claude.messages.create(max_tokens=12, messages=turn1, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": [b.model_dump() for b in r1.content]},
                     {"role": "user", "content": "And about the sun?"}]
    r2 = claude.messages.create(max_tokens=8, messages=turn2, **kw)
    prompt1 = r1.usage.input_tokens + r1.usage.cache_creation_input_tokens + r1.usage.cache_read_input_tokens
    assert r2.usage.cache_read_input_tokens > prompt1 / 2
    assert r2.usage.input_tokens < r2.usage.cache_read_input_tokens


def test_stop_sequence_is_reported(claude):
    text = claude.messages.create(model="default", max_tokens=12, messages=HI, extra_body=GREEDY).content[0].text
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    m = claude.messages.create(model="default", max_tokens=12, messages=HI, extra_body=GREEDY, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.find(stop)]


OK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body", [
    b"{not json",
    b"[1, 2]",
    {"model": "default", "messages": OK},  # no max_tokens
    {"max_tokens": 5, "messages": OK},  # no model
    {"model": "default", "max_tokens": "five", "messages": OK},
    {"model": "default", "max_tokens": 5, "messages": []},
    {"model": "default", "max_tokens": 5, "messages": "hi"},
    {"model": "default", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
    {"model": "default", "max_tokens": 5, "messages": [{"role": "system", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
    {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
    {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image",
                                                                                     "source": {}}]}]},
    {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    {"model": "default", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "not an object"}]}]},
    {"model": "default", "max_tokens": 5, "messages": OK, "tools": [{"name": "f"}]},
    {"model": "default", "max_tokens": 5, "messages": OK, "tools": [{"type": "web_search_20250305",
                                                                     "name": "web_search"}]},
    {"model": "default", "max_tokens": 5, "messages": OK, "tool_choice": {"type": "tool"}},
    {"model": "default", "max_tokens": 5, "messages": OK, "temperature": 3},
    {"model": "default", "max_tokens": 5, "messages": OK, "stop_sequences": ["x"] * 40},
    {"model": "default", "max_tokens": 5, "messages": OK, "system": [{"type": "text"}]},
    {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 9000}]},  # > context
])
def test_hostile_input_is_a_400_in_anthropic_shape(server, body):
    content = body if isinstance(body, bytes) else json.dumps(body)
    r = httpx.post(server.url + "/v1/messages", content=content, timeout=60)
    assert r.status_code == 400, r.text
    obj = r.json()
    assert obj["type"] == "error" and set(obj["error"]) == {"type", "message"}
    assert obj["error"]["type"] == "invalid_request_error" and obj["error"]["message"]
    assert "Traceback" not in r.text


def test_sdk_errors_unknown_model_and_the_server_keeps_serving(claude, server):
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model="default", max_tokens=5, messages=OK, extra_body={"temperature": 2})
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.messages.create(model="claude-sonnet-test", max_tokens=5, messages=OK)
    assert exc.value.body["error"]["type"] == "not_found_error" and "--model-alias" in exc.value.message
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "nope", "messages": OK}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/messages/nothing-here", timeout=60)
    assert r.status_code in (404, 405) and r.json()["type"] == "error"
    assert claude.messages.create(model="default", max_tokens=2, messages=OK).usage.output_tokens >= 1


def test_auth_alias_size_and_faults(guarded):
    url, ok = guarded.url, {"max_tokens": 3, "messages": OK}
    # no key: each API answers in its own shape
    r = httpx.post(url + "/v1/messages", json={"model": "claude-sonnet-test", **ok}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/responses", json={"input": "x"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # x-api-key (Anthropic's header) and Bearer both work, on either API
    c = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0, timeout=120)
    m = c.messages.create(model="claude-sonnet-test", **ok)
    assert m.model == "claude-sonnet-test" and m.usage.output_tokens >= 1
    assert c.messages.create(model="claude-haiku-4-5", **ok).content is not None  # the small fast model name too
    r = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": "sekret"},
                   json={"model": "claude-x", "messages": OK, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/messages", headers={"Authorization": "Bearer sekret"},
                   json={"model": "gpt-5", **ok}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": "sekret"},
                   json={"model": "claude-x", "max_tokens": 3, "messages": [{"role": "user", "content": "y" * 70000}]},
                   timeout=60)
    # the status says too large; the type is one Anthropic's spec knows (server/http/error_shapes.py says why)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    # a generation that fails: a 500 api_error as JSON, an `event: error` mid-stream
    boom = {"model": "claude-x", "max_tokens": 3, "messages": [{"role": "user", "content": FAULT}]}
    with pytest.raises(anthropic.InternalServerError) as exc:
        c.messages.create(**boom)
    assert exc.value.body["error"]["type"] == "api_error" and "Traceback" not in exc.value.message
    with httpx.stream("POST", url + "/v1/messages", headers={"x-api-key": "sekret"}, json=dict(boom, stream=True),
                      timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-2] == "event: error"
    assert json.loads(lines[-1][6:]) == {"type": "error", "error": {"type": "api_error", "message": json.loads(
        lines[-1][6:])["error"]["message"]}, "request_id": None}
    with httpx.stream("POST", url + "/v1/responses", headers={"x-api-key": "sekret"},
                      json={"input": FAULT, "max_output_tokens": 3, "stream": True}, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-2] == "event: response.failed"
    assert json.loads(lines[-1][6:])["response"]["status"] == "failed"
    assert c.messages.create(model="claude-x", **ok).usage.output_tokens >= 1  # still serving


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
NOW = [{"name": "now", "description": "The current time", "input_schema": {"type": "object", "properties": {}}}]


def test_real_tool_use_json_stream_and_round_trip(claude):
    kw = dict(model="default", system="You call tools. Reply only with " + CALL, messages=FEW_SHOT, tools=NOW,
              max_tokens=16, extra_body=GREEDY)
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.name == "now" and block.input == {} and block.id.startswith("toolu_")
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert ("content_block_delta", "input_json_delta") in kinds and ("content_block_delta", "text_delta") not in kinds
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].name == "now" and final.content[0].input == {}
    # turn 2: the tool_use goes back in the assistant turn, its result in the next user turn
    history = FEW_SHOT + [{"role": "assistant", "content": [block.model_dump()]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                        "content": "It is 10:42."}]}]
    follow = claude.messages.create(**dict(kw, messages=history, max_tokens=8))
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.usage.cache_read_input_tokens > (m.usage.input_tokens + m.usage.cache_creation_input_tokens
                                                   + m.usage.cache_read_input_tokens) / 2
