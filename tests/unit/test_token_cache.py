"""server.core.token_cache: a chat prompt tokenized from the pieces earlier prompts tokenized gives exactly the
tokenizer's own ids (the default model's real tokenizer and chat template, a growing agent conversation with tools);
a tokenizer whose pieces do not add up is found, by the probe or by the first comparisons, and tokenized whole."""

from __future__ import annotations

import threading

import pytest

from server.core import token_cache
from server.core.token_cache import SegmentEncoder, encoder_for

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    from models import ensure_default_model

    return load_tokenizer(ensure_default_model(progress=False))


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a coding agent.\n  Indented line, trailing spaces  \n"}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Turn {i}: read src/mod_{i}.py and say what\tit does.\n\n"})
        messages.append({"role": "assistant", "content": f" It parses <tags> and  {i * 7} numbers. "})
    messages.append({"role": "user", "content": "Go on."})
    return messages


def test_a_growing_conversation_tokenizes_exactly_and_its_earlier_turns_are_looked_up(tokenizer):
    enc = SegmentEncoder(tokenizer)
    assert enc.enabled
    for turns in (1, 2, 3, 6, 7):
        text = tokenizer.apply_chat_template(conversation(turns), tools=TOOLS, add_generation_prompt=True,
                                             tokenize=False)
        assert enc.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    first = enc.stats()
    text = tokenizer.apply_chat_template(conversation(8), tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert enc.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    after = enc.stats()
    # the 8th turn re-tokenized only its new pieces: the others came from the cache
    assert after["misses"] - first["misses"] <= 4 and after["hits"] - first["hits"] >= 2 * 7
    assert after["tokens_reused"] > first["tokens_reused"]


def test_the_prompt_path_gives_the_templates_own_ids(tokenizer):
    from server.core.prompts import _templated

    messages = conversation(4)
    kwargs = {"add_generation_prompt": True, "tools": TOOLS}
    assert _templated(tokenizer, messages, kwargs) == list(tokenizer.apply_chat_template(messages, **kwargs))
    assert encoder_for(tokenizer) is encoder_for(tokenizer)  # one per tokenizer object
    assert encoder_for(tokenizer).stats()["pieces"] > 0


def test_the_cache_is_bounded_in_tokens(tokenizer):
    enc = SegmentEncoder(tokenizer, max_tokens=60)
    for turns in range(1, 6):
        text = tokenizer.apply_chat_template(conversation(turns), add_generation_prompt=True, tokenize=False)
        assert enc.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert 0 < enc.stats()["tokens_held"] <= 60


def test_threads_encode_at_once_and_agree(tokenizer):
    enc = SegmentEncoder(tokenizer, verify_first=0)
    texts = [tokenizer.apply_chat_template(conversation(t), add_generation_prompt=True, tokenize=False)
             for t in range(1, 9)]
    want = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    errors = []

    def work():
        for _ in range(5):
            for t, w in zip(texts, want):
                if enc.encode(t) != w:
                    errors.append(t)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


class _Added:
    def __init__(self, content):
        self.content, self.special, self.lstrip = content, True, False


class PositionalTokenizer:
    """Ids that depend on where a character stands in the whole text: its pieces never add up."""

    added_tokens_decoder = {0: _Added("<s>")}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) + i for i, c in enumerate(text)]


class LongTextsDifferTokenizer(PositionalTokenizer):
    """Pieces add up for short texts (the probe's), not for a text past 200 characters."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text] + ([len(text)] if len(text) > 200 else [])


def test_a_tokenizer_whose_pieces_do_not_add_up_is_found_by_the_probe_and_tokenized_whole():
    tok = PositionalTokenizer()
    enc = SegmentEncoder(tok)
    assert not enc.enabled
    assert enc.encode("ab<s>cd") == tok.encode("ab<s>cd")


def test_a_difference_the_probe_missed_is_caught_by_the_first_comparisons():
    tok = LongTextsDifferTokenizer()
    enc = SegmentEncoder(tok)
    assert enc.enabled
    text = "x" * 150 + "<s>" + "y" * 150
    assert enc.encode(text) == tok.encode(text)  # compared with the whole text: the whole text's ids
    assert not enc.enabled and enc.stats()["pieces"] == 0
    assert enc.encode(text) == tok.encode(text)


def test_a_tokenizer_without_special_tokens_is_tokenized_whole():
    class Plain:
        added_tokens_decoder: dict = {}

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    enc = SegmentEncoder(Plain())
    assert not enc.enabled and enc.encode("abc") == [97, 98, 99]
    assert token_cache._splitter(Plain()) is None
