"""Each door's response builders against the published API schemas (tests/conformance.py), without a model: every
kind of body and event they can write, the rare ones included (reasoning, custom tool and tool search calls, a
failed response, errors of every status). And the checks themselves: a rejection names the door, the path in the
body and the schema's rule; the recorder puts split SSE events back together."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.errors import (
    APIError, AuthenticationError, ContextLengthExceeded, InvalidRequest, ModelNotFound, PayloadTooLarge, QueueFull,
    ShuttingDown,
)
from server.http.chat.format import ChatFormatter, CompletionFormatter
from server.http.error_shapes import shaped_error_body
from server.http.messages.format import MessagesStream, message_object
from server.http.responses.format import ResponsesStream, response_base, response_object
from server.http.responses.schemas import ResponsesRequest
from server.http.responses.translate import ToolIndex, output_to_items
from server.lane.events import Finished, SamplingParams, TokenLogprob
from tests.conformance import check_body, check_event
from tests.recorder import Records, record_app

CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
PATCH = {"id": "call_p", "type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin Patch"}}
SEARCH = {"id": "call_s", "type": "function", "function": {"name": "tool_search", "arguments": '{"query": "git"}'}}
LP = [TokenLogprob("Hi", -0.1, [72, 105], (("Hi", -0.1, [72, 105]), ("Hey", -2.5, [72, 101, 121])))]
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
                                                         "definition": "start: /.+/"}},
    {"type": "namespace", "name": "git", "tools": [{"type": "function", "name": "status"}]},
    {"type": "tool_search"},
]


def finished(reason="stop") -> Finished:
    return Finished(reason, 20, 5, 12, 8, 0.1, 4, 0.2, 0.0, cache_write_tokens=8)


def assert_body(path: str, obj: dict, status: int = 200, method: str = "POST") -> None:
    door, problems = check_body(method, path, status, "application/json", json.dumps(obj).encode())
    assert door is not None and not problems, "\n".join(problems)


def assert_events(path: str, frames: list[bytes]) -> int:
    """Every SSE event of ``frames`` valid; how many there were."""
    n = 0
    for frame in b"".join(frames).decode().split("\n\n"):
        lines = frame.split("\n")
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = "\n".join(ln[6:] for ln in lines if ln.startswith("data: "))
        if data and data != "[DONE]":
            door, problems = check_event("POST", path, 200, name, data)
            assert door is not None and not problems, "\n".join(problems)
            n += 1
    return n


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_chat_bodies_and_chunks():
    fmt = ChatFormatter(model="m", fingerprint="fp_1")
    for text, calls, reasoning, logprobs in (("Hi", [], "", None), ("", [CALL], "", None), ("Hi", [CALL], "hmm", LP),
                                             ("Hi", [], "", [])):
        assert_body("/v1/chat/completions", fmt.completion(text, calls, logprobs, "stop", finished(),
                                                           reasoning=reasoning))
    chunks = [fmt.role_chunk(), fmt.reasoning_chunk("hmm", []), fmt.content_chunk("Hi", LP),
              fmt.content_chunk("!", []), fmt.tool_calls_chunk([CALL]), fmt.finish_chunk("tool_calls"),
              fmt.usage_chunk(finished())]
    assert assert_events("/v1/chat/completions", [sse(c) for c in chunks]) == 7


def test_completion_bodies_and_chunks():
    fmt = CompletionFormatter(model="m", fingerprint="fp_1")
    assert_body("/v1/completions", fmt.completion(" Paris", LP, "length", finished()))
    assert_body("/v1/completions", fmt.completion(" Paris", None, "stop", finished()))
    chunks = [fmt.text_chunk(" Pa", LP, 0), fmt.text_chunk("ris", [], 3), fmt.finish_chunk("stop"),
              fmt.usage_chunk(finished())]
    assert assert_events("/v1/completions", [sse(c) for c in chunks]) == 4


def request(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "x", "tools": TOOLS, **kw})


@pytest.mark.parametrize("kw", [{}, {"max_output_tokens": 9, "user": "u1", "safety_identifier": "s1",
                                     "prompt_cache_key": "k", "presence_penalty": 0.5, "tool_choice": "required",
                                     "text": {"format": {"type": "json_schema", "name": "t",
                                                         "schema": {"type": "object"}}}},
                                {"tool_choice": {"type": "function", "name": "get_weather"},
                                 "reasoning": {"effort": "minimal"}},
                                {"tool_choice": {"type": "custom", "name": "apply_patch"}}])
def test_response_objects(kw):
    base = response_base(request(**kw), "resp_1", "m")
    tools = ToolIndex({"status": "git"}, frozenset({"tool_search"}))
    status_call = {"id": "call_g", "type": "function", "function": {"name": "status", "arguments": "{}"}}
    output = output_to_items("Hi", "hmm", [CALL, PATCH, SEARCH, status_call], tools=tools)
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call", "custom_tool_call",
                                           "tool_search_call", "function_call"]
    for status in ("completed", "incomplete"):
        assert_body("/v1/responses", response_object(base, output, status, finished=finished(), reasoning_tokens=2))
    assert_body("/v1/responses", response_object(base, [], "failed", error=QueueFull("busy")))
    assert_body("/v1/responses", response_object(base, [], "in_progress"))
    done = response_object(base, output, "completed", finished=finished())
    assert done["completed_at"] >= done["created_at"]
    assert response_object(base, output, "incomplete", finished=finished())["completed_at"] is None
    echo = {t["type"]: t for t in done["tools"]}
    assert echo["function"] == {**TOOLS[0], "description": None, "strict": None}  # as sent, nulls for the rest
    assert echo["custom"] == TOOLS[1] and echo["namespace"]["description"] == ""


def test_a_response_echoes_the_sampling_it_ran_with():
    """The model's defaults (generation_config) fill what the request left out: the echo says what was used."""
    used = SamplingParams(max_tokens=9, temperature=0.6, top_p=0.95, presence_penalty=0.5)
    base = response_base(request(temperature=None), "resp_1", "m", used)
    assert (base["temperature"], base["top_p"], base["presence_penalty"], base["frequency_penalty"]) == (
        0.6, 0.95, 0.5, 0.0)
    assert response_base(request(temperature=0.2), "resp_1", "m")["temperature"] == 0.2  # no params: the request's
    assert_body("/v1/responses", response_object(base, [], "completed", finished=finished()))


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_response_streams(reason):
    fmt = ResponsesStream(response_base(request(), "resp_1", "m"), ToolIndex({}, frozenset({"tool_search"})))
    frames = fmt.start() + fmt.reasoning("hmm") + fmt.text("Hi") + fmt.calls([CALL, PATCH, SEARCH])
    closing, _ = fmt.finish(finished(reason), reason)
    assert assert_events("/v1/responses", frames + closing) > 15
    assert assert_events("/v1/responses", ResponsesStream(response_base(request(), "r", "m")).fail(APIError("x")))
    assert assert_events("/v1/responses", ResponsesStream.error_event(ModelNotFound("no such model"))) == 1


