"""Lane behaviour on the real model: disconnects cancel, failures are 500s, auth, tool prompts, the warm-up behind
the requests or before ready."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

MSG = [{"role": "user", "content": "Write a very long essay about the history of computing."}]


def wait_for(predicate, timeout=60.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def test_client_disconnect_cancels_and_frees_the_lane(server):
    before = httpx.get(server.url + "/stats").json()["lane"]
    body = {"messages": MSG, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= 4:
                    break  # leaving the block closes the connection mid-stream
    assert seen >= 4

    def cancelled():
        lane = httpx.get(server.url + "/stats").json()["lane"]
        return lane["active_request"] is None and lane["requests_cancelled"] > before["requests_cancelled"]

    assert wait_for(cancelled), httpx.get(server.url + "/stats").json()
    after = httpx.get(server.url + "/stats").json()["lane"]
    # far fewer tokens than asked were generated: the lane stopped within a step or so
    assert after["completion_tokens"] - before["completion_tokens"] < 400
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=120)
    assert r.status_code == 200


def test_non_streaming_disconnect_also_cancels(server):
    stats = httpx.get(server.url + "/stats").json()
    before, statuses = stats["lane"]["requests_cancelled"], stats["http"]["by_status"]
    body = {"messages": MSG, "max_tokens": 4000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=3)
    assert wait_for(lambda: httpx.get(server.url + "/stats").json()["lane"]["requests_cancelled"] > before)
    # the answer nobody reads is counted as the client's leaving (499), never as a server error (500)
    after = wait_for(lambda: (lambda s: s if s.get("499", 0) > statuses.get("499", 0) else None)(
        httpx.get(server.url + "/stats").json()["http"]["by_status"]))
    assert after and after.get("500", 0) == statuses.get("500", 0), (statuses, after)


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tools_template_server(default_model_dir, tmp_path_factory):
    """The default model behind a chat template that renders the tool names (SmolLM2's own ignores tools)."""
    d = tmp_path_factory.mktemp("tools-template-model")
    for f in Path(default_model_dir).iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((Path(default_model_dir) / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    (d / "tokenizer_config.json").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    # --warm-up before-ready: this start also serves test_before_ready_is_warm_at_the_first_health
    srv = ServerProc("--model", str(d), "--cache-bytes", "64M", "--warm-up", "before-ready")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_before_ready_is_warm_at_the_first_health(tools_template_server):
    """The old order: every warm-up step ran before the port opened, and the start-up timeline says so."""
    assert httpx.get(tools_template_server.url + "/health").json()["warm"] is True
    stats = httpx.get(tools_template_server.url + "/stats").json()
    warm = stats["lane"]["warm_up"]
    assert (warm["mode"], warm["state"]) == ("before-ready", "done") and warm["steps_done"] == warm["steps"] > 0
    assert "warm-up" in stats["startup"]["phases"]


def test_tools_reach_the_chat_template(tools_template_server):
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from openai import OpenAI

    from models import ensure_default_model

    client = OpenAI(base_url=tools_template_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    with_tools = client.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=2,
                                                temperature=0)
    none = client.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="none",
                                          max_tokens=2, temperature=0)
    tok = load_tokenizer(Path(ensure_default_model(progress=False)))
    tools_part = len(tok.encode("<|im_start|>system\nTools: get_weather<|im_end|>\n"))
    # the template rendered the tool's name: exactly that many more prompt tokens; tool_choice "none" hides them
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens + tools_part
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_tool_and_assistant_tool_call_messages_are_accepted(client):
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from models import ensure_default_model

    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=0)
    alone = client.chat.completions.create(model="default", messages=msgs[:1], max_tokens=4, temperature=0)
    # the call and its result are in the prompt, as the model's own chat template renders them (arguments as JSON)
    tok = load_tokenizer(Path(ensure_default_model(progress=False)))
    rendered = [msgs[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        msgs[2]]
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(rendered, add_generation_prompt=True))
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + len(tok.encode("18C and sunny"))
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def guarded_server(default_model_dir):
    srv = ServerProc("--model", "default", "--api-key", "s3cret", "--cache-bytes", "64M", "--warm-up", "behind",
                     "--debug-cuda-profile-steps", "2:3", env={"MLX_LANE_FAULT_MARKER": "KABOOM-7731"})
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/stats", "GET"), ("/metrics", "GET"),
                                         ("/v1/chat/completions", "POST"), ("/admin/cache/clear", "POST")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "s3cret", "Basic s3cret"])
