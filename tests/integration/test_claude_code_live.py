"""A real Claude Code 2.1.332 session (tests/fixtures/agents/claude_code_2.1.332_turn{1,3,7}.json, issue 36 item 7)
replayed on the real default model behind a live server: turn 7, whose tool result holds ToolSearch's
``tool_reference`` block and whose ``tools`` gained the loaded TaskCreate (``defer_loading``), is answered (it was a
400); loading that tool leaves the prompt an extension of turn 3, so the prefix cache serves turn 3's prompt; a
subagent (the same session id, its own ``X-Claude-Code-Agent-Id``) does not take the main agent's session entry."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

AGENTS = Path(__file__).parents[1] / "fixtures" / "agents"
SENT = ("x-claude-code-session-id", "anthropic-beta", "anthropic-version", "user-agent", "x-app")


# the prose of the captured session (its system prompt, system reminders and environment block, tool descriptions)
# is cut to its first PROSE characters: the blocks, roles, tool list, tool_reference and headers stay as Claude Code
# sent them, and every turn's copy of a text gets the same cut, so turn 3 still extends turn 1 and turn 7 turn 3.
# What the test proves does not hang on the prose; its ~1,300 tokens were ~30 s of prefill on the CI CPU.
PROSE = 160


def _cut(text: str) -> str:
    return text[:PROSE]


def _cut_prose(value):
    """Every text block's and string content's text, and every tool's description, cut to PROSE characters."""
    if isinstance(value, list):
        return [_cut_prose(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _cut_prose(v) for k, v in value.items()}
    if out.get("type") == "text" and isinstance(out.get("text"), str):
        out["text"] = _cut(out["text"])
    if isinstance(out.get("content"), str):
        out["content"] = _cut(out["content"])
    if "input_schema" in out and isinstance(out.get("description"), str):  # a tool
        out["description"] = _cut(out["description"])
    return out


def capture(n: int) -> tuple[dict, dict]:
    """(body, headers) of request ``n`` of the captured session: a reply as short as can be, greedy, not streamed;
    the prose cut (PROSE); all else as Claude Code sent it (its model name, claude-opus-4-8, answered through
    ``--model-alias``)."""
    raw = json.loads((AGENTS / f"claude_code_2.1.332_turn{n}.json").read_text())
    body = {**raw["body"], "max_tokens": 2, "temperature": 0, "stream": False}
    for key in ("system", "messages", "tools"):
        body[key] = _cut_prose(body[key])
    return body, {k: v for k, v in raw["headers"].items() if k in SENT}


def post(server, body: dict, headers: dict) -> dict:
    r = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def count(server, body: dict) -> int:
    fields = ("model", "messages", "system", "tools", "thinking", "output_config")
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={k: body[k] for k in fields if k in body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def clear(server) -> None:
    assert httpx.post(server.url + "/admin/cache/clear", timeout=30).status_code == 200


def session_hits(server) -> int:
    return httpx.get(server.url + "/stats", timeout=30).json()["prompt_cache"]["session_hits"]


# SmolLM2's own template ignores tools: this one renders their names first, as real templates render the tool list
# before the conversation (then loading a tool the template shows moves every token after it)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tools_server(default_model_dir, tmp_path_factory):
    """The default model behind a chat template that renders the tool list, answering Claude Code's model names."""
    d = tmp_path_factory.mktemp("tool-list-template")
    for f in Path(default_model_dir).iterdir():
        if f.name != "tokenizer_config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((Path(default_model_dir) / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOLS_TEMPLATE}))
    srv = ServerProc("--model", str(d), "--model-alias", "claude-*", "--cache-bytes", "256M")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_the_session_replays_and_a_tool_loaded_mid_session_keeps_the_cache_hitting(tools_server):
    clear(tools_server)
    (b1, h), (b3, _), (b7, _) = capture(1), capture(3), capture(7)
    p1, p3, p7 = (count(tools_server, b) for b in (b1, b3, b7))
    assert p1 < p3 < p7
    assert post(tools_server, b1, h)["usage"]["cache_read_input_tokens"] == 0
    assert post(tools_server, b3, h)["usage"]["cache_read_input_tokens"] >= p1 - 1  # turn 1's whole prompt
    # turn 7: ToolSearch's tool_reference in a tool result, TaskCreate (defer_loading) now in tools
    message = anthropic.types.Message.model_validate(post(tools_server, b7, h))
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert 1 <= message.usage.output_tokens <= 2
    u = message.usage
    assert p3 - 1 <= u.cache_read_input_tokens < p7  # turn 3's prompt, read: the tool list did not move
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == p7
    # the same request streamed through the SDK, as Claude Code sends it (all of it read now)
    claude = anthropic.Anthropic(base_url=tools_server.url, api_key="unused", max_retries=0, timeout=300)
    fields, extra = ("model", "messages", "system", "tools", "metadata"), ("thinking", "context_management",
                                                                            "output_config", "temperature")
    with claude.messages.stream(max_tokens=2, **{k: b7[k] for k in fields}, extra_headers=h,
                                extra_body={k: b7[k] for k in extra}) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(include={"type", "text"}) for b in final.content] == [
        b.model_dump(include={"type", "text"}) for b in message.content]
    assert final.usage.cache_read_input_tokens == p7 - 1
    # the template does render the tool list: TaskCreate not deferred would be in it, ahead of every message
    eager = {**b7, "tools": [{k: v for k, v in t.items() if k != "defer_loading"} for t in b7["tools"]]}
    assert count(tools_server, eager) > p7


def test_a_subagent_leaves_the_main_agents_session_entry_alone(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    sid = f"cc-{time.time_ns()}"
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": sid})
    kw = dict(model="default", max_tokens=3, extra_body={"temperature": 0}, metadata={"user_id": user_id},
              extra_headers={"x-claude-code-session-id": sid})
    first = [{"role": "user", "content": f"Say hello. ({sid})"}]
    r1 = claude.messages.create(messages=first, **kw)
    sub = [{"role": "user", "content": f"You are a subagent. List the files. ({sid})"}]
    claude.messages.create(messages=sub, **{**kw, "extra_headers": {**kw["extra_headers"],
                                                                   "x-claude-code-agent-id": "a5bee98e0f535f254"}})
    before = session_hits(server)
    reply = "".join(b.text for b in r1.content if b.type == "text")
    follow = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
    r2 = claude.messages.create(messages=follow, **kw)
    # found through the main agent's session entry, which the subagent's request did not re-point
    assert session_hits(server) == before + 1 and r2.usage.cache_read_input_tokens > 0
