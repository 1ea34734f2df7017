"""Reasoning that keeps the prefix cache, effort read from the template, and the model's own sampling defaults
(issue 47 items 1, 2 and 4), through live servers of two thinking models with a Qwen3-style template
(tests.fixtures.thinking_model):

- ``default``: the tiny random llama of the default model's tokenizer (``tiny_llama_dir``, tests/conftest.py) with
  thinking tags in its vocabulary (what is checked is the template's rendering and the cache, not the text: the
  default model's own weights were ~25 s of CPU for these turns);
- ``qwen3_5``: the zoo's hybrid (gated delta-net beside attention: recurrent state that cannot be cut back), served
  with ``--ignore-model-defaults``.

Both declare ``do_sample: false`` in their generation_config.json. Five turns of a conversation each:

- thinking on, every turn's thinking kept (``preserve_thinking``, a chat_template_kwargs variable), the reply's
  ``reasoning_content`` sent back: the template renders it in the turn's think block, so each turn reuses everything
  the previous one computed (prompt and reply);
- thinking off: the generation prompt writes an empty think block the history does not show, so the next turn
  parts from the stored entry where the reply began; the server computes the conversation as the next turn renders
  it, and each turn finds it cached up to the end of the previous reply.
"""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures import zoo
from tests.fixtures.thinking_model import QWEN3_STYLE, thinking_tokenizer
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

GENERATION_CONFIG = '{"bos_token_id": 1, "eos_token_id": [2, 0], "do_sample": false, "temperature": 0.7, "top_p": 0.9}'
# the replies run to max_tokens: no end of turn, and no think tag written by the model itself
NO_END = {"2": -100, "0": -100, "15": -100, "16": -100}
TASK = [{"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "List the files, then read main.py and fix the failing test."}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("thinking")
    default = thinking_tokenizer(tiny_llama_dir, root / "default")
    (default / "generation_config.json").write_text(GENERATION_CONFIG)
    hybrid = zoo.write("qwen3_5", root / "qwen3_5", default, chat_template=QWEN3_STYLE)
    return {"default": default, "qwen3_5": hybrid}


@pytest.fixture(scope="module", params=["default", "qwen3_5"])
def served(request, model_dirs):
    name = request.param
    extra = ("--ignore-model-defaults",) if name == "qwen3_5" else ()
    srv = ServerProc("--model", str(model_dirs[name]), "--cache-bytes", "128M", *extra)
    srv.name, srv.model_dir = name, model_dirs[name]
    yield srv
    assert srv.stop() == 0, srv.log()


def chat(url, messages, max_tokens, **extra):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_END, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def chat_loop(url, thinking: bool, turns: int = 4):
    """A conversation: each reply sent back as it came (its reasoning included), then the user's next word."""
    messages, out = list(TASK), []
    kwargs = {"preserve_thinking": True} if thinking else {"enable_thinking": False}
    for turn in range(turns):
        obj = chat(url, messages, 6 if thinking else 8, chat_template_kwargs=kwargs)
        msg, usage = obj["choices"][0]["message"], obj["usage"]
        reply = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("reasoning_content") is not None:
            reply["reasoning_content"] = msg["reasoning_content"]
        out.append((list(messages), reply, usage))
        messages += [reply, {"role": "user", "content": f"Go on with step {turn + 1}."}]
    return out


def test_reasoning_sent_back_keeps_every_turn_cached(served):
    turns = chat_loop(served.url, thinking=True)
    assert all(reply["reasoning_content"] and not reply["content"] for _, reply, _ in turns)  # it thought
    for (_, _, before), (_, _, usage) in zip(turns, turns[1:]):
        # the previous prompt and its reply, nothing dropped: all reused (its last token was never fed)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= (before["prompt_tokens"]
                                                                   + before["completion_tokens"] - 1), (before, usage)


def test_a_reply_the_template_renders_otherwise_is_cached_as_the_next_turn_renders_it(served):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(served.model_dir)
    turns = chat_loop(served.url, thinking=False)
    dropped = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))  # what the history leaves out
    for (messages, reply, before), (_, _, usage) in zip(turns, turns[1:]):
        assert reply["content"] and "reasoning_content" not in reply
        rendered = tok.apply_chat_template(messages + [reply], add_generation_prompt=False, enable_thinking=False)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # the previous prompt minus what the template dropped, and the reply in its re-rendered place
        assert cached >= before["prompt_tokens"] - dropped + before["completion_tokens"], (before, usage)
        assert cached >= len(rendered), (len(rendered), usage)