def test_api_key_required_everywhere_but_health(guarded_server, path, method, auth):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(method, guarded_server.url + path, headers=headers, json={}, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_api_key_accepted_and_health_open(guarded_server):
    assert httpx.get(guarded_server.url + "/health").status_code == 200
    r = httpx.get(guarded_server.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200


def test_ready_first_and_warm_after(guarded_server):
    """--warm-up behind (the default): /health answers and a first request is served whatever the warm-up's state;
    the warm-up then finishes behind the requests, and the start-up timeline claims none of its seconds."""
    h = {"Authorization": "Bearer s3cret"}
    assert httpx.get(guarded_server.url + "/health").json()["status"] == "ok"
    before = httpx.get(guarded_server.url + "/stats", headers=h).json()["lane"]["warm_up"]
    assert before["mode"] == "behind" and before["state"] in ("pending", "running", "done"), before
    r = httpx.post(guarded_server.url + "/v1/chat/completions", headers=h, timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1

    def warm_up():
        block = httpx.get(guarded_server.url + "/stats", headers=h).json()["lane"]["warm_up"]
        return block if block["state"] == "done" else None

    warm = wait_for(warm_up, timeout=120)
    assert warm, httpx.get(guarded_server.url + "/stats", headers=h).json()["lane"]["warm_up"]
    assert warm["steps_done"] == warm["steps"] > 0 and warm["seconds"] >= 0
    assert httpx.get(guarded_server.url + "/health").json()["warm"] is True
    phases = httpx.get(guarded_server.url + "/stats", headers=h).json()["startup"]["phases"]
    assert "warm-up" not in phases and "lane thread" in phases


def test_failure_inside_generation_is_500_and_lane_survives(guarded_server):
    h = {"Authorization": "Bearer s3cret"}
    bad = {"messages": [{"role": "user", "content": "please KABOOM-7731 now"}], "max_tokens": 4}
    r = httpx.post(guarded_server.url + "/v1/chat/completions", json=bad, headers=h, timeout=120)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "Traceback" not in r.text and "injected" not in r.text
    with httpx.stream("POST", guarded_server.url + "/v1/chat/completions", json=dict(bad, stream=True),
                      headers=h, timeout=120) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert any('"error"' in ln for ln in lines) and lines[-1] == "data: [DONE]"
    ok = httpx.post(guarded_server.url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, headers=h, timeout=120)
    assert ok.status_code == 200
    stats = httpx.get(guarded_server.url + "/stats", headers=h).json()
    assert stats["lane"]["requests_failed"] == 2


def test_metrics_exposes_vllm_style_names(guarded_server):
    h = {"Authorization": "Bearer s3cret"}
    httpx.post(guarded_server.url + "/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}, headers=h, timeout=120)
    text = httpx.get(guarded_server.url + "/metrics", headers=h).text
    for name in ["mlx_lane:prefix_cache_queries_total", "mlx_lane:prefix_cache_hits_total",
                 "mlx_lane:time_to_first_token_seconds_bucket", "mlx_lane:e2e_request_latency_seconds_count",
                 "mlx_lane:prompt_tokens_total", "mlx_lane:generation_tokens_total"]:
        assert name in text, name


def test_a_profiled_range_of_batch_steps_runs_and_the_answers_stay_whole(guarded_server):
    """--debug-cuda-profile-steps 2:3 on the real model: concurrent requests decode in one batch, the lane brackets
    its 2nd and 3rd batch steps (no CUDA driver here: cuProfilerStart answers 'unavailable') and every request still
    gets all its tokens."""
    from concurrent.futures import ThreadPoolExecutor

    h = {"Authorization": "Bearer s3cret"}

    def ask(i: int):
        # 12 tokens (was 24): the three rows still decode together for many more batch steps than the 3 profiled
        body = {"messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}], "max_tokens": 12,
                "temperature": 0}
        return httpx.post(guarded_server.url + "/v1/chat/completions", json=body, headers=h, timeout=120)

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, range(3)))
    assert [r.status_code for r in answers] == [200] * 3
    assert all(r.json()["choices"][0]["message"]["content"] for r in answers)
    assert wait_for(lambda: "batch steps 2..3 done" in guarded_server.log(), timeout=30), guarded_server.log()
    log = guarded_server.log()
    assert "CUDA profiler range: batch steps 2..3 begin (cuProfilerStart unavailable)" in log
    assert log.count("CUDA profiler range") == 2  # one range, once


def test_kernel_warmers_run_beside_the_first_start_and_not_after_a_restart(tmp_path, default_model_dir):
    """--kernel-warmers 2 (on a GPU 'auto' starts them; here they are named): two helper processes run the warm-up's
    chains on the model's thin prefix of layers while the server starts; the server's own warm-up waits for them,
    then runs; a request is served meanwhile; each chain leaves its marker in the kernel cache, so the next start on
    the same home starts none and says why."""
    env = {"MLX_LANE_HOME": str(tmp_path / "home")}
    args = ("--model", str(default_model_dir), "--cache-bytes", "64M", "--warm-up", "behind", "--kernel-warmers", "2")
    srv = ServerProc(*args, env=env)
    try:
        first = httpx.get(srv.url + "/stats").json()["startup"]["kernel_warmers"]
        assert first["processes"] == 2 and "not in the kernel cache" in first["why"], first
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

        def settled():
            stats = httpx.get(srv.url + "/stats").json()
            done = all(w["state"] == "done" for w in stats["startup"]["kernel_warmers"]["warmers"])
            return stats if done and stats["lane"]["warm_up"]["state"] == "done" else None

        stats = wait_for(settled, timeout=180)
        assert stats, httpx.get(srv.url + "/stats").json()
        warmers = stats["startup"]["kernel_warmers"]["warmers"]
        assert sorted(c for w in warmers for c in w["chains"]) == sorted(
            ["prefill", "sampling", "batched step", "batched prefill", "past a cache"])
        assert all(w["layers"] == 1 for w in warmers)  # SmolLM2's layers are all alike: a prefix of one
        assert any("prefill chunk 1" in w["steps"] for w in warmers)
    finally:
        assert srv.stop() == 0, srv.log()
    markers = list((tmp_path / "home" / "ptx").glob("*/*/warmed/*/*"))
    assert sorted(p.name for p in markers) == sorted(["prefill", "sampling", "batched step", "batched prefill",
                                                      "past a cache"])
    again = ServerProc(*args, env=env)
    try:
        second = httpx.get(again.url + "/stats").json()["startup"]["kernel_warmers"]
        assert second["processes"] == 0 and "earlier start" in second["why"], second
    finally:
        assert again.stop() == 0, again.log()
