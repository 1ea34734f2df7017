"""The architecture zoo behind the real server (issue 35): two tiny random-weight models of tests.fixtures.zoo with
the default tokenizer and a thinking chat template, each served by a real uvicorn with n-gram speculation on:

- qwen3_5 (gated delta-net linear attention beside full attention: recurrent state), with the SSD tier and a LoRA
  adapter;
- gpt_oss (sliding windows with attention sinks, MoE): its window wraps within the first prompt. Before, every
  n-gram request whose cache had wrapped failed with a 500. Its MoE layers compute every expert for calls of up to 4
  tokens and sort every longer call's (token, expert) pairs (`--debug-moe-dense-max 4 --debug-moe-sort-min 1`,
  models.kernels.moe; mlx-lm sorts from 64 pairs).

Each: the first turn's text is mlx-lm's own greedy text; the next turn (whose template re-renders the history
without the reasoning) reuses the conversation through the reply (computed as it renders it: server.core.next_turn)
and gives the cold text; requests arriving at
different times give their alone text; n-gram drafts are verified. The engine-level checks of every zoo
architecture are in tests/unit/test_zoo_models.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.fixtures import zoo
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a coding agent. Answer briefly."}
TURN1 = [SYSTEM, {"role": "user", "content": "Write a function that reverses a list, and explain it in a line. "
                                            "Then list three edge cases a test of it should cover."}]


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("zoo")
    return {name: zoo.write(name, root / name, default_model_dir, chat_template=zoo.THINKING_TEMPLATE)
            for name in ("qwen3_5", "gpt_oss")}


@pytest.fixture(scope="module")
def adapter_dir(models, tmp_path_factory):
    from tests.fixtures.adapters import write_random_adapter

    return write_random_adapter(models["qwen3_5"], tmp_path_factory.mktemp("zoo-adapter") / "lora", seed=3,
                                num_layers=4)


@pytest.fixture(scope="module", params=["qwen3_5", "gpt_oss"])
def served(request, models, adapter_dir, tmp_path_factory):
    name = request.param
    args = ["--model", str(models[name]), "--cache-bytes", "64M", "--draft-kind", "ngram"]
    ssd = tmp_path_factory.mktemp(f"ssd-{name}")
    args += ["--ssd-cache", str(ssd)]
    if name == "qwen3_5":
        args += ["--adapter", f"lora={adapter_dir}"]
    else:  # every MoE call of up to 4 tokens computes every expert (decode steps), longer ones sort their (token,
        # expert) pairs (mlx-lm sorts from 64 pairs): the texts below are mlx-lm's (models.kernels.moe)
        args += ["--debug-moe-sort-min", "1", "--debug-moe-dense-max", "4"]
    srv = ServerProc(*args)
    srv.name, srv.model_dir, srv.args, srv.ssd = name, models[name], args, ssd
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle(models):
    """mlx-lm's own greedy text for a chat prompt, per model (and per adapter)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    loaded = {}

    def text(name, messages, n, adapter=None):
        if (name, adapter) not in loaded:
            loaded[name, adapter] = load(str(models[name]), adapter_path=adapter)
        model, tokenizer = loaded[name, adapter]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        detokenizer = tokenizer.detokenizer  # mlx-lm's streaming one, as mlx_lm.server's chat replies use
        detokenizer.reset()
        for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
            if int(token) in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(int(token))
        detokenizer.finalize()
        return detokenizer.text

    return text


def history_end(model_dir, messages):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return len(load_tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=False))


def chat(url, messages, max_tokens=12, **extra):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    obj = r.json()
    msg = obj["choices"][0]["message"]
    # the generation prompt opened a think block: the reply is reasoning until the model closes it
    return (msg.get("reasoning_content") or "") + (msg.get("content") or ""), obj["usage"]


def clear(url):
    assert httpx.post(url + "/admin/cache/clear").status_code == 200


def test_thinking_turns_reuse_the_conversation_and_give_mlx_lm_text(served, oracle):
    url = served.url
    clear(url)
    first, u1 = chat(url, TURN1)
    assert first == oracle(served.name, TURN1, 12), served.name
    assert u1["prompt_tokens"] > zoo.WINDOW * 2  # a sliding window wrapped within it
    turn2 = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "Now in Rust."}]
    warm, u2 = chat(url, turn2, model="default")  # "default" names the base model, whatever it is: same cache
    # the stored turn parts from this one where the conversation ended (the think block); the server computed the
    # conversation as this turn renders it (server.core.next_turn), from a checkpoint there (the recurrent state or
    # the wrapped window cannot be cut back): reused through the reply
    assert u2["prompt_tokens_details"]["cached_tokens"] >= history_end(served.model_dir, turn2[:3]), u2
    assert u2["prompt_tokens_details"]["cached_tokens"] > history_end(served.model_dir, TURN1), u2
    assert warm == oracle(served.name, turn2, 12), served.name  # the cold text: the computed entry is exact
    stats = httpx.get(url + "/stats").json()
    assert stats["prompt_cache"]["checkpoint_hits"] >= 1
    # the hybrid's gated delta rule ran the chunked form of models.kernels (this CPU), the window model has none
    assert stats["lane"]["recurrent"] == ("chunked" if zoo.FAMILY[served.name] == "hybrid" else "none"), stats["lane"]
    # the MoE knobs reached the served model (models.kernels.moe): gpt-oss reads its experts densely or sorted
    assert stats["lane"]["experts"] == ("dense<=4,sort>=1" if served.name == "gpt_oss" else "none"), stats["lane"]
    assert stats["lane"]["batch_layout"] == "ragged"  # windows and hybrids decode in the ragged layout


