"""A model only mlx-vlm loads, behind the real server (issue 46): a tiny random-weight qwen4_exp (Qwen3.8-Flash-Next:
gated delta-net beside sparse attention, a per-layer n-gram embedding table; tests/fixtures/zoo_vlm.py) written as an
mlx-vlm model directory with the default tokenizer and a thinking chat template, served with the SSD tier and n-gram
speculation on, through the openai client.

- the start-up line and /v1/models say it computes with mlx-vlm's classes;
- the first turn is mlx-vlm's own greedy text (``mlx_vlm.load`` + its ``generate_step`` on the same rendered prompt);
- the next turn (its template re-renders the history without the reasoning) reuses the conversation up to where it
  ended (a checkpoint of the recurrent state) and is mlx-vlm's text for it;
- n-gram speculation over its caches gives the plain reply and verifies drafts;
- a restart on the same SSD directory serves the next turn from the files.

The engine-level checks of every mlx-vlm-only architecture are in tests/unit/test_zoo_models.py."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.fixtures import zoo, zoo_vlm
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

pytest.importorskip("mlx_vlm")
NAME = "qwen4_exp"
SYSTEM = {"role": "system", "content": "You are a coding agent. Answer briefly."}
TURN1 = [SYSTEM, {"role": "user", "content": "Write a function that reverses a list, and explain it in a line."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return zoo_vlm.write(NAME, tmp_path_factory.mktemp("vlm-zoo") / NAME, default_model_dir,
                         chat_template=zoo.THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--cache-bytes", "64M", "--draft-kind", "ngram",
            "--ssd-cache", str(tmp_path_factory.mktemp("vlm-ssd"))]
    srv = ServerProc(*args)
    srv.args = args
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def oracle(model_dir):
    """mlx-vlm's own greedy text for a chat: its model and tokenizer, its ``generate_step``, mlx-lm's streaming
    detokenizer (as the server's chat replies use)."""
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm import load
    from mlx_vlm.generate import generate_step

    model, _ = load(str(model_dir))
    tokenizer = load_tokenizer(model_dir)

    def text(messages, n):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        for name in ("_position_ids", "_rope_deltas"):  # a fresh request, as mlx-vlm's own server starts one
            setattr(model.language_model, name, None)
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for token, _ in generate_step(mx.array([ids]), model, None, None, max_tokens=n, temperature=0.0):
            if int(token) in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(int(token))
        detokenizer.finalize()
        return detokenizer.text

    return text


def chat(srv, messages, max_tokens=12, **extra):
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body=extra or None)
    msg = r.choices[0].message
    # the generation prompt opened a think block: the reply is reasoning until the model closes it
    return (getattr(msg, "reasoning_content", None) or "") + (msg.content or ""), r.usage


def test_it_says_it_loads_from_mlx_vlm(served):
    (card,) = httpx.get(served.url + "/v1/models").json()["data"]
    assert (card["architecture"], card["source"]) == (NAME, "mlx-vlm"), card
    assert f"({NAME} via mlx-vlm)" in served.log()


def test_thinking_turns_are_mlx_vlm_text_and_reuse_the_conversation(served, oracle, model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    first, u1 = chat(served, TURN1)
    assert first == oracle(TURN1, 12)
    turn2 = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "Now in Rust."}]
    second, u2 = chat(served, turn2)
    # the stored turn parts from this one where the conversation ended (it cannot be cut back: from the checkpoint
    # of its recurrent state there); the server computed the conversation as this turn renders it
    # (server.core.next_turn), so the reply is reused too
    tokenizer = load_tokenizer(model_dir)
    history = len(tokenizer.apply_chat_template(TURN1, add_generation_prompt=False))
    through_reply = len(tokenizer.apply_chat_template(turn2[:-1], add_generation_prompt=False))
    assert through_reply <= u2.prompt_tokens_details.cached_tokens < u2.prompt_tokens, u2
    assert history < through_reply
    assert second == oracle(turn2, 12)


def test_ngram_speculation_gives_the_plain_reply_and_verifies_drafts(served):
    code = "def reverse(xs):\n    return xs[::-1]\n\n" * 6
    msgs = [SYSTEM, {"role": "user", "content": "Repeat this code exactly:\n" + code}]
    few = {"1000": 30, "1001": 30, "1002": 30}  # a reply of a few tokens repeats itself: drafts to verify
    before = httpx.get(served.url + "/stats").json()["speculative"]
    spec, _ = chat(served, msgs, max_tokens=24, logit_bias=few)
    plain, _ = chat(served, msgs, max_tokens=24, logit_bias=few, num_draft_tokens=0)
    assert spec == plain
    assert httpx.get(served.url + "/stats").json()["speculative"]["drafted"] > before["drafted"]


def test_a_restart_restores_the_conversation_from_ssd(served, oracle):
    first, _ = chat(served, TURN1)
    assert httpx.post(served.url + "/admin/cache/flush", timeout=120).status_code == 200
    turn2 = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And in Go?"}]
    again = ServerProc(*served.args)
    try:
        text, usage = chat(again, turn2)
        assert usage.prompt_tokens_details.cached_tokens > 0, usage
        assert text == oracle(turn2, 12)
    finally:
        assert again.stop() == 0, again.log()
