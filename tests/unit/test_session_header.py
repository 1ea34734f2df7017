"""Which header names a request's cache session (the proxy in deploy/ routes on the same ones)."""

from server.prompts import session_header


def test_x_session_id_first_then_codex_session_id_then_none():
    assert session_header({"x-session-id": "a", "session_id": "b"}) == "a"
    assert session_header({"session_id": "b"}) == "b"  # Codex CLI sends session_id
    assert session_header({"x-session-id": "", "session_id": ""}) is None
    assert session_header({}) is None