def test_ngram_speculation_over_the_models_caches_never_fails_and_verifies_drafts(served):
    """A reply confined to a few tokens (logit_bias) repeats itself, so the n-gram source has drafts to propose,
    some accepted and some not; each reply equals the one decoded plainly (num_draft_tokens 0), and drafts were
    verified (a request used to fail with a 500 once a window wrapped)."""
    code = "def reverse(xs):\n    return xs[::-1]\n\n" * 6
    msgs = [SYSTEM, {"role": "user", "content": "Repeat this code exactly:\n" + code}]
    few = {"1000": 30, "1001": 30, "1002": 30}
    before = httpx.get(served.url + "/stats").json()["speculative"]
    spec, _ = chat(served.url, msgs, max_tokens=24, logit_bias=few)
    plain, _ = chat(served.url, msgs, max_tokens=24, num_draft_tokens=0, logit_bias=few)
    assert spec == plain
    after = httpx.get(served.url + "/stats").json()["speculative"]
    assert after["requests"] > before["requests"]
    assert after["drafted"] > before["drafted"], after


def test_requests_arriving_at_different_times_give_their_alone_text(served):
    prompts = [[SYSTEM, {"role": "user", "content": f"Task {i}: " + "describe a binary heap. " * (i + 1)}]
               for i in range(4)]
    alone = []
    for p in prompts:
        clear(served.url)
        alone.append(chat(served.url, p, max_tokens=64)[0])
    clear(served.url)
    got = [None] * 4
    batched_before = batched_ticks(served.url)
    joined_before = httpx.get(served.url + "/stats").json()["speculative"]["solo_joined_batch"]

    def one(i):
        got[i] = chat(served.url, prompts[i], max_tokens=64)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # staggered: each joins a batch already decoding
    for t in threads:
        t.join(300)
    assert got == alone, served.name
    assert batched_ticks(served.url) > batched_before  # they did decode together
    # the first arrived alone, so it was to speculate on its own (neither model can speculate in a batch): it joined
    # the others' plain batch instead, its state handed over exactly (the texts above)
    assert httpx.get(served.url + "/stats").json()["speculative"]["solo_joined_batch"] > joined_before


def batched_ticks(url):
    histogram = httpx.get(url + "/stats").json()["lane"]["batch_size"]["histogram"]
    return sum(n for size, n in histogram.items() if int(size) >= 2)


def test_a_restart_restores_the_conversation_from_ssd(served):
    """The SSD tier across a restart: a new process on the same directory serves the next turn from the files."""
    url = served.url
    clear(url)
    first, _ = chat(url, TURN1)
    assert httpx.post(url + "/admin/cache/flush", timeout=120).status_code == 200
    turn2 = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And in Go?"}]
    cold, _ = chat(url, turn2)  # (this request's own entries land too)
    again = ServerProc(*served.args)
    try:
        text, usage = chat(again.url, turn2)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
        assert text == cold
    finally:
        assert again.stop() == 0, again.log()


def test_a_lora_adapter_over_a_hybrid_model_gives_mlx_lm_text_and_is_cached(served, oracle, adapter_dir):
    if served.name != "qwen3_5":
        pytest.skip("the adapter is served beside the hybrid model only")
    url = served.url
    clear(url)
    base, _ = chat(url, TURN1)
    tuned, u1 = chat(url, TURN1, model="lora")
    assert tuned != base
    assert tuned == oracle("qwen3_5", TURN1, 12, adapter=str(adapter_dir))
    again, u2 = chat(url, TURN1, model="lora")
    assert again == tuned and u2["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("name", ["qwen3_5", "gpt_oss"])
def test_prompts_prefilled_together_as_on_a_gpu_give_mlx_lm_text(name, models, oracle):
    """``--prefill-batch 4`` (a GPU's default) on this CPU: four chats sent at once prefill in batched forwards (a
    hybrid's recurrent state and a sliding window's wrapped buffer merged and split back by mlx-lm's batch prefill),
    and each reply is mlx-lm's own greedy text for it alone."""
    prompts = [[SYSTEM, {"role": "user", "content": f"Task {i}: " + "list the steps of a merge sort. " * (i + 2)}]
               for i in range(4)]
    srv = ServerProc("--model", str(models[name]), "--cache-bytes", "64M", "--prefill-batch", "4")
    try:
        got = [None] * 4

        def one(i):
            got[i] = chat(srv.url, prompts[i], max_tokens=24)[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert got == [oracle(name, p, 24) for p in prompts], name
        forwards = httpx.get(srv.url + "/stats").json()["lane"]["prefill_batches"]["forwards"]
        assert forwards >= 1, name  # they did prefill together
    finally:
        assert srv.stop() == 0, srv.log()
