"""What Codex CLI needs of the Responses API (issue 47 item 3), on the real default model through the shared live
server: ``/v1/responses/compact`` through the official ``openai`` client, Responses over a WebSocket through the
client's ``responses.connect()`` and raw frames, and ``previous_response_not_found`` where an id is unknown."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.model

INSTRUCTIONS = "You are a coding agent in a small Python repository. Answer briefly."
SHORT = {"max_output_tokens": 4}  # the summary's length (a real one is up to 1,024 tokens; the model is slow here)
CONVERSATION = [
    {"role": "user", "content": "The test test_parse fails with KeyError: 'name' in parser.py."},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me read parser.py."}]},
    {"role": "user", "content": "It reads config['name'] but the config file calls it 'title'."},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "I will use 'title'."}]},
    {"role": "user", "content": "Good. Now also update the README."},
]


def count(client, items) -> int:
    return client.responses.input_tokens.count(model="default", instructions=INSTRUCTIONS, input=items).input_tokens


def test_compaction_replaces_the_conversation_and_its_next_turn_is_cached(client):
    compacted = client.responses.compact(model="default", instructions=INSTRUCTIONS, input=CONVERSATION,
                                         extra_body=SHORT)
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    output = compacted.to_dict(warnings=False)["output"]
    *kept, capsule = output
    assert capsule["type"] == "compaction" and capsule["encrypted_content"].startswith("mlx-lane.compaction.v1.")
    assert [m["role"] for m in kept] == ["user", "user", "user"]  # the user's words are kept, the rest summarized
    assert compacted.usage.output_tokens > 0 and compacted.usage.input_tokens > count(client, CONVERSATION)
    # the item expands into its summary: it adds to the prompt what the server wrote into it
    assert count(client, output) > count(client, kept)
    nxt = client.responses.create(model="default", instructions=INSTRUCTIONS, max_output_tokens=2, temperature=0,
                                  input=[*output, {"role": "user", "content": "What is left to do?"}])
    # the compacted conversation was cached when it was made: the next turn computes only its own message
    assert nxt.usage.input_tokens_details.cached_tokens >= count(client, output) - 3  # (the generation prompt)


def test_compacting_a_stored_conversation_continues_from_the_compacted_one(client):
    first = client.responses.create(model="default", instructions=INSTRUCTIONS, input=CONVERSATION[:1],
                                    max_output_tokens=4, temperature=0)
    compacted = client.responses.compact(model="default", instructions=INSTRUCTIONS, previous_response_id=first.id,
                                         input=[{"role": "user", "content": "Summarize, then go on."}],
                                         extra_body=SHORT)
    assert compacted.output[-1].type == "compaction"
    after = client.responses.create(model="default", instructions=INSTRUCTIONS, previous_response_id=compacted.id,
                                    input="Go on.", max_output_tokens=2, temperature=0)
    assert after.usage.input_tokens == count(client, [*compacted.to_dict(warnings=False)["output"],
                                                      {"role": "user", "content": "Go on."}])


def test_an_unknown_previous_response_is_previous_response_not_found(client):
    for call in (lambda: client.responses.compact(model="default", previous_response_id="resp_gone", input="hi"),
                 lambda: client.responses.create(model="default", previous_response_id="resp_gone", input="hi")):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert exc.value.body["code"] == "previous_response_not_found"


def test_a_compaction_item_from_another_server_is_a_400(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={"max_output_tokens": 1, "input": [
        {"type": "compaction", "encrypted_content": "gAAAAABpM0Yj-opaque"}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_compaction" and r.json()["error"]["param"] == "input.0.encrypted_content"


def until_done(connection) -> list:
    events = []
    for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events
    raise AssertionError(f"the connection closed after {[e.type for e in events]}")


def test_responses_over_a_websocket_with_the_sdk(client):
    """Codex's WebSocket mode: store false, then only the new input with previous_response_id (the connection keeps
    its responses); an unknown id is an error event the connection survives."""
    with client.responses.connect() as connection:
        connection.response.create(model="default", instructions=INSTRUCTIONS, input=CONVERSATION[0]["content"],
                                   max_output_tokens=6, temperature=0, store=False)
        first = until_done(connection)
        assert [e.type for e in first][:2] == ["response.created", "response.in_progress"]
        done = first[-1].response
        assert first[-1].type in ("response.completed", "response.incomplete") and done.output_text
        assert client.responses.create(model="default", instructions=INSTRUCTIONS, input=CONVERSATION[0]["content"],
                                       max_output_tokens=6, temperature=0).output_text == done.output_text

        connection.response.create(model="default", previous_response_id="resp_unknown", input="hi")
        error = until_done(connection)[-1]
        assert error.type == "error" and error.code == "previous_response_not_found"

        connection.response.create(model="default", instructions=INSTRUCTIONS, previous_response_id=done.id,
                                   input="And then?", max_output_tokens=2, temperature=0, store=False)
        second = until_done(connection)[-1].response
        assert second.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens + 1  # the turn, reused
    with pytest.raises(openai.NotFoundError):  # store false: the connection's own, not the server's store
        client.responses.retrieve(done.id)


def test_raw_frames_errors_and_the_handshake_checks(server):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = server.url.replace("http://", "ws://") + "/v1/responses"
    with connect(url) as ws:
        ws.send(json.dumps({"type": "response.cancel"}))
        error = json.loads(ws.recv(timeout=60))
        assert error["type"] == "error" and error["status"] == 400 and error["param"] == "type"
        assert error["error"]["message"] == error["message"]
        ws.send(json.dumps({"type": "response.create", "input": "Hi", "max_output_tokens": 2, "stream_id": "s1"}))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.incomplete"):
            events.append(json.loads(ws.recv(timeout=120)))
        assert all(e["stream_id"] == "s1" for e in events)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    with pytest.raises(InvalidStatus) as refused:  # a web page's socket: refused like its HTTP requests
        connect(url, origin="http://evil.example").close()
    assert refused.value.response.status_code == 403
