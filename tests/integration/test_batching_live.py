"""The batching lane on the real default model through a live server: concurrent streams each get their own text,
usage and cache hits; batched greedy text vs the same request alone; seeded sampling under concurrency; one
stream's cancellation leaves the others alone; a hit on an entry whose donor is still decoding; the memory budget."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

TOPICS = ["the sea", "a red bicycle", "autumn leaves", "a chess game", "the moon", "bread", "a quiet library",
          "trains at night"]


def msgs(topic: str) -> list:
    return [{"role": "user", "content": f"Write two sentences about {topic}."}]


def chat(url: str, body: dict, timeout: float = 300) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(url: str, body: dict, stop_after: int | None = None) -> dict:
    """Streams; returns text, usage, finish reason and chunk count. stop_after: close the connection after N chunks."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    text, usage, finish, n = [], None, None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                text.append(c["delta"].get("content") or "")
                finish = c.get("finish_reason") or finish
            n += 1
            if stop_after is not None and n >= stop_after:
                break
    return {"text": "".join(text), "usage": usage, "finish": finish, "chunks": n}


def concurrently(fn, args_list: list) -> list:
    out = [None] * len(args_list)
    errors = []

    def run(i, args):
        try:
            out[i] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def batch_server(server):
    """The suite's shared server (tests/integration/conftest.py): its --max-batch (16 on the CPU) runs eight at once,
    and these tests read its /stats as differences."""
    return server


def test_eight_concurrent_streams_each_get_their_own_text_usage_and_cache_hits(batch_server):
    url = batch_server.url
    # 8 tokens (it was 12, ~0.15 s of CPU a token alone): the eight rows still decode together for several steps
    # (the histogram below proves it), and each row's text is still compared with its alone-text token for token
    n = 8
    bodies = [{"messages": msgs(t), "max_tokens": n, "temperature": 0} for t in TOPICS]
    alone = [chat(url, b) for b in bodies]  # one at a time: the reference texts
    httpx.post(url + "/admin/cache/clear")
    before = httpx.get(url + "/stats").json()["lane"]
    together = concurrently(stream_chat, [(url, b) for b in bodies])
    lane = httpx.get(url + "/stats").json()["lane"]
    assert lane["batch_layout"] == "ragged"  # the CPU's default (--batch-layout auto): what this test exercises
    assert all(f["wait_ms"] is None for f in lane["prefill_parts"]["recent"])  # no wait apart by default
    assert lane["experts"] == "none"  # the default model has no mixture-of-experts layer (models.kernels.moe)
    # the lane really batched: decode steps ran with several rows at once
    hist = {int(k): v for k, v in lane["batch_size"]["histogram"].items()}
    before_hist = {int(k): v for k, v in before["batch_size"]["histogram"].items()}
    assert any(k >= 4 and v > before_hist.get(k, 0) for k, v in hist.items()), hist
    matches = 0
    for ref, got in zip(alone, together):
        u = got["usage"]
        assert got["finish"] in ("stop", "length")
        assert u["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert u["completion_tokens"] == (n if got["finish"] == "length" else u["completion_tokens"])
        assert 1 <= u["completion_tokens"] <= n
        assert u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]
        matches += got["text"] == ref["choices"][0]["message"]["content"]
    # batched float32 arithmetic may round differently from a batch of one; on this model it rarely changes a
    # greedy token (BENCHMARKS.md measures the rate): demand nearly all
    assert matches >= 7, [(g["text"], r["choices"][0]["message"]["content"]) for g, r in zip(together, alone)]
    # the same eight again, concurrently: each hits its own entry (stored from its row of the batch)
    # (one token each: what is checked is the hit, which the prompt alone decides)
    again = concurrently(stream_chat, [(url, dict(b, max_tokens=1)) for b in bodies])
    for first, second in zip(together, again):
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1


def test_seeded_sampling_is_reproducible_whatever_else_runs(batch_server):
    url = batch_server.url
    seeded = {"messages": msgs("a lighthouse"), "max_tokens": 12, "temperature": 0.9, "seed": 1234}
    alone = chat(url, seeded)["choices"][0]["message"]["content"]
    others = [{"messages": msgs(t), "max_tokens": 12, "temperature": 1.0} for t in TOPICS[:3]]
    results = concurrently(lambda b: chat(url, b), [(b,) for b in [seeded, *others, seeded]])
    assert results[0]["choices"][0]["message"]["content"] == alone
    assert results[-1]["choices"][0]["message"]["content"] == alone


