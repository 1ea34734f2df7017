"""Tool calls parsed end to end from the real default model's output, through the live server.

SmolLM2's chat template renders no tools and names no tool format, so the server reads its replies in the
Hermes fallback format. A few-shot conversation makes the model (greedy) reply with
``<tool_call>{"name": "now"}</tool_call>`` — real model output, 15 tokens — which the server must turn into
an OpenAI tool call, streamed and not. The same conversation without ``tools`` must leave the markup as text.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.model

CALL = '<tool_call>{"name": "now"}</tool_call>'
FEW_SHOT = [
    {"role": "system", "content": "You call tools. Reply only with " + CALL},
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": CALL},
    {"role": "user", "content": "And now?"},
    {"role": "assistant", "content": CALL},
    {"role": "user", "content": "Tell me the time please."},
]
TOOLS = [{"type": "function", "function": {"name": "now", "description": "The current time",
                                           "parameters": {"type": "object", "properties": {}}}}]


def test_tool_call_from_real_output_json(client):
    r = client.chat.completions.create(model="default", messages=FEW_SHOT, tools=TOOLS, max_tokens=16,
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # the reply was the call and nothing else
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "now"
    assert json.loads(call.function.arguments) == {}


def test_tool_call_from_real_output_streamed(client):
    chunks = list(client.chat.completions.create(model="default", messages=FEW_SHOT, tools=TOOLS, max_tokens=16,
                                                 temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert "<tool" not in content and "{" not in content  # no raw markup ever reached the client
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1
    assert calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "now" and json.loads(calls[0].function.arguments) == {}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_without_tools_the_markup_is_plain_text(server):
    body = {"messages": FEW_SHOT, "max_tokens": 16, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    message = r["choices"][0]["message"]
    assert message["content"] == CALL
    assert "tool_calls" not in message and "reasoning_content" not in message
    assert r["choices"][0]["finish_reason"] in ("stop", "length")


def test_tools_request_without_a_call_is_well_formed(server):
    """A request with tools whose reply is ordinary text: content, no tool_calls, a normal finish."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "tools": TOOLS, "max_tokens": 8,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    objs = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objs if o["choices"])
    assert text.strip()
    assert not any("tool_calls" in o["choices"][0]["delta"] for o in objs if o["choices"])
    assert [o["choices"][0]["finish_reason"] for o in objs if o["choices"][0]["finish_reason"]][0] in ("stop", "length")
