"""The OpenAI surface on the real default model through a live server (openai client + raw HTTP)."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.model

HI = [{"role": "user", "content": "Say hello and introduce yourself."}]


def test_chat_json(client):
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens  # the last token is always computed
    assert r.model == "SmolLM2-135M-Instruct"
    again = client.chat.completions.create(model="default", messages=HI, max_tokens=6, temperature=0)
    # the same prompt again: everything but its last token comes from the prefix cache, and the text is the same
    assert again.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    assert again.choices[0].message.content == choice.message.content


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="default", messages=HI, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert text.strip()
    assert finishes == ["length"] or finishes == ["stop"]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert chunks[-1].usage is not None
    assert usage_chunks[0].usage.completion_tokens <= 8
    # same request as JSON gives the same greedy text
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == text


def test_raw_sse_framing(server):
    body = {"messages": HI, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", content=json.dumps(body), timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    data = [ln for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    for ln in data[:-1]:
        obj = json.loads(ln[6:])
        assert obj["object"] == "chat.completion.chunk"


def test_curl_style_form_content_type_is_parsed_as_json(server):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded; the body is still JSON
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps({"messages": HI, "max_tokens": 3}),
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_completions_json_and_stream(server):
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    obj = r.json()
    assert obj["object"] == "text_completion"
    text = obj["choices"][0]["text"]
    assert text
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=120) as s:
        parts = []
        for ln in s.iter_lines():
            if ln.startswith("data: {"):
                ch = json.loads(ln[6:])
                if ch["choices"]:
                    parts.append(ch["choices"][0]["text"])
    assert "".join(parts) == text


def test_a_completion_keeps_its_first_tokens_leading_space_and_a_chat_reply_trims_it(server):
    """A raw completion's text is exactly what its tokens spell: "The capital of France is" + text reads as the
    model wrote it, the first token's space included (mlx-lm's streaming detokenizer drops it, right for chat
    only). The tokens come back in the logprobs, each decoded alone; streamed or not, the same text."""
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "logprobs": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert tokens[0].startswith(" "), tokens  # the model's first token carries a space: what is checked below
    assert choice["text"] == "".join(tokens) and choice["text"].startswith(" ")
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=120) as s:
        parts = [json.loads(ln[6:])["choices"][0]["text"] for ln in s.iter_lines()
                 if ln.startswith("data: {") and json.loads(ln[6:])["choices"]]
    assert "".join(parts) == choice["text"]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Say: Paris"}], "max_tokens": 4, "temperature": 0}).json()
    assert not chat["choices"][0]["message"]["content"].startswith(" ")  # a chat reply is trimmed, as before


def test_completions_default_max_tokens_is_16(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "temperature": 0}, timeout=120)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] <= 16


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="default", messages=HI, max_tokens=6, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_logprobs_shape(client):
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens or len(content) == r.usage.completion_tokens - 1
    for item in content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert item.token == item.top_logprobs[0].token
        assert abs(item.logprob - tops[0]) < 1e-4
    assert "".join(i.token for i in content) == r.choices[0].message.content


def _greedy_tokens(client, max_tokens=12):
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=max_tokens, temperature=0,
                                       logprobs=True)
    return [i.token for i in r.choices[0].logprobs.content]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_token_boundary(client, stream):
    toks = _greedy_tokens(client)
    # a stop string that starts inside token 3 and ends inside token 4
    assert len(toks[3]) >= 1 and len(toks[4]) >= 1
    stop = toks[3][-1:] + toks[4][:1]
    full = "".join(toks)
    expected = full[: full.find(stop)]
    kw = dict(model="default", messages=HI, max_tokens=12, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
    else:
        r = client.chat.completions.create(**kw)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == expected
    assert stop not in text
    assert reason == "stop"


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert "SmolLM2-135M-Instruct" in ids and "default" in ids
    health = httpx.get(server.url + "/health").json()
    assert health.pop("warm") in (True, False)  # the warm-up runs behind the requests (test_lane_behaviour.py)
    assert health == {"status": "ok", "lane": "serving", "api_key_required": False}


def test_stats_lane_block(server, client):
    before = httpx.get(server.url + "/stats").json()["lane"]
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=4, temperature=0)
    s = httpx.get(server.url + "/stats").json()
    lane = s["lane"]
    assert s["device"] in ("cpu", "gpu") and s["dtype"] == "float32"
    # this request, counted once (the session's server ran other tests before: compare with what it had then)
    assert lane["requests_served"] == before["requests_served"] + 1
    assert lane["prompt_tokens"] - before["prompt_tokens"] == r.usage.prompt_tokens
    assert lane["completion_tokens"] - before["completion_tokens"] == r.usage.completion_tokens
    assert lane["cached_tokens"] - before["cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens
    assert lane["queue_depth"] == 0 and lane["recent_started"][-1] == r.id
    assert lane["decode_tokens_per_s"]["last"] is None or lane["decode_tokens_per_s"]["last"] > 0
    assert "OpenBLAS" in s["blas"] or "reference" in s["blas"]


def test_greedy_text_matches_mlx_lm(client, default_model_dir):
    """The served greedy continuation equals mlx_lm's own generate on the same model and prompt."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(default_model_dir))
    prompt = tokenizer.apply_chat_template(HI, add_generation_prompt=True)
    ids = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=16):
        if tok in tokenizer.eos_token_ids:
            break
        ids.append(tok)
    expected = tokenizer.decode(ids)
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == expected