def test_message_objects_and_streams():
    for text, reasoning, calls, reason, stop in (("Hi", "", [], "stop", None), ("", "hmm", [CALL], "tool_calls", None),
                                                 ("Hi", "", [], "stop", "END"), ("Hi", "", [], "length", None)):
        assert_body("/v1/messages", message_object("msg_1", "m", text, reasoning, calls, reason, stop, finished(),
                                                   12, thinking_tokens=1))
    fmt = MessagesStream("msg_1", "m", 20, last_breakpoint=12)
    frames = fmt.start() + fmt.thinking("hmm") + fmt.text("Hi") + fmt.finish([CALL], "tool_calls", None, finished(),
                                                                             thinking_tokens=2)
    assert assert_events("/v1/messages", frames) == 13  # start, ping, 3 x (block start, delta, stop), delta, stop
    assert assert_events("/v1/messages", MessagesStream.error_event(QueueFull("busy"))) == 1


@pytest.mark.parametrize("err", [InvalidRequest("bad", param="messages"), ContextLengthExceeded("long"),
                                 AuthenticationError("key"), ModelNotFound("no"), PayloadTooLarge("big"),
                                 QueueFull("busy"), ShuttingDown("bye"), APIError("oops")])
def test_error_bodies_of_every_api(err):
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/embeddings", "/v1/models/x"):
        assert_body(path, shaped_error_body(path, err), status=err.status_code)


