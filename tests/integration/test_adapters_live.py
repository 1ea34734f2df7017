"""LoRA adapters on the real default model through live servers (issue 17).

Adapters are made in the test (random low-rank weights in mlx_lm.lora's format: tests/fixtures/adapters.py).
Checked: an adapter changes the output; each front door selects it through `model`; a cache entry made under an
adapter never serves the base or the other adapter (and the reverse), in RAM and after a restart from SSD; two
adapters in flight at once (two requests each, so both groups batch) give their alone-text; an adapter loaded at
run time (with --api-key) finds its SSD entries by weights hash; speculative decoding (n-gram) under an adapter
gives the plain adapter text; a server without --api-key / --adapter-dir refuses run-time loading.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.fixtures.adapters import write_random_adapter
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

P1 = [{"role": "user", "content": "What is the capital of France?"}]
P2 = [{"role": "system", "content": "You are a terse assistant for a software team."},
      {"role": "user", "content": "Name one use of a hash map."}]


# 4 tokens a reply (it was 6, and 8 for /v1/completions: ~20 requests, ~6 s of CPU): the texts of the base model and
# the two adapters still all differ, and every text under an adapter (cached, batched, restored, through another
# door) is still compared token for token with its alone-text
N = 4


def chat(url, model, messages, max_tokens=N, headers=None):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300, headers=headers)
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj["choices"][0]["message"]["content"], obj["usage"]["prompt_tokens_details"]["cached_tokens"], obj


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_random_adapter(default_model_dir, root / name, seed) for name, seed in (("ada", 1), ("bob", 2))}


def test_adapters_change_text_never_share_cache_batch_together_and_survive_a_restart(adapters, tmp_path):
    kv = tmp_path / "kv"
    args = ("--model", "default", "--ssd-cache", str(kv), "--adapter", f"ada={adapters['ada']}",
            "--adapter", f"bob={adapters['bob']}")
    srv = ServerProc(*args)
    try:
        url = srv.url
        ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert "ada" in ids and "bob" in ids

        # cold, one at a time: the alone-texts (P1 under base first: its entry must not serve the adapters)
        alone, hit = {}, {}
        for model in ("default", "ada", "bob"):
            for name, p in (("p1", P1), ("p2", P2)):
                text, hit[model, name], obj = chat(url, model, p)
                alone[model, name] = text
        for model in ("default", "ada", "bob"):  # p1 first: nothing of its own model was cached yet
            assert hit[model, "p1"] == 0, f"{model} was served KV of another model: {hit[model, 'p1']} tokens"
            # p2 shares only the chat template's opening with p1 of the same model (a legitimate hit)
            assert hit[model, "p2"] == hit["default", "p2"] < 10
        assert obj["model"] == "bob"
        assert len({alone["default", "p1"], alone["ada", "p1"], alone["bob", "p1"]}) == 3  # adapters change it

        # the same adapter shares its own prefixes, with the same text
        text, cached, _ = chat(url, "ada", P1)
        assert cached > 0 and text == alone["ada", "p1"]

        # two adapters in flight at once, two requests each (each group decodes as a batch): alone-texts
        httpx.post(url + "/admin/cache/clear")
        jobs = [("ada", "p1", P1), ("ada", "p2", P2), ("bob", "p1", P1), ("bob", "p2", P2)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda j: chat(url, j[0], j[2])[0], jobs))
        for (model, name, _), text in zip(jobs, got):
            assert text == alone[model, name], f"{model}/{name} in flight beside another adapter: {text!r}"

        # the other front doors select the adapter too
        r = httpx.post(url + "/v1/completions", json={"model": "ada", "prompt": "The capital of France is",
                                                      "max_tokens": N, "temperature": 0}, timeout=300)
        r0 = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "The capital of France is",
                                                       "max_tokens": N, "temperature": 0}, timeout=300)
        assert r.status_code == r0.status_code == 200 and r.json()["model"] == "ada"
        assert r.json()["choices"][0]["text"] != r0.json()["choices"][0]["text"]
        m = httpx.post(url + "/v1/messages", json={"model": "ada", "max_tokens": N, "messages": P1,
                                                  "temperature": 0}, timeout=300)
        assert m.status_code == 200 and m.json()["content"][0]["text"] == alone["ada", "p1"]
        rs = httpx.post(url + "/v1/responses", json={"model": "bob", "input": P1, "max_output_tokens": N,
                                                     "temperature": 0}, timeout=300)
        assert rs.status_code == 200 and rs.json()["model"] == "bob"

        stats = httpx.get(url + "/stats").json()["adapters"]
        assert stats["ada"]["requests"] >= 5 and stats["ada"]["cache_hits"] >= 1
        assert 'mlx_lane:adapter_requests_total{adapter="ada"}' in httpx.get(url + "/metrics").text

        # no --api-key and no --adapter-dir: run-time loading is refused, whatever the path
        r = httpx.post(url + "/admin/adapters", json={"action": "load", "name": "eve", "path": str(adapters["ada"])})
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
        assert httpx.post(url + "/admin/cache/flush", timeout=60).status_code == 200
    finally:
        assert srv.stop() == 0

    # restart: base and bob never take ada's entries from SSD; ada, loaded at run time (authenticated), does
    key = {"Authorization": "Bearer k"}
    srv = ServerProc("--model", "default", "--ssd-cache", str(kv), "--adapter", f"bob={adapters['bob']}",
                     "--api-key", "k", "--draft-kind", "ngram")
    try:
        url = srv.url
        r = httpx.post(url + "/admin/adapters", json={"action": "load", "name": "ada", "path": str(adapters["ada"])},
                       headers=key, timeout=120)
        assert r.status_code == 200, r.text
        text, cached, _ = chat(url, "default", P2, headers=key)
        assert text == alone["default", "p2"]  # its own SSD entry or recomputed: the base text either way
        text, cached, _ = chat(url, "ada", P1, headers=key)  # speculative (n-gram) under the adapter, SSD restore
        assert cached > 0 and text == alone["ada", "p1"]
        text, cached, _ = chat(url, "bob", P1, headers=key)
        assert text == alone["bob", "p1"]
        r = httpx.post(url + "/admin/adapters", json={"action": "unload", "name": "ada"}, headers=key)
        assert r.status_code == 200
        r = httpx.post(url + "/v1/chat/completions", json={"model": "ada", "messages": P1, "max_tokens": 4},
                       headers=key)
        assert r.status_code == 404
    finally:
        assert srv.stop() == 0
