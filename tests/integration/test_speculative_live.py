"""Speculative decoding (n-gram source) on the real default model through a live server."""

from __future__ import annotations

import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

TEXT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
MSGS = [{"role": "user", "content": f"Repeat this code exactly:\n{TEXT}"}]


@pytest.fixture(scope="module")
def spec_server(default_model_dir):
    srv = ServerProc("--model", "default", "--draft-kind", "ngram", "--num-draft-tokens", "6",
                     "--cache-bytes", "256M")
    yield srv
    assert srv.stop() == 0, srv.log()


def chat(url, **extra):
    body = {"messages": MSGS, "max_tokens": 16, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_ngram_greedy_text_equals_plain_and_cache_hit_is_identical(spec_server):
    url = spec_server.url
    httpx.post(url + "/admin/cache/clear")
    plain = chat(url, num_draft_tokens=0)
    assert "speculative" not in plain["usage"]
    httpx.post(url + "/admin/cache/clear")
    cold = chat(url)
    assert cold["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    spec = cold["usage"]["speculative"]
    assert spec["drafted"] > 0 and spec["emitted"] == cold["usage"]["completion_tokens"]
    assert 0 <= spec["accepted"] <= spec["drafted"]
    warm = chat(url)  # a cache hit on a speculative request
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == cold["usage"]["prompt_tokens"] - 1
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_ngram_stream_with_stop_and_stats(spec_server):
    url = spec_server.url
    full = chat(url)["choices"][0]["message"]["content"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    stopped = chat(url, stop=[stop])["choices"][0]
    assert stopped["message"]["content"] == full[: full.find(stop)]
    assert stopped["finish_reason"] == "stop"
    stats = httpx.get(url + "/stats").json()["speculative"]
    assert stats["enabled"] and stats["kind"] == "ngram" and stats["requests"] >= 3
    assert stats["drafted"] >= stats["accepted"] > 0
    metrics = httpx.get(url + "/metrics").text
    accepted = next(line for line in metrics.splitlines()
                    if line.startswith("mlx_lane:spec_decode_num_accepted_tokens_total"))
    assert 'kind="ngram"' in accepted and float(accepted.split()[-1]) == stats["accepted"]


def test_mismatched_draft_is_refused_at_start(tmp_path, default_model_dir):
    # a draft with another vocabulary size: the gemma-shaped tiny model with a truncated vocab
    import json

    from tests.fixtures.tiny_models import write_sliding_window_model

    other = write_sliding_window_model(tmp_path / "other", default_model_dir, window=4096)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (other / "config.json").write_text(json.dumps(cfg))
    import mlx.core as mx

    w = mx.load(str(other / "model.safetensors"))
    w = {k: (v[:1000] if v.shape[0] == 49152 else v) for k, v in w.items()}
    mx.save_safetensors(str(other / "model.safetensors"), w)
    with pytest.raises(RuntimeError) as info:
        ServerProc("--model", "default", "--draft-model", str(other), startup_timeout=120)
    assert "vocab" in str(info.value).lower() or "tokenizer" in str(info.value).lower()


SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
]


def test_concurrent_ngram_streams_verify_in_one_batch_and_a_cancelled_one_leaves_the_others_unchanged(spec_server):
    """Four speculating streams at once share one verify forward per step (/stats speculative.in_batch: accepted
    drafts over steps of more than one row) and each gives the text it gives alone without speculation; a fifth,
    dropped by its client after its first chunks, leaves their text unchanged."""
    import threading

    url = spec_server.url
    bodies = [{"messages": [{"role": "user", "content": f"Repeat this code exactly:\n{t}"}], "max_tokens": 12,
               "temperature": 0} for t in SNIPPETS]
    alone = []
    for b in bodies:
        r = httpx.post(url + "/v1/chat/completions", json={**b, "num_draft_tokens": 0}, timeout=300)
        alone.append(r.json()["choices"][0]["message"]["content"])
    before = httpx.get(url + "/stats").json()["speculative"]["in_batch"]
    httpx.post(url + "/admin/cache/clear")
    texts: list = [None] * len(bodies)

    def run(i):
        with httpx.stream("POST", url + "/v1/chat/completions", json={**bodies[i], "stream": True},
                          timeout=300) as r:
            parts = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    import json

                    choice = json.loads(line[6:])["choices"]
                    if choice and choice[0]["delta"].get("content"):
                        parts.append(choice[0]["delta"]["content"])
            texts[i] = "".join(parts)

    def dropped():
        body = {**bodies[2], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 4:
                    return  # the client leaves: the row is cancelled in the batch

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))] + [threading.Thread(target=dropped)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert texts == alone
    after = httpx.get(url + "/stats").json()["speculative"]["in_batch"]
    assert after["steps"] > before["steps"]
    assert after["row_steps"] - before["row_steps"] > after["steps"] - before["steps"]  # more than one row per step
    assert after["accepted"] > before["accepted"]
    assert "mlx_lane:spec_decode_batch_accepted_tokens_total" in httpx.get(url + "/metrics").text


def test_two_model_rows_running_at_once_verify_in_one_batch_with_the_text_they_give_alone(default_model_dir):
    """With a draft model, requests running at once speculate in one batch too (each row drafts with its own draft
    caches; one verify forward for all): each gives the text it gives alone without speculation. The default model
    drafts for itself (same tokenizer, no extra download), so its drafts hold."""
    from tests.integration.test_batching_live import concurrently

    srv = ServerProc("--model", "default", "--draft-model", "default", "--num-draft-tokens", "3",
                     "--cache-bytes", "256M", "--no-ssd-cache")
    try:
        url = srv.url
        bodies = [{"messages": [{"role": "user", "content": f"Repeat this code exactly:\n{t}"}], "max_tokens": 10,
                   "temperature": 0} for t in SNIPPETS[:3]]
        alone = [chat_body(url, {**b, "num_draft_tokens": 0}) for b in bodies]
        httpx.post(url + "/admin/cache/clear")
        together = concurrently(lambda b: chat_body(url, b), [(b,) for b in bodies])
        assert together == alone
        b = httpx.get(url + "/stats").json()["speculative"]["in_batch"]
        assert b["steps"] > 0 and b["row_steps"] > b["steps"], b  # verify steps of more than one row
        assert b["accepted"] > 0, b
    finally:
        assert srv.stop() == 0, srv.log()


def chat_body(url, body):
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]
