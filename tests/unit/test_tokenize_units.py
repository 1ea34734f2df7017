"""/tokenize and /detokenize without a model: which body shape is which, each shape's defaults, chat rendering equal
to a chat completion's, llama.cpp's pieces, and the vocabulary check (mlx-lm's real TokenizerWrapper over a toy
word-level tokenizer; the byte alphabet against mlx-lm's own)."""

from __future__ import annotations

import pydantic
import pytest

from server.core.prompts import render
from server.errors import InvalidRequest
from server.http.chat.door import chat_request
from server.http.chat.schemas import ChatCompletionRequest
from server.http.tokenize import (
    DetokenizeRequest, TokenizeChatRequest, TokenizeTextRequest, _byte_alphabet, _schema_of, answer, detokenize,
    piece_of, tokenize_chat, tokenize_text,
)
from tests.fixtures.template_tokenizer import WORDS, template_tokenizer

CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return template_tokenizer(tmp_path_factory.mktemp("tokenize"))


@pytest.mark.parametrize("body,schema", [
    ({"prompt": "hi"}, TokenizeTextRequest),
    ({"content": "hi", "with_pieces": True}, TokenizeTextRequest),
    ({"messages": [{"role": "user", "content": "hi"}]}, TokenizeChatRequest),
])
def test_the_input_field_chooses_the_shape(body, schema):
    assert _schema_of(body) is schema


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"model": "m", "tokens": [1]}, "prompt"),
    ({"messages": [], "prompt": "x"}, "messages"),
])
def test_no_input_or_two_inputs_is_a_400(body, param):
    with pytest.raises(InvalidRequest) as exc:
        _schema_of(body)
    assert exc.value.param == param


@pytest.mark.parametrize("body,adds", [
    ({"prompt": "x"}, True),  # vLLM's default
    ({"content": "x"}, False),  # llama.cpp's default
    ({"prompt": "x", "add_special_tokens": False}, False),
    ({"content": "x", "add_special": True}, True),
    ({"content": "x", "add_special_tokens": True, "add_special": False}, True),  # vLLM's name wins
])
def test_each_text_shape_keeps_its_own_special_token_default(body, adds):
    assert TokenizeTextRequest.model_validate(body).adds_special() is adds


@pytest.mark.parametrize("body", [{"prompt": "x", "content": "y"}, {"prompt": None}])
def test_text_needs_exactly_one_of_prompt_and_content(body):
    with pytest.raises(InvalidRequest):
        TokenizeTextRequest.model_validate(body).text()


def test_special_tokens_added_only_when_asked(tok):
    bos = tok.convert_tokens_to_ids("<bos>")
    plain = tokenize_text(tok, TokenizeTextRequest.model_validate({"content": "hello why"}))
    special = tokenize_text(tok, TokenizeTextRequest.model_validate({"prompt": "hello why"}))
    assert plain == [WORDS.index("hello"), WORDS.index("why")]
    assert special == [bos, *plain]


def test_parse_special_false_reads_special_token_text_as_text(tok):
    think = tok.convert_tokens_to_ids("<think>")
    parsed = tokenize_text(tok, TokenizeTextRequest.model_validate({"content": "<think> hello"}))
    literal = tokenize_text(tok, TokenizeTextRequest.model_validate({"content": "<think> hello",
                                                                     "parse_special": False}))
    assert parsed == [think, WORDS.index("hello")]
    assert think not in literal and literal[-1] == WORDS.index("hello")


def test_chat_ids_are_what_a_chat_completion_computes(tok):
    ids = tokenize_chat(tok, TokenizeChatRequest.model_validate(CHAT))
    completion = chat_request(ChatCompletionRequest.model_validate(CHAT), {})
    assert ids == render(tok, completion, len(tok))
    assert tok.decode(ids) == "tools get_weather system be brief user hello assistant <think>"
    no_tools = tokenize_chat(tok, TokenizeChatRequest.model_validate({**CHAT, "tool_choice": "none"}))
    assert tok.decode(no_tools).startswith("system")  # tool_choice none: the tools are not shown, as in a chat


