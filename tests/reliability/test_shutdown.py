"""SIGTERM with streams in flight, behind a real uvicorn, on a tiny random llama with the default model's tokenizer
(the ``tiny_llama_dir`` fixture, tests/conftest.py: what is checked is the drain and the flush, not the text).

MLX_LANE_TEST_TOKEN_DELAY (a test seam, tests/seamed_server.py) makes the lane pause after every token, so the streams
are surely still running when the signal lands, on a fast machine too. Nothing here measures time: the seam only
sets up the situation; the assertions are about what each client received and what survived on disk.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.reliability.streams import start_stream
from tests.fixtures.tiny_models import MECHANICS_FLAGS
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a careful assistant for a software engineering team."}
QUESTIONS = ["What is a mutex?", "What is a deadlock?", "What is a race condition?"]


def conversation(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


def wait_for_log(srv: ServerProc, text: str, bound_s: float = 60.0) -> None:
    """Wait (bounded, not a timing assertion) until the server logged `text`."""
    deadline = time.monotonic() + bound_s
    while text not in srv.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the server never logged {text!r}:\n{srv.log()}"
        time.sleep(0.05)


def wait_for_lane(url: str, running: int, queued: int = 0, bound_s: float = 180.0) -> None:
    """Wait (bounded) until `running` jobs are admitted to the lane (the batch) and `queued` more wait for room."""
    deadline = time.monotonic() + bound_s
    while True:
        lane = httpx.get(url + "/stats").json()["lane"]
        if lane["queue_depth"] == queued and len(lane["running_requests"]) == running:
            return
        assert time.monotonic() < deadline, f"the lane never held {running} + {queued} jobs: {lane}"
        time.sleep(0.05)


def sigterm_mid_stream(srv: ServerProc, streams, running: int, queued: int = 0) -> None:
    """SIGTERM once a stream has its first token, `running` jobs are in the lane and `queued` wait; all streams
    must be in flight."""
    wait_for_lane(srv.url, running, queued)
    deadline = time.monotonic() + 180
    while not any(s.text for s in streams):
        assert time.monotonic() < deadline, f"no stream got a token:\n{srv.log()}"
        time.sleep(0.02)
    in_flight = [not s.ended.is_set() for s in streams]
    assert all(in_flight), f"a stream ended before SIGTERM, nothing in flight to test: {in_flight}"
    srv.proc.send_signal(signal.SIGTERM)


def test_sigterm_lets_in_flight_streams_finish_then_flushes_them_to_ssd(tmp_path, tiny_llama_dir):
    kv = tmp_path / "kv"
    # a debounce longer than the test: only the shutdown flush can make these entries durable
    srv = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--ssd-cache", str(kv),
                     "--write-behind-debounce", "600", "--shutdown-timeout", "300",
                     env={"MLX_LANE_TEST_TOKEN_DELAY": "0.25"})
    try:
        streams = [start_stream(srv.url, conversation(q), max_tokens=8) for q in QUESTIONS]
        sigterm_mid_stream(srv, streams, running=3)  # the three streams generate together, in one batch
        wait_for_log(srv, "shutdown: letting 3 queued or running requests finish")
        try:  # a new request: the listener is closed (refused) or the lane turns it away with a 503
            late = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                              json={"messages": conversation("Hello?"), "max_tokens": 4})
        except httpx.TransportError:
            pass
        else:
            assert late.status_code == 503, late.text
            assert late.json()["error"]["code"] == "server_shutting_down"
        for s in streams:
            assert s.ended.wait(300), f"a stream never ended:\n{srv.log()}"
        code = srv.proc.wait(120)
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert code == 0, log
    for s in streams:
        assert s.transport_error is None and s.status == 200, (s.transport_error, log)
        assert s.done and s.errors == [], s.data
        assert len(s.finish_reasons) == 1 and s.finish_reasons[0] in ("length", "stop"), s.data
        assert s.text
    assert "ssd cache flushed: every cache entry is durable" in log
    assert list(kv.rglob("*.tmp")) == [] and len(list(kv.rglob("*.safetensors"))) >= len(QUESTIONS)

    again = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--ssd-cache", str(kv))
    try:
        for q, s in zip(QUESTIONS, streams):
            r = httpx.post(again.url + "/v1/chat/completions", timeout=300,
                           json={"messages": conversation(q), "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            obj = r.json()
            assert obj["usage"]["prompt_tokens_details"]["cached_tokens"] == obj["usage"]["prompt_tokens"] - 1
            assert obj["choices"][0]["message"]["content"] == s.text  # greedy: the same text, now from disk
        ssd = httpx.get(again.url + "/stats").json()["ssd_cache"]
        assert ssd["ssd_hits"] >= 1 and ssd["removed_at_scan"] == 0 and ssd["failed"] == 0
    finally:
        assert again.stop() == 0, again.log()


def test_sigterm_past_the_shutdown_timeout_ends_every_response_well_formed(tiny_llama_dir):
    # 16 tokens at >= 1 s each cannot fit in a 2 s drain: the timeout path is certain, whatever the machine.
    # --max-batch 2: the two streams fill the lane, so the plain request waits in the queue
    srv = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--shutdown-timeout", "2", "--max-batch", "2",
                     env={"MLX_LANE_TEST_TOKEN_DELAY": "1.0"})
    try:
        streams = [start_stream(srv.url, conversation(q), max_tokens=16) for q in QUESTIONS[:2]]
        wait_for_lane(srv.url, running=2)  # both streams are in the lane before the plain request is sent
        # queued behind the two streams: a non-streaming request that will not get its turn
        plain: dict = {}

        def post_plain() -> None:
            try:
                plain["r"] = httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                                        json={"messages": conversation(QUESTIONS[2]), "max_tokens": 16})
            except httpx.HTTPError as exc:
                plain["error"] = exc

        t = threading.Thread(target=post_plain, daemon=True)
        t.start()
        sigterm_mid_stream(srv, streams, running=2, queued=1)  # two streams generate; the plain request waits
        for s in streams:
            assert s.ended.wait(120), f"a stream never ended:\n{srv.log()}"
        t.join(120)
        code = srv.proc.wait(120)
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert code == 0, log
    for s in streams:
        assert s.transport_error is None and s.status == 200, (s.transport_error, log)
        assert s.done, f"no [DONE]: {s.data}"  # a well-formed end, not a cut connection
        assert s.finish_reasons == [], s.data
        assert [e["code"] for e in s.errors] == ["server_shutting_down"], s.data
        assert s.errors[0]["type"] == "server_error" and s.errors[0]["message"]
    assert all(s.text for s in streams)  # both were generating, together, and were cut mid-answer
    assert "--shutdown-timeout (2s) expired; ending 3 requests" in log
    assert "error" not in plain, plain
    r = plain["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    assert r.headers["retry-after"] == "5"