def test_the_responses_and_messages_doors_send_reasoning_back_too(served):
    """Codex's path (a stored response continued: its reasoning item goes back with it) and Claude Code's (a
    thinking block in the assistant turn): the next turn reuses the whole previous turn."""
    import anthropic
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    keep = {"chat_template_kwargs": {"preserve_thinking": True}}
    first = client.responses.create(model=served.name, instructions=TASK[0]["content"], input=TASK[1]["content"],
                                    max_output_tokens=6, temperature=0, extra_body=keep)
    assert first.output[0].type == "reasoning"
    second = client.responses.create(model=served.name, previous_response_id=first.id, instructions=TASK[0]["content"],
                                     input="Go on.", max_output_tokens=2, temperature=0, extra_body=keep)
    previous = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= previous - 1

    claude = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    one = claude.messages.create(model=served.name, max_tokens=6, system=TASK[0]["content"], messages=[TASK[1]],
                                 extra_body={"temperature": 0, **keep})
    thinking = [b for b in one.content if b.type == "thinking"]
    assert thinking
    two = claude.messages.create(model=served.name, max_tokens=2, system=TASK[0]["content"], messages=[
        TASK[1], {"role": "assistant", "content": [b.model_dump() for b in one.content]},
        {"role": "user", "content": "Go on."}], extra_body={"temperature": 0, **keep})
    previous = one.usage.input_tokens + one.usage.cache_read_input_tokens + one.usage.output_tokens
    assert two.usage.cache_read_input_tokens >= previous - 1


@pytest.mark.parametrize("path, body, header", [
    ("/v1/chat/completions", {"messages": TASK, "reasoning_effort": "high"}, "xhigh"),
    ("/v1/chat/completions", {"messages": TASK, "chat_template_kwargs": {"reasoning_effort": "max",
                                                                         "enable_thinking": False}}, "xhigh"),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "minimal"}}, "low"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "output_config": {"effort": "medium"},
                      "thinking": {"type": "enabled", "budget_tokens": 64}}, "medium"),
])
def test_every_effort_form_becomes_a_level_the_template_takes(served, path, body, header):
    """The template raises on any level but low / medium / xhigh: each form is mapped, never a 500."""
    size = {"/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    r = httpx.post(served.url + path, json={"model": served.name, size: 1, **body}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-reasoning-effort"] == header


def test_sampling_defaults_come_from_generation_config(served):
    card = httpx.get(served.url + "/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {"temperature": 0.0, "top_p": 0.9}  # do_sample false: greedy
    applied = served.name == "default"
    assert card["sampling_defaults_applied"] is applied
    body = {"messages": TASK, "max_tokens": 8, "seed": 7, "logit_bias": NO_END}
    unsaid = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120).json()
    greedy = httpx.post(served.url + "/v1/chat/completions", json={**body, "temperature": 0}, timeout=120).json()
    same = unsaid["choices"][0]["message"] == greedy["choices"][0]["message"]
    assert same is applied  # the model's greedy default, or (--ignore-model-defaults) the API's temperature 1.0


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": TASK, "reasoning_effort": "xhigh",
                              "chat_template_kwargs": {"enable_thinking": True}}),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "none"}, "chat_template_kwargs": {"x": 1}}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "output_config": {"effort": "max"},
                      "thinking": {"type": "disabled"}}),
])
def test_a_template_without_effort_takes_every_form_unchanged(server, path, body):
    """The default model's ChatML template reads no reasoning variables: each form is accepted, none is passed."""
    size = {"/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    r = httpx.post(server.url + path, json={"model": "default", size: 1, **body}, timeout=120)
    assert r.status_code == 200, r.text
    assert "x-reasoning-effort" not in r.headers
