"""Which header names a request's cache session (the proxy in deploy/ routes on the same ones), and which body
field takes over when no header does."""

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
