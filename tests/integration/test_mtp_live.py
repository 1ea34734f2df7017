"""``--draft-kind mtp`` behind the real server (issue 44): a tiny GLM-4.7-Flash-shaped checkpoint that ships its MTP
layer (tests.fixtures.zoo_mtp, the default tokenizer), driven by the real openai client.

- the text is mlx-lm's own greedy text, drafts are verified, the next turn hits the cache and drafts at once;
- after a restart the SSD tier restores the conversation with the heads' state (not blind);
- /stats names the heads, /metrics counts blind starts;
- a checkpoint without heads (the default SmolLM2) is refused at start, saying what to do."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures import zoo_mtp
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

NAME = "glm4_moe_lite"
TURN1 = [{"role": "user", "content": "Write a function that reverses a list, then name two edge cases."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return zoo_mtp.write(NAME, tmp_path_factory.mktemp("mtp") / NAME, default_model_dir)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--draft-kind", "mtp", "--cache-bytes", "64M",
            "--ssd-cache", str(tmp_path_factory.mktemp("mtp-ssd"))]
    srv = ServerProc(*args)
    srv.args = args
    yield srv
    assert srv.stop() == 0, srv.log()


def oracle(model_dir, messages, n):
    """mlx-lm's own greedy text for the chat prompt."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
        if int(token) in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(int(token))
    detokenizer.finalize()
    return detokenizer.text


def chat(url, messages, max_tokens=16):
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)
    usage = reply.usage.model_dump()
    return reply.choices[0].message.content or "", usage


def test_mtp_text_is_mlx_lm_greedy_and_the_next_turns_draft_from_ram_and_ssd(served, model_dir):
    url = served.url
    first, usage = chat(url, TURN1)
    assert first == oracle(model_dir, TURN1, 16)
    assert usage["speculative"]["drafted"] > 0 and usage["speculative"]["blind"] == 0, usage
    turn2 = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And in Go?"}]
    second, usage = chat(url, turn2)
    assert second == oracle(model_dir, turn2, 16)
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0 and usage["speculative"]["blind"] == 0, usage
    stats = httpx.get(url + "/stats").json()["speculative"]
    assert stats["kind"] == "mtp" and stats["heads"]["family"] == "deepseek" and stats["heads"]["layers"] == 1
    assert 'mlx_lane:spec_decode_blind_starts_total{kind="mtp"} 0.0' in httpx.get(url + "/metrics").text
    assert httpx.post(url + "/admin/cache/flush", timeout=120).status_code == 200

    again = ServerProc(*served.args)  # a restart: the next turn comes back from the SSD files, heads included
    try:
        text, usage = chat(again.url, turn2)
        assert text == second
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0 and usage["speculative"]["blind"] == 0, usage
    finally:
        assert again.stop() == 0, again.log()


def test_a_checkpoint_without_heads_is_refused_at_start(default_model_dir):
    with pytest.raises(RuntimeError) as info:
        ServerProc("--model", "default", "--draft-kind", "mtp", startup_timeout=120)
    assert "multi-token-prediction" in str(info.value) and "--draft-kind ngram" in str(info.value)


def test_draft_kind_auto_drafts_with_the_heads_a_checkpoint_ships_and_serves_plainly_without(model_dir):
    with_heads = ServerProc("--model", str(model_dir), "--draft-kind", "auto", "--no-ssd-cache")
    try:
        text, usage = chat(with_heads.url, TURN1)
        assert text == oracle(model_dir, TURN1, 16)
        assert usage["speculative"]["drafted"] > 0, usage
        assert httpx.get(with_heads.url + "/stats").json()["speculative"]["kind"] == "mtp"
    finally:
        assert with_heads.stop() == 0, with_heads.log()
    plain = ServerProc("--model", "default", "--draft-kind", "auto", "--no-ssd-cache")  # SmolLM2: no heads
    try:
        reply = httpx.post(plain.url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": TURN1, "max_tokens": 4, "temperature": 0}).json()
        assert reply["choices"][0]["message"]["content"] and "speculative" not in reply["usage"], reply
        assert not httpx.get(plain.url + "/stats").json()["speculative"]["enabled"]
        assert "speculative decoding off (--draft-kind auto" in plain.log()
    finally:
        assert plain.stop() == 0, plain.log()
