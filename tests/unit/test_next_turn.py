"""The next turn's rendering (server.core.next_turn): the conversation with the reply as the client sends it back,
through the opening of the next message. No model: mlx-lm's TokenizerWrapper over a toy word-level tokenizer."""

from __future__ import annotations

import pytest

from server.core import next_turn
from server.core.request import GenerationRequest
from tests.fixtures.template_tokenizer import template_tokenizer

KEEPS = ("{% for m in messages %}{{ m.role }} {% if m.reasoning_content %}<think> {{ m.reasoning_content }} </think> "
         "{% endif %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant <think> {% endif %}")
DROPS = ("{% for m in messages %}{{ m.role }} {{ m.content.split('</think>')[-1] }} {% endfor %}"
         "{% if add_generation_prompt %}assistant <think> {% endif %}")
REQ = GenerationRequest(messages=({"role": "user", "content": "why"},))


@pytest.fixture(autouse=True)
def words_the_toy_vocabulary_has(monkeypatch):
    monkeypatch.setattr(next_turn, "_FOLLOW", ("hello", "ok"))


@pytest.mark.parametrize("template, expected", [
    (KEEPS, "user why assistant <think> brief </think> ok user"),  # the thinking goes back in its block
    (DROPS, "user why assistant ok user"),  # the template drops it: the next turn does not show it
])
def test_the_reply_as_the_next_turn_renders_it(tmp_path, template, expected):
    tok = template_tokenizer(tmp_path, template)
    ids = next_turn.next_turn_tokens(tok, REQ, "ok", "brief", [])
    assert tok.decode(ids) == expected


def test_after_calls_the_next_message_is_the_tools(tmp_path):
    tok = template_tokenizer(tmp_path, "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    assert tok.decode(next_turn.next_turn_tokens(tok, REQ, "ok", "", [call])) == "user why assistant ok tool"


def test_a_template_that_refuses_gives_no_rendering(tmp_path):
    tok = template_tokenizer(tmp_path, "{{ raise_exception('no') }}")
    assert next_turn.next_turn_tokens(tok, REQ, "ok", "", []) is None
