"""output_parse with mlx-lm's real TokenizerWrapper (no model): the family comes from the chat template, the
thinking tags from the vocabulary, and an open think block in the prompt starts the reply as reasoning. Plus the
chat formatter's reasoning_content shapes."""

from __future__ import annotations

import json

import pytest

from server.core.output_parse import HERMES, Piece, make_output_parser, prompt_opens_thinking, tool_format
from server.http.chat.format import ChatFormatter
from server.lane.events import Finished


def wrapper(tmp_path, template: str, think: bool = True):
    """A word-level toy tokenizer saved as a Hugging Face dir, loaded by mlx-lm (which detects the formats)."""
    from mlx_lm.tokenizer_utils import load
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "hello", "why", "ok"] + (["<think>", "</think>"] if think else [])
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    if think:
        hf.add_tokens(["<think>", "</think>"], special_tokens=True)
    hf.chat_template = template
    hf.save_pretrained(tmp_path)
    return load(tmp_path)


BODY = "{% for m in messages %}{{ m.content }} {% endfor %}"


@pytest.mark.parametrize("snippet,family", [
    ("{% if tools %}<tool_call>\\n<function=x>{% endif %}", "qwen3_coder"),
    ("{% if tools %}<tool_call>{{ tool_call.name }}{% endif %}", "json_tools"),
    ("{% if tools %}<minimax:tool_call>{% endif %}", "minimax_m2"),
    ("{% if tools %}[TOOL_CALLS]{% endif %}", "mistral"),
    ("{% if tools %}<|tool_call_start|>{% endif %}", "pythonic"),
    ("{% if tools %}<arg_key>{% endif %}", "glm47"),
    ("", None),  # a template that names no format: the Hermes fallback
])
def test_family_detected_from_the_chat_template(tmp_path, snippet, family):
    tok = wrapper(tmp_path, BODY + snippet)
    fmt = tool_format(tok)
    if family is None:
        assert tok.has_tool_calling is False and fmt is HERMES
    else:
        assert tok.has_tool_calling is True and fmt.name == family and fmt.start == tok.tool_call_start


def test_prompt_that_opens_thinking_starts_the_reply_in_reasoning(tmp_path):
    tok = wrapper(tmp_path, BODY + "{% if add_generation_prompt %}<think> {% endif %}")
    assert tok.has_thinking and tok.think_start == "<think>"
    opened = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    closed = tok.encode("hello <think> why </think>", add_special_tokens=False)
    assert prompt_opens_thinking(tok, opened) is True
    assert prompt_opens_thinking(tok, closed) is False
    parser = make_output_parser(tok, tools=False, in_reasoning=prompt_opens_thinking(tok, opened))
    assert parser.feed("why</think>ok") == [Piece("reasoning", "why"), Piece("text", "ok")]


def test_no_think_tags_in_the_vocabulary_means_no_reasoning(tmp_path):
    tok = wrapper(tmp_path, BODY, think=False)
    assert prompt_opens_thinking(tok, [2, 3]) is False
    parser = make_output_parser(tok, tools=False, in_reasoning=True)
    assert parser.feed("<think>a</think>b") == [Piece("text", "<think>a</think>b")]


# -- the chat formatter ------------------------------------------------------------------------------------
def fmt():
    return ChatFormatter(model="m", fingerprint="fp", id="chatcmpl-1")


def test_reasoning_and_content_chunks_carry_their_own_delta_field():
    chunks = [fmt().reasoning_chunk("think", []), fmt().content_chunk("answer", [])]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"reasoning_content": "think"}, {"content": "answer"}]


def test_completion_message_carries_reasoning_content_only_when_there_is_some():
    f = Finished(finish_reason="stop", prompt_tokens=3, completion_tokens=2, cached_tokens=0, prefill_tokens=3,
                 prefill_s=0.1, decode_tokens=1, decode_s=0.1, queued_s=0.0)
    with_r = fmt().completion("hi", [], None, "stop", f, reasoning="because")["choices"][0]["message"]
    without = fmt().completion("hi", [], None, "stop", f)["choices"][0]["message"]
    assert with_r == {"role": "assistant", "content": "hi", "refusal": None, "reasoning_content": "because"}
    assert without == {"role": "assistant", "content": "hi", "refusal": None}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": json.dumps({})}}
    only_call = fmt().completion("", [call], None, "tool_calls", f)["choices"][0]["message"]
    assert only_call["content"] is None and only_call["tool_calls"] == [call]