def test_cancelling_one_stream_leaves_the_others_text_alone(batch_server):
    url = batch_server.url
    # 10 tokens (it was 16): the dropped stream leaves after 3 chunks, the other two decode on for 7 more steps
    # without it, each still compared with its alone-text
    bodies = [{"messages": msgs(t), "max_tokens": 10, "temperature": 0} for t in TOPICS[:3]]
    alone = [stream_chat(url, b)["text"] for b in bodies]
    before = httpx.get(url + "/stats").json()["lane"]["requests_cancelled"]
    res = concurrently(stream_chat, [(url, bodies[0]), (url, bodies[1], 3), (url, bodies[2])])
    assert res[1]["chunks"] == 3  # the client left after three chunks
    assert res[0]["text"] == alone[0] and res[2]["text"] == alone[2]
    deadline = time.monotonic() + 30
    while httpx.get(url + "/stats").json()["lane"]["requests_cancelled"] <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(url + "/stats").json()["lane"]["requests_cancelled"] > before


@pytest.fixture(scope="module")
def slow_server(default_model_dir):
    """Tokens come slowly (test seam), so a request is surely still decoding while another one arrives."""
    srv = ServerProc("--model", "default", "--cache-bytes", "256M", env={"MLX_LANE_TEST_TOKEN_DELAY": "0.25"})
    yield srv
    assert srv.stop() == 0, srv.log()


def test_a_hit_on_an_entry_whose_donor_is_still_decoding(slow_server):
    url = slow_server.url
    turn1 = [{"role": "user", "content": "List three colours."}]
    r1 = chat(url, {"messages": turn1, "max_tokens": 4, "temperature": 0})
    reply = r1["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now three animals."}]
    box = {}
    donor = threading.Thread(target=lambda: box.update(r=stream_chat(url, {"messages": turn2, "max_tokens": 16,
                                                                            "temperature": 0})))
    donor.start()
    deadline = time.monotonic() + 60
    while not httpx.get(url + "/stats").json()["lane"]["running_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    # another agent starts from the same first turn while the conversation's next turn is decoding
    other = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now three fruits."}]
    r3 = chat(url, {"messages": other, "max_tokens": 1, "temperature": 0})
    still_running = httpx.get(url + "/stats").json()["lane"]["running_requests"]
    donor.join(120)
    assert still_running, "the donor finished before the hit: the test proved nothing"
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]
    assert box["r"]["finish"] in ("stop", "length")


