"""The RAM prefix cache on the real default model and on a tiny sliding-window model."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures.tiny_models import write_sliding_window_model
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a careful assistant for a software engineering team."}


# 4 tokens a reply unless a test says (it was 8): a hit's text is still compared with the cold text token for token
def chat(url, messages, max_tokens=4, **extra):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300, headers=extra.pop("headers", None))
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj["choices"][0]["message"]["content"], obj["usage"]


def clear(url):
    assert httpx.post(url + "/admin/cache/clear").status_code == 200


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(default_model_dir)


def prompt_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_full_hit_same_text_and_cached_tokens(server, tokenizer):
    msgs = [SYSTEM, {"role": "user", "content": "List three prime numbers."}]
    clear(server.url)
    cold, u0 = chat(server.url, msgs)
    warm, u1 = chat(server.url, msgs)
    assert u0["prompt_tokens_details"]["cached_tokens"] == 0
    assert u1["prompt_tokens_details"]["cached_tokens"] == len(prompt_ids(tokenizer, msgs)) - 1
    assert warm == cold


def test_partial_hit_with_trim(server, tokenizer):
    a = [SYSTEM, {"role": "user", "content": "Explain what a mutex is, briefly."}]
    b = [SYSTEM, {"role": "user", "content": "Explain what a semaphore is, briefly."}]
    clear(server.url)
    cold_b, _ = chat(server.url, b)
    clear(server.url)
    chat(server.url, a)
    warm_b, u = chat(server.url, b)
    expected = common_prefix(prompt_ids(tokenizer, a), prompt_ids(tokenizer, b))
    assert 0 < expected < len(prompt_ids(tokenizer, b)) - 1
    assert u["prompt_tokens_details"]["cached_tokens"] == expected
    assert warm_b == cold_b


def test_five_turn_conversation_identical_with_and_without_cache(server, tokenizer):
    questions = ["What is a linked list?", "And a hash map?", "Which is faster for lookup?",
                 "Give an example in Python.", "Summarize in one line."]
    # 4 tokens a reply (it was 8: 40 decode steps over ten requests, ~6 s of CPU): each turn's text is still compared
    # token for token with its cold text, its first token read off the hit and three more decoded past it
    n = 4

    def converse():
        msgs, out = [SYSTEM], []
        for q in questions:
            msgs.append({"role": "user", "content": q})
            text, usage = chat(server.url, msgs, max_tokens=n)
            out.append((text, usage))
            msgs.append({"role": "assistant", "content": text})
        return out, msgs

    clear(server.url)
    before = httpx.get(server.url + "/stats").json()["prompt_tokens"]
    cached_run, _ = converse()
    # each turn's earlier messages were tokenized from the server's piece cache (server.core.token_cache) ...
    after = httpx.get(server.url + "/stats").json()["prompt_tokens"]
    assert after["enabled"] and after["hits"] - before["hits"] >= 2 * (len(questions) - 1)
    assert after["tokens_reused"] > before["tokens_reused"]
    # cold reference: clear before every turn
    msgs, cold_texts = [SYSTEM], []
    for q, (text, _) in zip(questions, cached_run):
        clear(server.url)
        msgs.append({"role": "user", "content": q})
        cold, usage = chat(server.url, msgs, max_tokens=n)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        cold_texts.append(cold)
        msgs.append({"role": "assistant", "content": cold})
    assert [t for t, _ in cached_run] == cold_texts
    # every turn after the first reuses at least the whole previous prompt
    prev = None
    msgs = [SYSTEM]
    for q, (text, usage) in zip(questions, cached_run):
        msgs.append({"role": "user", "content": q})
        ids = prompt_ids(tokenizer, msgs)
        assert usage["prompt_tokens"] == len(ids)  # ... and came out as the template's own tokenization
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if prev is not None:
            assert len(prev) <= cached <= len(ids) - 1
        prev = ids
        msgs.append({"role": "assistant", "content": text})


def test_stream_usage_reports_cached_tokens(server, tokenizer):
    msgs = [SYSTEM, {"role": "user", "content": "Name a color."}]
    clear(server.url)
    chat(server.url, msgs)
    import json

    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")][0]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt_ids(tokenizer, msgs)) - 1


def test_sessions_hit_and_stats(server):
    before = httpx.get(server.url + "/stats").json()["prompt_cache"]
    msgs = [SYSTEM, {"role": "user", "content": "Count to three."}]
    text, _ = chat(server.url, msgs, headers={"X-Session-Id": "agent-42"})
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Now to five."}]
    _, usage = chat(server.url, msgs, headers={"X-Session-Id": "agent-42"})
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    after = httpx.get(server.url + "/stats").json()["prompt_cache"]
    assert after["session_hits"] > before["session_hits"]
    assert after["queries"] >= before["queries"] + 2
    assert after["tokens_hit"] > before["tokens_hit"]
    assert 0.0 <= after["token_hit_rate"] <= 1.0 and after["bytes"] <= after["max_bytes"]


def test_prompt_cache_key_in_body_binds_a_session(server):
    before = httpx.get(server.url + "/stats").json()["prompt_cache"]["session_hits"]
    msgs = [SYSTEM, {"role": "user", "content": "Say yes."}]
    text, _ = chat(server.url, msgs, prompt_cache_key="pck-1")
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Say no."}]
    chat(server.url, msgs, prompt_cache_key="pck-1")
    assert httpx.get(server.url + "/stats").json()["prompt_cache"]["session_hits"] > before


def test_cache_disabled_reports_zero(default_model_dir):
    srv = ServerProc("--model", "default", "--cache-bytes", "0")
    try:
        msgs = [SYSTEM, {"role": "user", "content": "Hello"}]
        a, _ = chat(srv.url, msgs, max_tokens=4)
        b, u = chat(srv.url, msgs, max_tokens=4)
        assert a == b and u["prompt_tokens_details"]["cached_tokens"] == 0
        assert httpx.get(srv.url + "/stats").json()["prompt_cache"]["enabled"] is False
    finally:
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def sliding_server(tmp_path_factory, default_model_dir):
    model_dir = write_sliding_window_model(tmp_path_factory.mktemp("swa") / "tiny-swa", default_model_dir, window=16)
    srv = ServerProc("--model", str(model_dir), "--cache-bytes", "64M")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_sliding_window_model_wraps_and_boundary_snapshot_hits(sliding_server):
    url = sliding_server.url
    turn1 = [SYSTEM, {"role": "user", "content": "Tell me about the ocean and the fish that live there."}]
    clear(url)
    text1, u1 = chat(url, turn1, max_tokens=6)
    assert u1["prompt_tokens"] > 16 * 2  # the window wrapped during prefill
    turn2 = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And the birds?"}]
    warm2, u2 = chat(url, turn2, max_tokens=6)
    # the untrimmable final entry can't serve turn2 unless it is an exact prefix; the
    # prompt-boundary snapshot (turn1's prompt minus its last token) always can
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"] - 1
    clear(url)
    cold2, u3 = chat(url, turn2, max_tokens=6)
    assert u3["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm2 == cold2
    # a full repeat of turn2 needs a trim of a wrapped entry: allowed only via a prefix entry,
    # and the text is still identical
    again, _ = chat(url, turn2, max_tokens=6)
    assert again == cold2


def test_a_hit_reads_the_cached_entry_in_place_and_gives_the_cold_text(server, tokenizer):
    """models.attention.shared_prefix on the real model: a hit extended by a new turn (a multi-token chunk after the shared
    prefix, then decoding) reads the entry where it lies (/stats counts it) and gives the cold text; the entry it
    read still serves the next hit unchanged."""
    def in_place():
        return httpx.get(server.url + "/stats").json()["lane"]["hits_read_in_place"]

    # 6 tokens a reply (it was 12: five requests, ~5 s of CPU): the hit's new turn is still a multi-token chunk
    # past the shared prefix, and five tokens are still decoded over the entry read in place
    n = 6
    first = [SYSTEM, {"role": "user", "content": "Name a sorting algorithm."}]
    clear(server.url)
    reply, _ = chat(server.url, first, max_tokens=n)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "How fast is it?"}]
    clear(server.url)
    cold, _ = chat(server.url, second, max_tokens=n)
    clear(server.url)
    chat(server.url, first, max_tokens=n)
    before = in_place()
    warm, u = chat(server.url, second, max_tokens=n)
    assert u["prompt_tokens_details"]["cached_tokens"] > 0
    assert in_place() > before
    assert warm == cold
    again, _ = chat(server.url, first, max_tokens=n)  # the donor entry was only read
    assert again == reply
