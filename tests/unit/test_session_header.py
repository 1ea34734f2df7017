"""Which header names a request's cache session (the proxy in deploy/ routes on the same ones), which body
field takes over when no header does, and how a Claude Code subagent's session is told from its main agent's."""

import json
from pathlib import Path

import pytest
from starlette.datastructures import Headers

from server.http.messages.translate import messages_session
from server.http.wire import session_header, session_of


def test_x_session_id_first_then_codex_session_id_then_none():
    assert session_header({"x-session-id": "a", "session-id": "c", "session_id": "b"}) == "a"
    assert session_header({"session-id": "c", "session_id": "b"}) == "c"  # Codex CLI 0.171 sends session-id
    assert session_header({"session_id": "b"}) == "b"  # older Codex CLIs sent session_id
    assert session_header({"x-session-id": "", "session_id": ""}) is None
    assert session_header({}) is None


def test_the_header_wins_then_the_first_body_field_that_is_set():
    assert session_of({"x-session-id": "h"}, "key", "user") == "h"
    assert session_of({}, "key", "user") == "key"  # prompt_cache_key before user
    assert session_of({}, None, "user") == "user"
    assert session_of({}, "", None) is None


# -- Claude Code: /v1/messages (server.http.messages.translate.messages_session) --------------------------------------
CC_USER_ID = '{"device_id": "d", "account_uuid": "", "session_id": "s-1"}'


@pytest.mark.parametrize("headers,user_id,session", [
    ({}, CC_USER_ID, "s-1"),  # the main agent: metadata.user_id's session_id
    ({"X-Claude-Code-Agent-Id": "a5bee98e"}, CC_USER_ID, "s-1/a5bee98e"),  # a subagent, under the same session_id
    ({"X-Claude-Code-Session-Id": "s-2"}, None, "s-2"),  # the header alone names it too
    ({"X-Claude-Code-Session-Id": "s-2"}, CC_USER_ID, "s-1"),  # (the same value in practice) the body's first
    ({"X-Claude-Code-Session-Id": "s-2", "X-Claude-Code-Agent-Id": "a"}, None, "s-2/a"),
    ({"X-Session-Id": "h", "X-Claude-Code-Agent-Id": "a"}, CC_USER_ID, "h/a"),  # a session header wins, still keyed
    ({"X-Claude-Code-Agent-Id": "a"}, None, None),  # no session to key
    ({"X-Claude-Code-Agent-Id": ""}, CC_USER_ID, "s-1"),
])
def test_a_claude_code_subagent_is_keyed_by_its_agent_id(headers, user_id, session):
    assert messages_session(Headers(headers), user_id) == session


def test_claude_codes_captured_request_names_its_session():
    capture = json.loads((Path(__file__).parents[1] / "fixtures" / "agents" / "claude_code_2.1.332_turn7.json")
                         .read_text())
    main = messages_session(Headers(capture["headers"]), capture["body"]["metadata"]["user_id"])
    assert main == capture["headers"]["x-claude-code-session-id"] == "ae37a63b-9e57-40b8-8a81-dbe92fc826df"
    sub = messages_session(Headers({**capture["headers"], "x-claude-code-agent-id": "a5bee98e0f535f254"}),
                           capture["body"]["metadata"]["user_id"])
    assert sub == main + "/a5bee98e0f535f254"
