"""A GPU error CUDA never recovers from (an illegal memory access: what an H100 out of memory led to), behind a real
uvicorn on a tiny random llama with the default model's tokenizer (``tiny_llama_dir``, tests/conftest.py).
MLX_LANE_DEVICE_LOSS_MARKER (a test seam, tests/seamed_server.py) makes one prompt's admission raise the error MLX
raised there; MLX_LANE_TEST_TOKEN_DELAY keeps another stream in flight meanwhile. Expected: every request in the lane
ends with a 503 ``device_lost`` that says to restart (a stream with an
error event and ``[DONE]``), and the process exits with status 3 for its supervisor to start it again. An
out-of-memory alone (MLX_LANE_OOM_MARKER: a prompt's first prefill raises it) is not that: the prompt goes back to
the queue and its request is served, with the text the same request gets from the cache afterwards."""

from __future__ import annotations

import httpx
import pytest

from server.lane.device_loss import EXIT_CODE
from tests.reliability.streams import start_stream
from tests.fixtures.tiny_models import MECHANICS_FLAGS
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

MARKER = "GPU-GONE-5521"


def test_a_lost_gpu_ends_every_request_with_a_503_and_the_server_exits_for_a_restart(tiny_llama_dir):
    srv = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--shutdown-timeout", "5",
                     env={"MLX_LANE_DEVICE_LOSS_MARKER": MARKER, "MLX_LANE_TEST_TOKEN_DELAY": "0.2"})
    try:
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                        json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
        assert ok.status_code == 200, ok.text  # the device is fine until the fault
        # a stream that is surely still generating when the device is lost (40 tokens at >= 0.2 s each)
        stream = start_stream(srv.url, [{"role": "user", "content": "Count to a hundred."}], max_tokens=40,
                              logit_bias={"2": -100, "0": -100})  # (the default model's two EOS ids: no early stop)
        assert stream.first_token.wait(120) and stream.text, srv.log()
        lost = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": f"Echo {MARKER}."}], "max_tokens": 4})
        assert lost.status_code == 503, lost.text
        error = lost.json()["error"]
        assert error["code"] == "device_lost" and "illegal memory access" in error["message"]
        assert "restart" in error["message"]
        assert stream.ended.wait(120), srv.log()
        # the other request: an error event of the same kind, then [DONE]; never a cut connection
        assert stream.transport_error is None and stream.status == 200, stream.transport_error
        assert [e["code"] for e in stream.errors] == ["device_lost"] and stream.done, stream.data
        code = srv.proc.wait(120)
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert code == EXIT_CODE == 3, log
    assert "the GPU is lost to this process" in log and f"exiting with status {EXIT_CODE}" in log


def test_a_prefill_out_of_memory_is_retried_and_the_request_served(tiny_llama_dir):
    srv = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, env={"MLX_LANE_OOM_MARKER": "MEM-TIGHT-8090"})
    try:
        body = {"messages": [{"role": "user", "content": "Repeat MEM-TIGHT-8090 twice."}], "max_tokens": 4,
                "temperature": 0}
        first = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        again = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert first.json()["choices"][0]["message"]["content"] == again.json()["choices"][0]["message"]["content"]
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        assert "ran out of memory in its prefill: back to the queue" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
