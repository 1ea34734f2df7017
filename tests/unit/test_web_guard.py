"""server/http/guard.py: which Host / Origin headers pass, what a preflight gets, how /admin is stricter."""

from __future__ import annotations

import pytest

from server.http.guard import WebPolicy, check_request, cors_headers, is_preflight, preflight_headers, same_origin

LOCAL = WebPolicy.build("127.0.0.1")


@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1:8080", True), ("localhost:8080", True), ("LOCALHOST", True), ("[::1]:8080", True),
    ("127.0.0.2:9", True), ("app.localhost:8080", True), (None, True),
    ("evil.example:8080", False), ("evil.example", False), ("192.168.1.5:8080", False), ("", False),
    ("localhost.evil.example", False), ("127.0.0.1.nip.io:8080", False), ("user@127.0.0.1", False),
])
def test_host_allow_list_defaults(host, ok):
    assert LOCAL.host_allowed(host) is ok


def test_host_allow_list_extended_and_bind_host():
    policy = WebPolicy.build("10.0.0.7", allowed_hosts=["llm.example.internal", ".corp.example"])
    assert policy.host_allowed("10.0.0.7:8080")
    assert policy.host_allowed("llm.example.internal")
    assert policy.host_allowed("a.corp.example:443") and policy.host_allowed("corp.example")
    assert not policy.host_allowed("evilcorp.example")
    assert not policy.host_allowed("10.0.0.8:8080")  # an IP literal that is not ours, on a specific bind
    wild = WebPolicy.build("0.0.0.0")
    assert wild.host_allowed("192.168.1.5:8080") and wild.host_allowed("[fe80::1]:8080")  # IPs cannot be rebound
    assert not wild.host_allowed("evil.example:8080")
    assert WebPolicy.build("127.0.0.1", allowed_hosts=["*"]).host_allowed("evil.example")


@pytest.mark.parametrize("origin, host, same", [
    ("http://127.0.0.1:8080", "127.0.0.1:8080", True),
    ("http://localhost", "localhost:80", True),
    ("https://llm.example.internal", "llm.example.internal", True),
    ("http://127.0.0.1:9000", "127.0.0.1:8080", False),
    ("http://localhost:8080", "127.0.0.1:8080", False),
    ("null", "127.0.0.1:8080", False),
    ("http://127.0.0.1:8080", None, False),
])
def test_same_origin(origin, host, same):
    assert same_origin(origin, host) is same


def _h(**kw):
    return {k.replace("_", "-"): v for k, v in kw.items()}


@pytest.mark.parametrize("method, path, headers, code", [
    ("POST", "/v1/chat/completions", _h(host="127.0.0.1:8080", content_type="text/plain"), None),  # curl, SDKs
    ("POST", "/v1/chat/completions", _h(host="127.0.0.1:8080", origin="http://127.0.0.1:8080"), None),
    ("POST", "/v1/chat/completions", _h(host="127.0.0.1:8080", origin="http://evil.example",
                                        content_type="text/plain"), "origin_not_allowed"),
    ("POST", "/v1/messages", _h(host="127.0.0.1:8080", origin="http://127.0.0.1:9999"), "origin_not_allowed"),
    ("GET", "/stats", _h(host="evil.example:8080"), "host_not_allowed"),
    ("GET", "/health", _h(host="evil.example:8080", origin="http://evil.example:8080"), "host_not_allowed"),
    ("POST", "/admin/cache/clear", _h(host="127.0.0.1:8080"), None),
    ("POST", "/admin/cache/clear", _h(host="127.0.0.1:8080", content_type="application/json"), None),
    ("POST", "/admin/cache/clear", _h(host="127.0.0.1:8080", content_type="text/plain;charset=UTF-8"),
     "admin_content_type"),
    ("POST", "/admin/cache/flush", _h(host="127.0.0.1:8080", content_type="application/x-www-form-urlencoded"),
     "admin_content_type"),
    ("POST", "/admin/cache/clear", _h(host="127.0.0.1:8080", origin="http://evil.example"), "cross_origin_admin"),
    ("POST", "/admin/cache/clear", _h(host="127.0.0.1:8080", sec_fetch_site="cross-site"), "cross_origin_admin"),
])
def test_check_request_defaults(method, path, headers, code):
    refusal = check_request(LOCAL, method, path, headers)
    assert (refusal.code if refusal else None) == code
    if refusal:
        assert "--allowed" in refusal.message or "curl" in refusal.message  # says how to open it / what to use


def test_allowed_origins_open_the_api_but_never_admin():
    policy = WebPolicy.build("127.0.0.1", allowed_origins=["https://chat.example/", "http://127.0.0.1:3000"])
    api = _h(host="127.0.0.1:8080", origin="https://chat.example")
    assert check_request(policy, "POST", "/v1/messages", api) is None
    assert check_request(policy, "POST", "/v1/chat/completions", _h(host="127.0.0.1:8080",
                                                                    origin="http://127.0.0.1:3000")) is None
    assert check_request(policy, "POST", "/v1/chat/completions", _h(host="127.0.0.1:8080",
                                                                    origin="https://other.example")).code == "origin_not_allowed"
    assert check_request(policy, "POST", "/admin/cache/clear", api).code == "cross_origin_admin"
    assert cors_headers(policy, api)["Access-Control-Allow-Origin"] == "https://chat.example"
    assert cors_headers(LOCAL, api) == {}
    assert cors_headers(policy, _h(host="127.0.0.1:8080")) == {}
    star = WebPolicy.build("127.0.0.1", allowed_origins=["*"])
    assert check_request(star, "POST", "/v1/chat/completions", _h(host="127.0.0.1:8080", origin="http://x.example")) is None


def test_preflight():
    policy = WebPolicy.build("127.0.0.1", allowed_origins=["https://chat.example"])
    ask = _h(host="127.0.0.1:8080", origin="https://chat.example", access_control_request_method="POST",
             access_control_request_headers="authorization,content-type")
    assert is_preflight("OPTIONS", ask) and not is_preflight("POST", ask)
    allow = preflight_headers(policy, ask, "/v1/chat/completions")
    assert allow["Access-Control-Allow-Origin"] == "https://chat.example"
    assert allow["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert "POST" in allow["Access-Control-Allow-Methods"]
    assert preflight_headers(policy, ask, "/admin/cache/clear") is None
    assert preflight_headers(LOCAL, ask, "/v1/chat/completions") is None
    assert "*" not in (preflight_headers(WebPolicy.build("127.0.0.1", allowed_origins=["*"]), ask, "/v1/models")
                       ["Access-Control-Allow-Origin"])  # the origin is echoed, never a wildcard
