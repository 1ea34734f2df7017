"""Every documented error is an OpenAI error body with the right status; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.model

MSG = [{"role": "user", "content": "hi"}]


def post(server, body, path="/v1/chat/completions", **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=120, **kw)


def assert_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert "Traceback" not in r.text and "/work/" not in r.text
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "body,param",
    [
        (b"{not json", None),
        (b"\xff\xfe{}", None),
        (b"[1, 2]", None),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, None),
        ({"messages": [{"role": "user"}]}, None),
        ({"messages": [{"role": "user", "content": 5}]}, None),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "max_tokens": -5}, "max_tokens"),
        ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
        ({"messages": MSG, "temperature": 5}, "temperature"),
        ({"messages": MSG, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": MSG, "n": 2}, "n"),
        ({"messages": MSG, "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": MSG, "tool_choice": "always"}, "tool_choice"),
        ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": MSG, "stop": ["a"] * 40}, "stop"),
    ],
)
def test_bad_requests_are_400(server, body, param):
    err = assert_error(post(server, body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_n_and_response_format_messages_say_why(server):
    assert "n=1" in assert_error(post(server, {"messages": MSG, "n": 3}), 400)["message"]
    msg = assert_error(post(server, {"messages": MSG, "response_format": {"type": "yaml"}}), 400)["message"]
    assert "not supported" in msg and "json_schema" in msg


def test_context_length_exceeded(server):
    long = "word " * 9000
    assert_error(post(server, {"messages": [{"role": "user", "content": long}]}), 400, code="context_length_exceeded")
    assert_error(post(server, {"messages": MSG, "max_tokens": 10**9}), 400, code="context_length_exceeded")


def test_unknown_model_is_404(server):
    assert_error(post(server, {"model": "gpt-17", "messages": MSG}), 404, code="model_not_found")
    # a path never selects a model
    assert_error(post(server, {"model": "/etc/passwd", "messages": MSG}), 404, code="model_not_found")


def test_unknown_route_is_openai_404(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert_error(r, 404)


def test_completion_token_ids_out_of_vocab(server):
    assert_error(post(server, {"prompt": [1, 2, 10**7]}, path="/v1/completions"), 400, param="prompt")


@pytest.mark.parametrize("prompt", [5, [[1, 2]], {"text": "hi"}, [1, None]])
def test_completion_prompt_of_no_accepted_form_says_which_forms_are(server, prompt):
    err = assert_error(post(server, {"prompt": prompt, "max_tokens": 1}, path="/v1/completions"), 400, param="prompt")
    assert "list of token ids" in err["message"] and "string" in err["message"]


def test_the_lane_runs_16_requests_at_once_on_the_cpu_by_default(server):
    lane = httpx.get(server.url + "/stats").json()["lane"]
    assert lane["max_batch"] == 16  # the CPU default (BENCHMARKS.md: 16 agents x 2 turns, --max-batch 8 vs 16)


def test_server_still_serves_after_errors(server):
    r = post(server, {"messages": MSG, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] in (1, 2) and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert isinstance(body["choices"][0]["message"]["content"], str)
    by_status = httpx.get(server.url + "/stats").json()["http"]["by_status"]
    assert not [s for s in by_status if s.startswith("5")], by_status  # none of the errors above was a 500