def test_a_rejection_names_the_door_the_path_and_the_rule():
    body = ChatFormatter(model="m", fingerprint="fp").completion("Hi", [], None, "stop", finished())
    del body["choices"][0]["message"]["refusal"]
    door, [problem] = check_body("POST", "/v1/chat/completions", 200, "application/json", json.dumps(body).encode())
    assert door == "chat"
    assert problem.startswith("chat: POST /v1/chat/completions -> 200: $.choices[0].message: 'refusal' is a required")
    assert "[openai CreateChatCompletionResponse: 'required' at" in problem
    # inside a union, the branch the body meant (its type tag) is followed: the missing field is named
    block = message_object("msg_1", "m", "Hi", "", [CALL], "tool_calls", None, finished())
    del block["content"][1]["caller"]
    _, [problem] = check_body("POST", "/v1/messages", 200, "application/json", json.dumps(block).encode())
    assert "$.content[1]: 'caller' is a required property" in problem
    # events: a name that differs from the data's type, an unknown type, data that is not JSON
    _, problems = check_event("POST", "/v1/messages", 200, "message_stop", '{"type": "ping"}')
    assert problems == ["messages: POST /v1/messages event ping: SSE event name 'message_stop' differs from its "
                        "data's type 'ping'"]
    _, [problem] = check_event("POST", "/v1/responses", 200, None, '{"type": "response.made_up"}')
    assert "no published event has the type 'response.made_up'" in problem
    _, [problem] = check_event("POST", "/v1/chat/completions", 200, None, "{not json")
    assert "the data is not JSON" in problem
    # an error body in the wrong API's shape
    _, [problem] = check_body("POST", "/v1/messages", 404, "application/json",
                              json.dumps(ModelNotFound("no").body()).encode())
    assert problem.startswith("errors: POST /v1/messages -> 404: $: ") and "anthropic ErrorResponse" in problem
    # paths outside the published APIs are not checked
    assert check_body("GET", "/stats", 200, "application/json", b"{}") == (None, [])


def test_the_recorder_round_trip(tmp_path):
    """record_app around an app that streams an event split over two chunks, then a bad JSON body: the drain
    checks each once complete."""
    good = ChatFormatter(model="m", fingerprint="fp").role_chunk()
    bad = {"object": "list"}  # a models list without data

    async def app(scope, receive, send):
        if scope["path"] == "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            frame = sse(good)
            await send({"type": "http.response.body", "body": frame[:10], "more_body": True})
            await send({"type": "http.response.body", "body": frame[10:] + b"data: [DONE]\n\n", "more_body": False})
        else:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps(bad).encode()})

    async def noop(message=None):
        return {"type": "http.disconnect"}

    recorded, records = record_app(app, str(tmp_path)), Records(str(tmp_path))
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health")):
        asyncio.run(recorded({"type": "http", "method": method, "path": path}, noop, noop))
    problems = records.drain()
    assert records.checked == {"chat": 1, "models": 1}
    assert problems == ["models: GET /v1/models -> 200: $: 'data' is a required property "
                        "[openai ListModelsResponse: 'required' at required]"]
    assert records.drain() == []  # each line is read once
