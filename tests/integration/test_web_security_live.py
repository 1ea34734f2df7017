"""Host / Origin checks over raw HTTP on a live server (what curl posing as a browser sees), per API front door."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
MESSAGES = json.dumps({"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
RESPONSES = json.dumps({"model": "default", "input": "Hi", "max_output_tokens": 16})
EVIL = {"Origin": "http://evil.example", "Content-Type": "text/plain"}


def test_browser_shaped_requests_refused_in_each_apis_error_shape(server):
    url = server.url
    served = httpx.get(url + "/stats").json()["lane"]["requests_served"]
    r = httpx.post(url + "/v1/chat/completions", content=CHAT, headers=EVIL)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url + "/v1/responses", content=RESPONSES, headers=EVIL)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(url + "/v1/messages", content=MESSAGES, headers=EVIL)
    assert r.status_code == 403 and r.json() == {"type": "error", "error": {
        "type": "permission_error", "message": r.json()["error"]["message"]}, "request_id": None}
    assert "--allowed-origins" in r.json()["error"]["message"]
    r = httpx.get(url + "/stats", headers={"Host": "evil.example:8091"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    r = httpx.request("OPTIONS", url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert httpx.get(url + "/stats").json()["lane"]["requests_served"] == served  # nothing ran


def test_curl_and_sdk_style_requests_still_work(server, client):
    url = server.url
    # curl -d sends form-encoded JSON and no Origin; a loopback Host by name or address
    r = httpx.post(url + "/v1/chat/completions", content=CHAT,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    port = url.rsplit(":", 1)[1]
    assert httpx.get(f"http://localhost:{port}/v1/models").status_code == 200
    assert httpx.get(url + "/stats", headers={"Host": f"localhost:{port}"}).status_code == 200
    out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].message.content is not None
    # the page's own origin (the dashboard) is not cross-origin
    r = httpx.post(url + "/v1/chat/completions", content=CHAT,
                   headers={"Origin": url, "Content-Type": "application/json"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # admin: curl -X POST (no body) works, a simple-type body does not
    assert httpx.post(url + "/admin/cache/clear").status_code == 200
    assert httpx.get(url + "/stats").json()["prompt_cache"]["entries"] == 0
    client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi there"}], max_tokens=2)
    entries = httpx.get(url + "/stats").json()["prompt_cache"]["entries"]
    assert entries >= 1  # this test's own request, stored after the clear
    r = httpx.post(url + "/admin/cache/clear", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_content_type"
    assert httpx.get(url + "/stats").json()["prompt_cache"]["entries"] == entries


@pytest.fixture(scope="module")
def opened(default_model_dir):
    srv = ServerProc("--model", "default", "--cache-bytes", "64M", "--no-dashboard",
                     "--allowed-origins", "https://app.example", "--allowed-hosts", "llm.example.internal")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_allowed_origins_and_hosts_open_the_api_deliberately(opened):
    url = opened.url
    r = httpx.request("OPTIONS", url + "/v1/messages", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-api-key,anthropic-version,content-type"})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-api-key" in r.headers["access-control-allow-headers"]
    r = httpx.post(url + "/v1/messages", content=MESSAGES,
                   headers={"Origin": "https://app.example", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.post(url + "/v1/chat/completions", content=CHAT, headers={"Origin": "https://other.example"})
    assert r.status_code == 403
    r = httpx.post(url + "/admin/cache/clear", headers={"Origin": "https://app.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_admin"
    r = httpx.request("OPTIONS", url + "/admin/cache/clear", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403
    assert httpx.get(url + "/health", headers={"Host": "llm.example.internal"}).status_code == 200
    assert httpx.get(url + "/health", headers={"Host": "evil.example"}).status_code == 403
    assert httpx.get(url + "/").status_code == 404  # --no-dashboard
    assert httpx.get(url + "/dashboard").status_code == 404
