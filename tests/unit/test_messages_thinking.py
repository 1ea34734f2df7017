"""Anthropic's ``thinking`` and ``output_config.effort`` -> the chat template's reasoning variables, and thinking
blocks in history (no model: mlx-lm's real TokenizerWrapper over a toy word-level tokenizer)."""

from __future__ import annotations

import pydantic
import pytest

from server.core.output_parse import prompt_opens_thinking
from server.core.prompts import breakpoint_marks, history_end, render_chat, template_variables
from server.core.request import GenerationRequest
from server.http.messages.schemas import EFFORTS, CountTokensRequest, MessagesRequest
from server.core.template_facts import EFFORT_SCALE
from server.http.messages.translate import messages_request, reasoning_wish
from server.http.wire import validation_message
from tests.fixtures.template_tokenizer import template_tokenizer

HELLO = [{"role": "user", "content": "hello"}]


def translate(**body):
    return messages_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": HELLO, **body}))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return template_tokenizer(tmp_path_factory.mktemp("thinking"))


def text(tok, ids) -> str:
    return tok.decode(ids)


@pytest.mark.parametrize("thinking,switch", [
    (None, None),
    ({"type": "enabled", "budget_tokens": 2048}, True),
    ({"type": "enabled"}, True),  # budget_tokens left out: accepted (it is not enforced anyway)
    ({"type": "disabled"}, False),
    ({"type": "adaptive"}, None),  # the template's default decides
])
def test_thinking_type_is_the_templates_switch(thinking, switch):
    body = {"thinking": thinking} if thinking is not None else {}
    req = translate(**body)
    assert req.enable_thinking is switch
    assert template_variables(req) == ({} if switch is None else {"enable_thinking": switch})


@pytest.mark.parametrize("effort,level", [("low", "low"), ("medium", "medium"), ("high", "high"),
                                          ("xhigh", "high"), ("max", "high")])
def test_effort_becomes_the_nearest_level_the_template_takes(tok, effort, level):
    """The toy template renders any level and names none: it gets OpenAI's three (server.core.template_facts)."""
    req = translate(output_config={"effort": effort})
    assert req.reasoning_effort == effort and template_variables(req, tok)["reasoning_effort"] == level
    assert req.enable_thinking is None  # effort alone does not switch thinking on or off


def test_every_anthropic_effort_is_on_the_scale():
    assert set(EFFORTS) <= set(EFFORT_SCALE)


def test_no_effort_and_other_output_config_members_pass_nothing():
    assert translate(output_config={}).reasoning_effort is None
    assert translate(output_config={"format": {"type": "json_schema", "schema": {}}}).reasoning_effort is None
    assert "reasoning_effort" not in template_variables(translate())


def test_count_tokens_maps_the_same_fields():
    """count_tokens renders what the message would: the same reasoning variables."""
    count = CountTokensRequest.model_validate({"model": "m", "messages": HELLO, "thinking": {"type": "disabled"},
                                               "output_config": {"effort": "low"}})
    assert reasoning_wish(count) == (False, "low")
    req = messages_request(count)
    assert (req.enable_thinking, req.reasoning_effort) == (False, "low")


@pytest.mark.parametrize("field,value,param", [
    ("thinking", {"type": "sometimes"}, "thinking.type"),
    ("thinking", {"type": "enabled", "budget_tokens": -1}, "thinking.budget_tokens"),
    ("thinking", "on", "thinking"),
    ("output_config", {"effort": "extreme"}, "output_config.effort"),
])
def test_bad_thinking_or_effort_is_a_400_naming_it(field, value, param):
    with pytest.raises(pydantic.ValidationError) as exc:
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": HELLO, field: value})
    _, got = validation_message(exc.value.errors())
    assert got == param


def test_thinking_blocks_in_history_go_back_with_their_turn():
    history = [
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "let me think", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "hello"},
    ]
    with_thinking = translate(messages=history)
    assert with_thinking.messages[1] == {"role": "assistant", "content": "ok", "reasoning_content": "let me think"}
    only = translate(messages=[history[0], {"role": "assistant", "content": [history[1]["content"][1]]},
                               history[2]])
    assert only.messages[1] == {"role": "assistant", "content": ""}  # redacted thinking only: an empty reply


# -- through a real template --------------------------------------------------------------------------------------

def test_disabled_thinking_closes_the_think_block_in_the_prompt(tok):
    default = render_chat(tok, translate())
    off = render_chat(tok, translate(thinking={"type": "disabled"}))
    on = render_chat(tok, translate(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert text(tok, default).endswith("assistant <think>") and prompt_opens_thinking(tok, default)
    assert text(tok, off).endswith("assistant <think> </think>") and not prompt_opens_thinking(tok, off)
    assert on == default  # mlx-lm passes the template's default (on, for a vocabulary with think tags)
    assert render_chat(tok, translate(thinking={"type": "adaptive"})) == default


def test_effort_reaches_a_template_that_reads_it(tok):
    ids = render_chat(tok, translate(output_config={"effort": "max"}))
    assert text(tok, ids).startswith("effort high user hello")
    assert not text(tok, render_chat(tok, translate())).startswith("effort")


def test_history_end_and_breakpoints_render_with_the_same_variables(tok):
    """The cut where the next turn parts (checkpoints) and the breakpoints are found in the prompt as rendered with
    the request's variables: with thinking off the generation prompt is longer, and the conversation still ends
    before it."""
    req = translate(thinking={"type": "disabled"}, system=[{"type": "text", "text": "be brief",
                                                               "cache_control": {"type": "ephemeral"}}])
    prompt = render_chat(tok, req)
    end = history_end(tok, req, prompt)
    assert text(tok, prompt[:end]) == "system be brief user hello"
    assert text(tok, prompt[end:]) == "assistant <think> </think>"
    marks = breakpoint_marks(tok, req, prompt)
    assert marks.anchors == (3,) and text(tok, prompt[:3]) == "system be brief"


def test_a_request_without_variables_renders_as_before(tok):
    """No variable set: nothing extra is passed (the template's defaults, the cache's past entries hold)."""
    req = GenerationRequest(messages=({"role": "user", "content": "hello"},))
    assert template_variables(req) == {}
    assert render_chat(tok, req) == tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                                            add_generation_prompt=True)
