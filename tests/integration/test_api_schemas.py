"""Every door's answers, streamed and not, errors included, against the published API schemas, on the real default
model through the live server.

The checking itself is the suite's: every server a test starts records what it sends under /v1 (tests/recorder.py)
and tests/conftest.py checks each body and SSE event against its door's schema (tests/conformance.py: OpenAI's
OpenAPI spec for chat, completions, models, embeddings and errors; OpenAI's spec and the Open Responses
specification for Responses; Anthropic's OpenAPI spec for Messages) after every test, so every live test checks
them too. Here each door is driven through what it can answer (text, logprobs, tool calls, usage chunks, an
incomplete response, stored responses, token counts, errors of each API), and each test asserts that its own
answers were checked (a count per door that must grow) and that none was rejected.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.test_tool_calls_live import FEW_SHOT  # the greedy default model answers it with a call

pytestmark = pytest.mark.model

HI = [{"role": "user", "content": "Say hello."}]
NOW = {"name": "now", "description": "The current time", "parameters": {"type": "object", "properties": {}}}


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def stream(server, path, body) -> list[str]:
    """The data lines of a streamed answer."""
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        return [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]


def checked(api_records, *doors: str) -> dict:
    """What the servers sent since the last check, checked now: the count per door, after asserting none was
    rejected."""
    problems = api_records.drain()
    assert not problems, "\n".join(problems)
    return {door: api_records.checked[door] for door in doors}


def grew(before: dict, after: dict, **at_least: int) -> None:
    for door, n in at_least.items():
        assert after[door] - before[door] >= n, (door, before, after)


def test_chat_completions(server, api_records):
    before = checked(api_records, "chat", "errors")
    r = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 6, "temperature": 0, "logprobs": True,
                                              "top_logprobs": 2})
    assert r.status_code == 200
    call = post(server, "/v1/chat/completions", {"messages": FEW_SHOT, "tools": [{"type": "function", "function": NOW}],
                                                 "max_tokens": 16, "temperature": 0}).json()
    assert call["choices"][0]["finish_reason"] == "tool_calls"
    lines = stream(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 6, "stream": True,
                                                    "stream_options": {"include_usage": True}, "logprobs": True})
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["usage"]["total_tokens"] > 0
    assert post(server, "/v1/chat/completions", {"messages": HI, "model": "no-such-model"}).status_code == 404
    assert post(server, "/v1/chat/completions", {"messages": "not a list"}).status_code == 400
    grew(before, checked(api_records, "chat", "errors"), chat=2 + len(lines) - 1, errors=2)


def test_completions(server, api_records):
    before = checked(api_records, "completions", "errors")
    r = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "logprobs": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["tokens"]
    lines = stream(server, "/v1/completions", {"prompt": "One, two,", "max_tokens": 4, "stream": True,
                                               "stream_options": {"include_usage": True}})
    assert post(server, "/v1/completions", {"prompt": 3.5}).status_code == 400
    grew(before, checked(api_records, "completions", "errors"), completions=1 + len(lines) - 1, errors=1)


def test_responses(server, api_records):
    before = checked(api_records, "responses", "input_tokens", "errors")
    tools = [{"type": "function", **NOW}]  # as a client sends it: no strict, and the echo must still be complete
    r = post(server, "/v1/responses", {"input": FEW_SHOT[1:], "instructions": FEW_SHOT[0]["content"], "tools": tools,
                                       "max_output_tokens": 16, "temperature": 0}).json()
    assert [o["type"] for o in r["output"]] == ["function_call"]
    # greedy: sampled, a reply may end within 3 tokens (a fresh-clone run got "completed")
    cut = post(server, "/v1/responses",
               {"input": "Count to twenty.", "max_output_tokens": 3, "temperature": 0}).json()
    assert cut["status"] == "incomplete"
    lines = stream(server, "/v1/responses", {"input": "Say hello.", "max_output_tokens": 6, "stream": True,
                                             "tools": tools})
    assert json.loads(lines[-1])["type"] in ("response.completed", "response.incomplete")
    assert httpx.get(f"{server.url}/v1/responses/{r['id']}", timeout=30).status_code == 200
    assert httpx.delete(f"{server.url}/v1/responses/{r['id']}", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/v1/responses/{r['id']}", timeout=30).status_code == 404
    assert post(server, "/v1/responses/input_tokens", {"input": "Say hello."}).json()["input_tokens"] > 0
    assert post(server, "/v1/responses", {"input": "x", "previous_response_id": "resp_gone"}).status_code == 404
    grew(before, checked(api_records, "responses", "input_tokens", "errors"), responses=3 + len(lines),
         input_tokens=1, errors=2)
    # true values, not just the fields: completed_at only when completed, the tools echoed with the defaults
    assert r["completed_at"] >= r["created_at"] and cut["completed_at"] is None
    assert r["temperature"] == 0.0 and r["presence_penalty"] == 0.0 and r["service_tier"] == "default"
    assert r["tools"] == [{"type": "function", **NOW, "strict": None}]


def test_messages(server, api_records):
    before = checked(api_records, "messages", "count_tokens", "errors")
    tool = {"name": "now", "description": "The current time", "input_schema": {"type": "object", "properties": {}}}
    m = post(server, "/v1/messages", {"model": "default", "max_tokens": 16, "temperature": 0, "tools": [tool],
                                      "system": FEW_SHOT[0]["content"], "messages": FEW_SHOT[1:]}).json()
    assert [b["type"] for b in m["content"]] == ["tool_use"] and m["stop_reason"] == "tool_use"
    text = post(server, "/v1/messages", {"model": "default", "max_tokens": 6, "messages": HI}).json()
    assert text["content"][0]["type"] == "text"
    lines = stream(server, "/v1/messages", {"model": "default", "max_tokens": 6, "messages": HI, "stream": True})
    assert json.loads(lines[-1])["type"] == "message_stop"
    count = post(server, "/v1/messages/count_tokens", {"model": "default", "messages": HI})
    assert count.json()["input_tokens"] > 0
    assert post(server, "/v1/messages", {"model": "default", "messages": HI}).status_code == 400  # no max_tokens
    grew(before, checked(api_records, "messages", "count_tokens", "errors"), messages=2 + len(lines),
         count_tokens=1, errors=1)


def test_models_and_embeddings(server, api_records):
    before = checked(api_records, "models", "embeddings", "errors")
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert httpx.get(f"{server.url}/v1/models/{models[0]['id']}", timeout=30).status_code == 200
    assert httpx.get(server.url + "/v1/models/no-such-model", timeout=30).status_code == 404
    e = post(server, "/v1/embeddings", {"input": ["hello", "world"], "model": "all-MiniLM-L6-v2"})
    assert e.status_code == 200 and len(e.json()["data"]) == 2
    assert post(server, "/v1/embeddings", {"input": []}).status_code == 400
    grew(before, checked(api_records, "models", "embeddings", "errors"), models=2, embeddings=1, errors=2)