def test_generation_prompt_and_continued_message(tok):
    bare = tokenize_chat(tok, TokenizeChatRequest.model_validate({**CHAT, "add_generation_prompt": False}))
    assert tok.decode(bare) == "tools get_weather system be brief user hello"
    body = {**CHAT, "messages": CHAT["messages"] + [{"role": "assistant", "content": "ok"}],
            "continue_final_message": True}
    cont = tokenize_chat(tok, TokenizeChatRequest.model_validate(body))
    assert tok.decode(cont) == "tools get_weather system be brief user hello assistant ok"


@pytest.mark.parametrize("extra,param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),  # the last message is the user's
])
def test_continue_final_message_misuse_is_a_400(tok, extra, param):
    with pytest.raises(InvalidRequest) as exc:
        tokenize_chat(tok, TokenizeChatRequest.model_validate({**CHAT, **extra}))
    assert exc.value.param == param


def test_chat_with_special_tokens_adds_the_tokenizers_own_around_the_text(tok):
    bare = tokenize_chat(tok, TokenizeChatRequest.model_validate(CHAT))
    wrapped = tokenize_chat(tok, TokenizeChatRequest.model_validate({**CHAT, "add_special_tokens": True}))
    assert wrapped == [tok.convert_tokens_to_ids("<bos>"), *bare]


def test_answer_is_vllms_body_with_llama_cpps_tokens(tok):
    ids = [WORDS.index("hello"), WORDS.index("ok")]
    plain = answer(tok, ids, 4096, TokenizeTextRequest.model_validate({"prompt": "x"}))
    assert plain == {"count": 2, "max_model_len": 4096, "tokens": ids}
    rich = answer(tok, ids, 4096, TokenizeTextRequest.model_validate({"content": "x", "with_pieces": True,
                                                                       "return_token_strs": True}))
    assert rich["tokens"] == [{"id": ids[0], "piece": "hello"}, {"id": ids[1], "piece": "ok"}]
    assert rich["token_strs"] == ["hello", "ok"] and rich["count"] == 2


def test_detokenize_refuses_ids_outside_the_vocabulary(tok):
    size = len(tok)
    assert detokenize(tok, [WORDS.index("hello"), WORDS.index("why")], "m") == "hello why"
    assert detokenize(tok, [], "m") == ""
    for bad in ([size], [0, -1], [10**9]):
        with pytest.raises(InvalidRequest) as exc:
            detokenize(tok, bad, "m")
        assert exc.value.param == "tokens" and str(bad[-1]) in exc.value.message


@pytest.mark.parametrize("tokens", [["1"], [1.5], [True], "1 2", None])
def test_detokenize_takes_integer_ids_only(tokens):
    with pytest.raises(pydantic.ValidationError):
        DetokenizeRequest.model_validate({"tokens": tokens})


def test_byte_alphabet_is_gpt2s():
    from mlx_lm.tokenizer_utils import _byte_decoder  # mlx-lm's own copy of GPT-2's table

    assert _byte_alphabet() == _byte_decoder()
    assert sorted(_byte_alphabet().values()) == list(range(256))


class _Pieces:
    """decode / convert_ids_to_tokens of three tokens: whole text, half of 'é' (byte-level BPE), an SPM byte."""

    TOKENS = {0: ("Ġhi", " hi"), 1: ("Ã", "\ufffd"), 2: ("<0xA9>", "\ufffd"), 3: ("Ã©", "é")}

    def decode(self, ids):
        return "".join(self.TOKENS[i][1] for i in ids)

    def convert_ids_to_tokens(self, i):
        return self.TOKENS[i][0]


@pytest.mark.parametrize("token_id,piece", [(0, " hi"), (1, [0xC3]), (2, [0xA9]), (3, "é")])
def test_a_piece_is_text_or_the_bytes_of_part_of_a_character(token_id, piece):
    assert piece_of(_Pieces(), token_id) == piece