def test_memory_budget_queues_instead_of_overcommitting_and_refuses_what_never_fits(default_model_dir):
    weights = (Path(default_model_dir) / "model.safetensors").stat().st_size
    per_token = 30 * 3 * 64 * 2 * 4  # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K, V) x float32
    # room for 300 tokens of KV; each request below needs its prompt (112 tokens) + max_tokens (8) = 120: two fit at
    # once (240), three do not (360). (The prompts were ~210 tokens against 450: the arithmetic is the same, at
    # half the prefill.)
    budget = weights + per_token * 300
    srv = ServerProc("--model", "default", "--cache-bytes", "64M", "--memory-budget", str(budget))
    try:
        long_text = " ".join(f"item{i}" for i in range(30))
        bodies = [{"messages": [{"role": "user", "content": f"{i}: {long_text}"}], "max_tokens": 8,
                   "temperature": 0} for i in range(5)]
        results = concurrently(stream_chat, [(srv.url, b) for b in bodies])
        assert all(r["finish"] in ("stop", "length") and r["usage"] for r in results)  # no stream lost
        assert all(r["usage"]["prompt_tokens"] + 8 == 120 for r in results)  # the sizes the budget was set for
        lane = httpx.get(srv.url + "/stats").json()["lane"]
        assert 1 <= lane["running_max"] <= 2, lane  # the cap held: never three at once
        big = {"messages": [{"role": "user", "content": long_text}], "max_tokens": 900}
        r = httpx.post(srv.url + "/v1/chat/completions", json=big, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "memory_budget_exceeded", r.text
        assert "--memory-budget" in r.json()["error"]["message"]
    finally:
        assert srv.stop() == 0, srv.log()


def test_structured_output_inside_a_batch_each_row_keeps_its_own_grammar(batch_server):
    import jsonschema

    schemas = [
        {"type": "object", "additionalProperties": False, "required": ["color"],
         "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}}},
        {"type": "object", "additionalProperties": False, "required": ["n"],
         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}},
        {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}},
    ]
    bodies = [{"messages": msgs(t), "max_tokens": 24, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}}}
              for i, (t, s) in enumerate(zip(TOPICS, schemas))]
    plain = [{"messages": msgs(t), "max_tokens": 12, "temperature": 0} for t in TOPICS[3:6]]
    results = concurrently(lambda b: chat(batch_server.url, b), [(b,) for b in bodies + plain])
    for schema, r in zip(schemas, results):
        assert r["choices"][0]["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
    for r in results[len(schemas):]:  # the plain rows beside them are not constrained
        assert not r["choices"][0]["message"]["content"].startswith("{")


def test_penalties_and_logit_bias_inside_a_batch_each_row_keeps_its_own(batch_server, default_model_dir):
    """The ragged batch applies the rows' rules together (server.engine.batch.rules): each row still gets the
    text it gets alone, and the rules act (a +100 bias makes every token the biased one; penalties change the text)."""
    from tokenizers import Tokenizer

    url = batch_server.url
    (the,) = Tokenizer.from_file(str(Path(default_model_dir) / "tokenizer.json")).encode(
        " the", add_special_tokens=False).ids
    rules = [{"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"repetition_penalty": 1.8},
             {"logit_bias": {str(the): 100}}, {}, {"frequency_penalty": 0.8, "logit_bias": {str(the): -100}}]
    topics = [TOPICS[0], TOPICS[0], TOPICS[1], TOPICS[0], TOPICS[2]]  # rows 0, 1 and 3 differ only by their rules
    bodies = [dict({"messages": msgs(t), "max_tokens": 10, "temperature": 0}, **r) for t, r in zip(topics, rules)]
    alone = [chat(url, b)["choices"][0]["message"]["content"] for b in bodies]
    httpx.post(url + "/admin/cache/clear")
    before = httpx.get(url + "/stats").json()["lane"]["batch_size"]["histogram"]
    together = [r["choices"][0]["message"]["content"]
                for r in concurrently(lambda b: chat(url, b), [(b,) for b in bodies])]
    hist = httpx.get(url + "/stats").json()["lane"]["batch_size"]["histogram"]
    assert any(int(k) >= 3 and v > before.get(k, 0) for k, v in hist.items()), hist  # they ran as one batch
    # batched float32 arithmetic may round differently from a batch of one (a rare near-tie): demand nearly all
    assert sum(t == a for t, a in zip(together, alone)) >= 4, list(zip(together, alone))
    assert together[2].split() == ["the"] * 10  # the bias won every step
    assert together[0] != alone[3] and together[1] != alone[3]  # the penalties changed what greedy says


def test_agents_sent_at_once_share_their_system_prompt_instead_of_each_prefilling_it(batch_server):
    url = batch_server.url
    httpx.post(url + "/admin/cache/clear")
    system = {"role": "system", "content": "You are a coding agent. " + " ".join(
        f"Rule {i}: keep the change small and run the tests for module_{i}." for i in range(24))}
    bodies = [{"messages": [system, {"role": "user", "content": f"Task {i}: fix issue #{i}."}], "max_tokens": 2,
               "temperature": 0} for i in range(3)]
    results = concurrently(lambda b: chat(url, b), [(b,) for b in bodies])
    cached = sorted(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    prompt = results[0]["usage"]["prompt_tokens"]
    # the first prefills the shared system prompt; the others take it from its prompt-boundary entry
    assert cached[0] == 0 and prompt > 250
    assert all(c >= prompt - 20 for c in cached[1:]), (cached, prompt)


def test_prompts_prefilled_together_in_one_batched_forward_give_their_alone_text(default_model_dir):
    # --debug-prefill-wait: each forward's wait for the work queued ahead of it on the lane's stream, timed apart
    srv = ServerProc("--model", "default", "--cache-bytes", "512M", "--max-batch", "8", "--prefill-batch", "4",
                     "--debug-prefill-wait")
    try:
        url = srv.url
        # 4 tokens (was 8): the first comes from the batched prefill's logits, three more decode over the KV it
        # wrote, each row's text compared with its alone-text
        bodies = [{"messages": msgs(t), "max_tokens": 4, "temperature": 0} for t in TOPICS[:4]]
        alone = [chat(url, b)["choices"][0]["message"]["content"] for b in bodies]
        httpx.post(url + "/admin/cache/clear")
        before_lane = httpx.get(url + "/stats").json()["lane"]
        before, parts_before = before_lane["prefill_batches"], before_lane["prefill_parts"]
        together = concurrently(lambda b: chat(url, b), [(b,) for b in bodies])
        lane = httpx.get(url + "/stats").json()["lane"]
        assert lane["prefill_batch"] == 4
        # /stats' prefill parts count the same batched forwards, and every prompt token the lane computed
        parts = lane["prefill_parts"]
        assert parts["forwards"]["together"] - parts_before["forwards"]["together"] == (
            lane["prefill_batches"]["forwards"] - before["forwards"])
        # (a prompt that arrives a tick late takes the prefix it shares with another from the cache: its cached tokens)
        assert parts["tokens"] - parts_before["tokens"] == sum(
            r["usage"]["prompt_tokens"] - 1 - r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in together)
        assert parts["forward_s"] > parts_before["forward_s"] and parts["forward_shapes"] >= 1
        # the last forwards one by one: these prompts' batched forwards among them, their rows and tokens
        mine = [f for f in parts["recent"] if f["rows"] > 1]
        assert mine and all(f["tokens"] >= f["length"] > 0 and f["ms"] > 0 and f["cached"] >= 0 for f in mine)
        # their parts: mlx-lm builds and evaluates a gathered forward in one call; the CPU hands no buffers back
        assert all(f["build_ms"] is None and 0 <= f["clear_ms"] < f["ms"] for f in mine)
        assert all(f["wait_ms"] is not None and f["wait_ms"] >= 0 for f in parts["recent"])  # measured, every one
        alone_forwards = [f for f in parts["recent"] if f["rows"] == 1]  # the alone requests' and the warm-up's
        assert alone_forwards and all(0 < f["build_ms"] <= f["ms"] for f in alone_forwards)
        assert lane["leave_parts"]["rows"] - before_lane["leave_parts"]["rows"] == len(bodies)  # each ended once
        # MLX's allocator: the weights alone are live arrays, and the high-water mark is at least what is live now
        memory = httpx.get(url + "/stats").json()["memory"]
        assert 0 < memory["active_bytes"] <= memory["peak_bytes"] and memory["cache_bytes"] >= 0
        assert memory["limit_bytes"] > 0 and memory["cache_limit_bytes"] is None  # the CPU: MLX's own limits
        assert memory["unaccounted_bytes"] == 0  # the CPU: admission is by the accounting alone
        assert memory["over_limit"] == {"decode_steps": 0, "prefill_forwards": 0}  # far below MLX's own limit
        assert "device" in memory and memory["device"] is None  # no CUDA driver to read a card from
        # the prompts really went through mlx-lm's batch prefill, several rows per forward
        assert lane["prefill_batches"]["forwards"] > before["forwards"]
        assert lane["prefill_batches"]["rows"] - before["rows"] >= 2 * (lane["prefill_batches"]["forwards"]
                                                                         - before["forwards"])
        texts = [r["choices"][0]["message"]["content"] for r in together]
        # padded batched float32 arithmetic may round differently; on this model it rarely flips a greedy token
        assert sum(t == a for t, a in zip(texts, alone)) >= 3, list(zip(texts, alone))
        for r in together:
            assert r["usage"]["completion_tokens"] >= 1
    finally:
        assert srv.stop() == 0, srv.log()


def test_admin_profile_shows_the_lane_thread_stepping_the_batch_while_streams_run(batch_server):
    url = batch_server.url
    bodies = [{"messages": msgs(t), "max_tokens": 60, "temperature": 0, "stream": True,
               "logit_bias": {"2": -100}} for t in TOPICS[:4]]  # no early end: the lane stays busy
    got: dict = {}
    profiled = threading.Event()

    def until_profiled(body) -> int:
        """Reads the stream until the profile is taken, then leaves (the lane cancels the row): the 60 tokens only
        bound a lane that must stay busy for the profile's second, and decoding all of them took ~10 s of CPU."""
        chunks = 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if profiled.is_set():
                    break
        return chunks

    def streams():
        got["streams"] = concurrently(until_profiled, [(b,) for b in bodies])

    runner = threading.Thread(target=streams)
    runner.start()

    def batching():  # the profile starts once the four rows decode together (on a loaded machine prefills take long)
        return (httpx.get(url + "/stats").json()["lane"]["batch_size"]["current"] or 0) >= 2

    deadline = time.monotonic() + 120
    while not batching() and time.monotonic() < deadline and runner.is_alive():
        time.sleep(0.05)
    r = httpx.get(url + "/admin/profile", params={"seconds": 1.0, "interval_ms": 2,
                                                   "threads": "mlx-lane,MainThread"}, timeout=60)
    profiled.set()
    runner.join(300)
    assert len(got["streams"]) == 4 and all(n >= 1 for n in got["streams"]), got
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "profile" and body["samples"] > 50 and body["missing_threads"] == []
    lane = body["threads"]["mlx-lane"]
    functions = {row["function"] for row in lane["top_total"]}
    assert "server/lane/lane.py _run" in functions
    assert "server/engine/batch/ragged.py step" in functions  # the batched decode step ran while it sampled
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lane["folded"]) == lane["samples"]
    bad = httpx.get(url + "/admin/profile", params={"seconds": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seconds"
