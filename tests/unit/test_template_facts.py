"""What a chat template takes, read from the template (server.core.template_facts), and the three doors' effort forms
mapped onto it (issue 47 item 2). No model: mlx-lm's real TokenizerWrapper over a toy word-level tokenizer."""

from __future__ import annotations

import pytest

from server.core.prompts import render_chat, render_chat_text, template_variables
from server.core.request import GenerationRequest, template_wishes
from server.core.template_facts import EFFORT_SCALE, TemplateFacts, effort_level, template_facts
from server.errors import InvalidRequest
from tests.fixtures.template_tokenizer import THINKING_TEMPLATE, template_tokenizer

# Qwen3.8's shape: three levels of its own, anything else raises
ONLY_THREE = (
    "{%- if reasoning_effort is defined and reasoning_effort not in ['low', 'medium', 'xhigh'] -%}"
    "{{ raise_exception('reasoning_effort must be low, medium or xhigh') }}{%- endif -%}"
    "{% if reasoning_effort is defined %}effort {{ reasoning_effort }} {% endif %}"
    "{% for m in messages %}{{ m.role }} {% if m.reasoning_content %}<think> {{ m.reasoning_content }} </think> "
    "{% endif %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant <think> {% endif %}")
# gpt-oss's shape: any string after "Reasoning:", its default the only level it names; past reasoning in `thinking`
ANY_STRING = (
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = \"medium\" %}{%- endif -%}"
    "system Reasoning: {{ reasoning_effort }} "
    "{% for m in messages %}{{ m.role }} {% if m.thinking %}{{ m.thinking }} {% endif %}{{ m.content }} "
    "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
PLAIN = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return {name: template_tokenizer(tmp_path_factory.mktemp(name), template)
            for name, template in (("only_three", ONLY_THREE), ("any_string", ANY_STRING), ("plain", PLAIN),
                                   ("thinking", THINKING_TEMPLATE))}


def test_the_facts_read_from_each_template(toks):
    assert template_facts(toks["only_three"]) == TemplateFacts(("low", "medium", "xhigh"), True)
    assert template_facts(toks["any_string"]) == TemplateFacts(("low", "medium", "high"), True)
    assert template_facts(toks["plain"]) == TemplateFacts((), False)
    assert template_facts(toks["thinking"]).effort_levels == ("low", "medium", "high")


@pytest.mark.parametrize("asked, level", [
    ("none", "low"), ("minimal", "low"), ("low", "low"), ("medium", "medium"),
    ("high", "xhigh"),  # as near to medium as to xhigh: the higher
    ("xhigh", "xhigh"), ("max", "xhigh"),
])
def test_a_level_the_template_lacks_becomes_the_nearest_it_takes(asked, level):
    choice = effort_level(TemplateFacts(("low", "medium", "xhigh")), asked)
    assert choice.level == level and choice.changed == (asked != level)


def test_a_template_without_effort_gets_none():
    assert effort_level(TemplateFacts(()), "high").level is None


@pytest.mark.parametrize("name", ["only_three", "any_string", "plain", "thinking"])
@pytest.mark.parametrize("asked", EFFORT_SCALE)
def test_every_level_renders_on_every_template(toks, name, asked):
    """Never a template error for an effort: each level becomes one the template takes (or none)."""
    req = GenerationRequest(messages=({"role": "user", "content": "hello"},), reasoning_effort=asked)
    assert render_chat(toks[name], req)


def test_effort_none_turns_thinking_off_unless_the_request_says(toks):
    tok = toks["thinking"]
    off = template_variables(GenerationRequest(reasoning_effort="none"), tok)
    assert off == {"reasoning_effort": "low", "enable_thinking": False}
    on = template_variables(GenerationRequest(reasoning_effort="none", enable_thinking=True), tok)
    assert on["enable_thinking"] is True
    assert template_variables(GenerationRequest(reasoning_effort="none"), toks["plain"]) == {"enable_thinking": False}


def test_chat_template_kwargs_split_into_switch_effort_and_the_rest():
    wishes = template_wishes({"enable_thinking": False, "reasoning_effort": "high", "custom_flag": 3})
    assert (wishes.enable_thinking, wishes.reasoning_effort, dict(wishes.template_kwargs)) == (False, "high",
                                                                                               {"custom_flag": 3})
    door_wins = template_wishes({"enable_thinking": False, "reasoning_effort": "high"}, enable_thinking=True,
                                effort="low")
    assert (door_wins.enable_thinking, door_wins.reasoning_effort) == (True, "low")


@pytest.mark.parametrize("kwargs, param", [
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"reasoning_effort": 3}, "chat_template_kwargs.reasoning_effort"),
])
def test_template_kwargs_the_server_sets_itself_are_a_400(kwargs, param):
    with pytest.raises(InvalidRequest) as exc:
        template_wishes(kwargs)
    assert exc.value.param == param


# -- past reasoning sent back (issue 47 item 1) --------------------------------------------------------------------

TURNS = ({"role": "user", "content": "why"}, {"role": "assistant", "content": "ok", "reasoning_content": "brief"},
         {"role": "user", "content": "hello"})


def rendered(tok, messages) -> str:
    return render_chat_text(tok, GenerationRequest(messages=tuple(messages)))


def test_a_template_that_reads_past_reasoning_gets_it(toks):
    assert "assistant <think> brief </think> ok" in rendered(toks["only_three"], TURNS)
    assert "assistant brief ok" in rendered(toks["any_string"], TURNS)  # gpt-oss's `thinking` field


def test_otherwise_it_goes_back_in_the_models_think_tags(toks):
    """The toy template renders the text as it is: the reply reads as the model wrote it, tags and all."""
    assert "assistant <think>\nbrief\n</think>\n\nok" in rendered(toks["thinking"], TURNS)


def test_a_model_without_think_tags_never_produced_it(tmp_path):
    plain = template_tokenizer(tmp_path, PLAIN, think=False)
    assert rendered(plain, TURNS) == rendered(plain, [TURNS[0], {"role": "assistant", "content": "ok"}, TURNS[2]])


def test_the_three_doors_carry_it_the_same_way():
    from server.http.chat.door import chat_request
    from server.http.chat.schemas import ChatCompletionRequest
    from server.http.messages.schemas import MessagesRequest
    from server.http.messages.translate import messages_request
    from server.http.responses.schemas import ResponsesRequest
    from server.http.responses.translate import responses_request

    chat = chat_request(ChatCompletionRequest.model_validate({"messages": list(TURNS)}), {})
    responses = responses_request(ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "why"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "brief"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "hello"}]}))
    messages = messages_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "brief", "signature": "s"},
                                          {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "hello"}]}))
    assert chat.messages == responses.messages == messages.messages == TURNS


def test_a_turn_of_thinking_alone_is_an_assistant_message_of_its_own():
    """A reply cut while thinking has one reasoning item and no message: it still goes back as the assistant's turn
    (the chat door's {"content": "", "reasoning_content": ...})."""
    from server.http.responses.schemas import ResponsesRequest
    from server.http.responses.translate import responses_request

    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "brief"}]}
    req = responses_request(ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "why"}, thought,
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}, thought]}))
    assert req.messages == ({"role": "user", "content": "why"},
                            {"role": "assistant", "content": "", "reasoning_content": "brief"},
                            {"role": "tool", "content": "ok", "tool_call_id": "c1"},
                            {"role": "assistant", "content": "", "reasoning_content": "brief"})
