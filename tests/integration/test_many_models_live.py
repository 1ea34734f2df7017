"""Many models in one server (issue 25), on real models behind a real uvicorn.

One ``--models-dir`` with two tiny random-weight models (a llama and a qwen2 with the default model's tokenizer,
tests/fixtures/tiny_models.py) beside the base model (the offline default), ``--max-loaded-models 1``. Checked:
``/v1/models`` lists every model with its state, and the states change as requests alternate; each model's greedy
text is its own and the same after it was evicted and loaded again; the same prompt never hits another model's KV
(each first request of it to a model has nothing cached) while a model loaded again hits its own RAM entries; a
burst of requests for an unloaded model loads it once; a stream for an unloaded model gets SSE keep-alives while
it loads; a model whose load fails is a 500 (streamed: the door's error event); ``--model-alias PATTERN=NAME`` sends Claude Code's small
model to an on-demand model; the admin endpoints load and unload; unknown names are a 404 that lists the models. Then a restart on the same SSD directory with ``--model-ttl``: a model restores its
prompt from SSD (its own namespace), and is unloaded once idle past the TTL.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from openai import OpenAI

from tests.fixtures.tiny_models import write_shardable_model
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

PROMPT = [{"role": "user", "content": "Write one sentence about rivers."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("models")
    write_shardable_model(root / "tiny-llama", default_model_dir, arch="llama", seed=1)
    write_shardable_model(root / "tiny-qwen", default_model_dir, arch="qwen2", seed=2)
    (root / "broken").mkdir()  # a config.json and no weights: listed, and its load fails
    (root / "broken" / "config.json").write_text('{"model_type": "llama"}')
    bracket = write_shardable_model(root / "tiny-bracket", default_model_dir, arch="llama", seed=3)
    config = json.loads((bracket / "tokenizer_config.json").read_text())
    config["chat_template"] = BRACKET_TEMPLATE  # another chat template than the base model's ChatML
    (bracket / "tokenizer_config.json").write_text(json.dumps(config))
    return root


BRACKET_TEMPLATE = ("{% for m in messages %}[[{{ m['role'] }}]] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[[assistant]] {% endif %}")


def states(url) -> dict:
    return {m["id"]: m.get("state") for m in httpx.get(url + "/v1/models").json()["data"]}


def loads(url, name) -> int:
    return httpx.get(url + "/stats").json()["models"][name]["loads"]


def test_models_load_on_demand_evict_each_other_keep_their_caches_apart_and_restore_per_model(models_dir, tmp_path,
                                                                                               default_model_dir):
    kv = tmp_path / "kv"
    srv = ServerProc("--model", "default", "--models-dir", str(models_dir), "--max-loaded-models", "1",
                     "--ssd-cache", str(kv), "--cache-bytes", "256M", "--write-behind-debounce", "0.05",
                     "--model-alias", "claude-*haiku*=tiny-qwen", "--model-alias", "claude-*", "--keepalive", "0.1")
    try:
        url = srv.url
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert states(url)["tiny-llama"] == states(url)["tiny-qwen"] == "not_loaded"
        assert states(url)["default"] == "loaded"
        card = httpx.get(url + "/v1/models/tiny-qwen").json()
        assert card["state"] == "not_loaded" and card["context_length"] == 4096 and card["size_bytes"] > 0

        texts, cached = {}, {}
        for i, model in enumerate(["tiny-llama", "tiny-qwen", "tiny-llama", "default", "tiny-qwen"]):
            r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=6, temperature=0)
            assert r.model == ("SmolLM2-135M-Instruct" if model == "default" else model)
            texts.setdefault(model, []).append(r.choices[0].message.content)
            cached.setdefault(model, []).append(r.usage.prompt_tokens_details.cached_tokens)
            if i == 0:
                assert states(url)["tiny-llama"] == "loaded" and states(url)["tiny-qwen"] == "not_loaded"
            if i == 1:  # one slot: the llama went to make room
                assert states(url)["tiny-llama"] == "not_loaded" and states(url)["tiny-qwen"] == "loaded"
        for model, got in texts.items():
            assert len(set(got)) == 1, f"{model} answered differently after a reload: {got}"
        assert len({got[0] for got in texts.values()}) == 3, texts  # each model its own text
        # the same prompt (same tokenizer) never hits another model's entries; a reloaded model hits its own
        assert cached["tiny-llama"][0] == cached["tiny-qwen"][0] == cached["default"][0] == 0, cached
        assert cached["tiny-llama"][1] > 0 and cached["tiny-qwen"][1] > 0, cached

        # the base model decodes while another model loads beside it (off the lane): both texts are their own
        # (12 tokens, ~2 s of decoding: the tiny model's load, started 0.3 s in, takes a fraction of that; 24 were
        # another ~4 s of CPU)
        long_prompt = [{"role": "user", "content": "List five rivers of Europe, one per line."}]
        alone = client.chat.completions.create(model="default", messages=long_prompt, max_tokens=12,
                                               temperature=0).choices[0].message.content
        assert states(url)["tiny-llama"] == "not_loaded"
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            base = ex.submit(lambda: client.chat.completions.create(
                model="default", messages=long_prompt, max_tokens=12, temperature=0).choices[0].message.content)
            time.sleep(0.3)  # the base request is decoding when the load starts
            other = ex.submit(lambda: client.chat.completions.create(
                model="tiny-llama", messages=PROMPT, max_tokens=6, temperature=0).choices[0].message.content)
            assert base.result() == alone and other.result() == texts["tiny-llama"][0]
        httpx.post(url + "/admin/models/unload", json={"model": "tiny-llama"}, headers={"Content-Type": "application/json"})

        # a burst for the unloaded llama: one load, every answer its text
        before = loads(url, "tiny-llama")
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda _: client.chat.completions.create(
                model="tiny-llama", messages=PROMPT, max_tokens=6, temperature=0).choices[0].message.content,
                range(4)))
        assert got == [texts["tiny-llama"][0]] * 4
        assert loads(url, "tiny-llama") == before + 1
        stats = httpx.get(url + "/stats").json()["models"]["tiny-llama"]
        assert stats["state"] == "loaded" and stats["loaded"] and stats["requests"] == 7 and stats["in_use"] == 0
        assert stats["cache_entries"] >= 1 and stats["last_used_unix"] > time.time() - 600
        assert 'mlx_lane:model_cache_entries{model="tiny-llama"}' in httpx.get(url + "/metrics").text

        # streaming, through raw HTTP, on the other model: it loads first, the stream keeps the connection alive
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-qwen", "messages": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            body = "".join(r.iter_text())
        assert body.startswith(": keep-alive"), body[:200]  # SSE comments while it loaded
        assert '"model":"tiny-qwen"' in body and body.rstrip().endswith("data: [DONE]")
        content = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                          for line in body.splitlines() if line.startswith("data: {"))
        assert content == texts["tiny-qwen"][0]

        # a model whose load fails: a 500 that says so, or (streamed) the door's error event after the keep-alives
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={"model": "broken", "messages": PROMPT})
        assert r.status_code == 500 and r.json()["error"]["code"] == "model_load_failed", r.text
        assert "broken" in r.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/messages", timeout=120, json={
                "model": "broken", "max_tokens": 6, "messages": PROMPT, "stream": True}) as r:
            assert r.status_code == 200
            body = "".join(r.iter_text())
        assert "event: error" in body and "could not be loaded" in body, body[-400:]
        assert httpx.get(url + "/stats").json()["models"]["broken"]["error"]

        # Claude Code's small fast model through an alias onto an on-demand model; its main model onto the base
        for model, want in (("claude-3-5-haiku-20241022", texts["tiny-qwen"][0]), ("claude-sonnet-4-5",
                                                                                    texts["default"][0])):
            m = httpx.post(url + "/v1/messages", timeout=120, json={
                "model": model, "max_tokens": 6, "messages": PROMPT, "temperature": 0})
            assert m.status_code == 200 and m.json()["content"][0]["text"] == want, (model, m.text)

        # admin: unload, load; the base model stays; unknown names say what is served
        h = {"Content-Type": "application/json"}
        r = httpx.post(url + "/admin/models/unload", json={"model": "tiny-qwen"}, headers=h)
        assert r.status_code == 200 and r.json()["state"] == "not_loaded"
        r = httpx.post(url + "/admin/models/load", json={"name": "tiny-qwen"}, headers=h, timeout=120)  # or "model"
        assert r.status_code == 200 and r.json()["state"] == "loaded" and r.json()["was"] == "not_loaded"
        assert httpx.post(url + "/admin/models/unload", json={"model": "default"}, headers=h).status_code == 400
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-mistral", "messages": PROMPT})
        assert r.status_code == 404 and "tiny-llama" in r.json()["error"]["message"]
        assert httpx.post(url + "/admin/cache/flush", timeout=60).status_code == 200
    finally:
        assert srv.stop() == 0

    # restart on the same SSD tier, with an idle TTL: the qwen restores its prompt from SSD, then unloads when idle
    srv = ServerProc("--model", "default", "--models-dir", str(models_dir), "--ssd-cache", str(kv),
                     "--cache-bytes", "256M", "--model-ttl", "1")
    try:
        url = srv.url
        # a prompt is counted and rendered with the template of the model it names, not the base model's
        from mlx_lm.utils import load_tokenizer

        counts = {}
        for model, folder in (("default", default_model_dir), ("tiny-bracket", models_dir / "tiny-bracket")):
            r = httpx.post(url + "/v1/messages/count_tokens", timeout=120, json={"model": model, "messages": PROMPT})
            assert r.status_code == 200, r.text
            tok = load_tokenizer(folder)
            counts[model] = r.json()["input_tokens"]
            assert counts[model] == len(tok.apply_chat_template(PROMPT, add_generation_prompt=True)), model
            m = httpx.post(url + "/v1/messages", timeout=120, json={"model": model, "max_tokens": 2, "messages": PROMPT})
            usage = m.json()["usage"]
            assert (usage["input_tokens"] + usage["cache_read_input_tokens"]
                    + usage["cache_creation_input_tokens"]) == counts[model], (model, usage)
        assert counts["default"] != counts["tiny-bracket"], counts
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="tiny-qwen", messages=PROMPT, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == texts["tiny-qwen"][0]
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # from its own SSD namespace
        assert httpx.get(url + "/stats").json()["ssd_cache"]["restores"] >= 1
        deadline = time.monotonic() + 30
        while states(url)["tiny-qwen"] != "not_loaded" and time.monotonic() < deadline:
            time.sleep(0.25)
        assert states(url)["tiny-qwen"] == "not_loaded"
        assert httpx.get(url + "/stats").json()["models"]["tiny-qwen"]["unloads"] == 1
    finally:
        assert srv.stop() == 0
