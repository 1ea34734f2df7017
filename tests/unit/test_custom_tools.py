"""Custom (freeform) tools and the client-side tool search on /v1/responses, model-free: what Codex CLI sends
(tests/fixtures/agents: a request Codex CLI 0.171 made with a model it knows), its translation into the internal
request, the grammar a call's input follows (Codex's own apply_patch Lark grammar), how calls are parsed back, how
they are rendered in the history, and the output items and stream events the OpenAI SDK reads."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from server.core.grammar import CustomInput, check_custom_grammar, custom_call_header, tool_call_grammar
from server.core.output_parse import make_output_parser
from server.core.prompts import chat_grammar
from server.core.template_input import _custom_calls
from server.core.request import ROOM
from server.errors import InvalidRequest
from server.http.responses.format import ResponsesStream, response_base
from server.http.responses.schemas import ResponsesRequest
from server.http.responses.translate import (
    SEARCH_NAME, items_for_history, output_to_items, responses_request, tool_index,
)
from server.lane.events import Finished
from tests.fixtures.byte_tokenizer import ByteTokenizer, accepts

CODEX = json.loads((Path(__file__).parents[1] / "fixtures" / "agents" / "codex_0171_gpt55_request.json").read_text())
PATCH_GRAMMAR = next(t for t in CODEX["body"]["tools"] if t.get("type") == "custom")["format"]["definition"]
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
APPLY_PATCH = CustomInput("apply_patch", "lark", PATCH_GRAMMAR)
OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


def custom_call_text(name: str, text: str) -> str:
    return OPEN + custom_call_header(name) + text + CLOSE


def codex(**changes) -> ResponsesRequest:
    return ResponsesRequest.model_validate({**CODEX["body"], **changes})


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


# -- what Codex CLI sends -------------------------------------------------------------------------------------------
def test_codexs_request_validates_and_offers_its_tools_but_the_hosted_one(caplog):
    with caplog.at_level(logging.INFO, logger="mlx_lane.responses"):
        req = codex()
    kinds = [t.type for t in req.tools]
    assert "custom" in kinds and "tool_search" in kinds and "web_search" not in kinds  # hosted: not offered
    internal = responses_request(req)
    assert [c.name for c in internal.custom_tools] == ["apply_patch"]
    assert internal.custom_tools[0].syntax == "lark" and internal.custom_tools[0].definition == PATCH_GRAMMAR
    assert SEARCH_NAME in internal.function_names and "exec_command" in internal.function_names
    assert internal.default_max_tokens == ROOM  # Codex sends no max_output_tokens: the room left, not 2048
    assert responses_request(req, max_tokens_cap=100).default_max_tokens == 100  # an operator's explicit cap


def test_a_custom_tool_is_shown_to_templates_as_a_function_of_one_input_string():
    (tool,) = responses_request(codex()).custom_tools
    fn = tool.as_function()["function"]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"]
    assert "freeform" in fn["description"] and "FREEFORM" in fn["description"]  # Codex's own words kept


@pytest.mark.parametrize("choice,forced", [({"type": "custom", "name": "apply_patch"}, "apply_patch"),
                                           ({"type": "function", "name": "exec_command"}, "exec_command")])
def test_tool_choice_may_name_a_custom_tool(choice, forced):
    assert responses_request(codex(tool_choice=choice)).forced_tool == forced


# -- the grammar of a call -------------------------------------------------------------------------------------------
def test_codexs_patch_grammar_compiles_and_a_broken_one_is_named(tok):
    assert check_custom_grammar(APPLY_PATCH) is None
    broken = codex(tools=[{"type": "custom", "name": "bad", "format": {"type": "grammar", "syntax": "lark",
                                                                       "definition": "start: foo("}}])
    with pytest.raises(InvalidRequest) as exc:
        chat_grammar(tok, responses_request(broken))
    assert exc.value.status_code == 400 and "'bad'" in exc.value.message and exc.value.param == "tools"


def test_a_forced_custom_call_follows_the_tools_grammar(tok):
    g = tool_call_grammar([], answer=None, parallel=False, custom=[APPLY_PATCH])
    assert accepts(tok, g, custom_call_text("apply_patch", PATCH.rstrip("\n")))
    assert accepts(tok, g, custom_call_text("apply_patch", PATCH))  # the grammar's optional final LF
    assert not accepts(tok, g, custom_call_text("apply_patch", "*** Begin Patch\nno hunk\n*** End Patch"))
    assert not accepts(tok, g, '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "x"}}\n</tool_call>')


def test_with_tool_choice_auto_the_answer_is_text_or_calls_and_a_custom_input_still_follows_its_grammar(tok):
    g = tool_call_grammar([("exec_command", {"type": "object"})], answer="text", parallel=True,
                          custom=[APPLY_PATCH, CustomInput("note"), CustomInput("num", "regex", "[0-9]+/[0-9]+")])
    assert accepts(tok, g, "Just an answer.")
    assert accepts(tok, g, "I will edit it.\n" + custom_call_text("apply_patch", PATCH))
    assert not accepts(tok, g, "I will edit it.\n" + custom_call_text("apply_patch", "not a patch"))
    assert accepts(tok, g, '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>')
    assert accepts(tok, g, custom_call_text("note", "any text\nat all"))  # format text: free
    assert accepts(tok, g, custom_call_text("num", "3/4")) and not accepts(tok, g, custom_call_text("num", "3-4"))


def test_the_grammar_is_on_whenever_a_grammar_tool_is_offered_and_off_with_tool_choice_none(tok):
    assert chat_grammar(tok, responses_request(codex())) is not None  # the model may choose apply_patch
    assert chat_grammar(tok, responses_request(codex(tool_choice="none"))) is None
    required = chat_grammar(tok, responses_request(codex(tool_choice="required")))
    assert required is not None


# -- the model's call, parsed back -----------------------------------------------------------------------------------
PLAIN = SimpleNamespace(has_tool_calling=False, has_thinking=False)


@pytest.mark.parametrize("reply", [
    "Editing.\n" + custom_call_text("apply_patch", PATCH.rstrip("\n")),  # the raw form the grammar writes
    '<tool_call>\n{"name": "apply_patch", "arguments": {"input": ' + json.dumps(PATCH.rstrip("\n")) + "}}\n</tool_call>",
])
def test_a_call_to_a_custom_tool_comes_back_with_its_raw_input(reply):
    parser = make_output_parser(PLAIN, tools=True, custom_tools=["apply_patch"])
    pieces = parser.feed(reply)
    rest, calls = parser.finish()
    (call,) = calls
    assert call["type"] == "custom" and call["custom"] == {"name": "apply_patch", "input": PATCH.rstrip("\n")}
    assert "tool_call" not in "".join(p.text for p in pieces + rest)


def test_an_unknown_name_in_the_raw_form_stays_text():
    parser = make_output_parser(PLAIN, tools=True, custom_tools=["apply_patch"])
    text = custom_call_text("other", "x")
    pieces = parser.feed(text)
    rest, calls = parser.finish()
    assert calls == [] and "other" in "".join(p.text for p in pieces + rest)


# -- output items, stream events, history ----------------------------------------------------------------------------
CUSTOM = {"id": "call_1", "type": "custom", "custom": {"name": "apply_patch", "input": PATCH}}
SEARCH = {"id": "call_2", "type": "function", "function": {"name": SEARCH_NAME, "arguments": '{"query": "agents"}'}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def finished() -> Finished:
    return Finished("stop", 10, 5, 0, 10, 0.1, 4, 0.1, 0.0)


def test_calls_become_custom_tool_call_and_tool_search_call_items():
    index = tool_index(codex())
    custom, search = output_to_items("", "", [CUSTOM, SEARCH], tools=index)
    assert custom["type"] == "custom_tool_call" and custom["input"] == PATCH and custom["call_id"] == "call_1"
    assert search["type"] == "tool_search_call" and search["execution"] == "client"
    assert search["arguments"] == {"query": "agents"}


def test_the_stream_of_a_custom_call_validates_as_sdk_events():
    stream = ResponsesStream(response_base(codex(), "resp_1", "gpt-5.5"), tool_index(codex()))
    frames = stream.start() + stream.calls([CUSTOM, SEARCH]) + stream.finish(finished(), "tool_calls")[0]
    events = [EVENTS.validate_python(json.loads(f.split(b"data: ", 1)[1])) for f in frames]
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == PATCH
    final = events[-1].response
    assert [o.type for o in final.output] == ["custom_tool_call", "tool_search_call"]


def test_the_next_request_carries_the_calls_and_their_outputs_back():
    output = output_to_items("", "", [CUSTOM, SEARCH], tools=tool_index(codex()))
    found = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent",
             "parameters": {"type": "object"}}
    items = [*items_for_history(output),
             {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"},
             {"type": "tool_search_output", "call_id": "call_2", "execution": "client", "tools": [found]}]
    req = responses_request(codex(input=[{"role": "user", "content": "hi"}, *items]))
    assistant = next(m for m in req.messages if m["role"] == "assistant")
    assert [c["type"] for c in assistant["tool_calls"]] == ["custom", "function"]
    assert [m["content"] for m in req.messages if m["role"] == "tool"][0] == "Done!"
    assert "spawn_agent" in req.function_names  # what the search found is offered from then on


def test_the_history_writes_custom_calls_the_way_the_model_writes_them():
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [CUSTOM]}]
    (_, hermes) = _custom_calls(messages, hermes=True)
    assert "tool_calls" not in hermes and hermes["content"] == custom_call_text("apply_patch", PATCH)
    (_, other) = _custom_calls(messages, hermes=False)  # a template that only knows JSON calls
    assert other["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": {"input": PATCH}}


# -- cache breakpoints: where they fall in the prompt ----------------------------------------------------------------
class ChatML:
    """apply_chat_template of a ChatML model, one id per byte (what breakpoint_positions needs of a tokenizer)."""

    tool_call_start = None

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return list((text + ("<|im_start|>assistant\n" if add_generation_prompt else "")).encode())


def test_a_breakpoint_is_the_token_position_where_its_messages_end():
    from server.core.prompts import breakpoint_positions, render_chat
    from server.core.request import GenerationRequest, system_breakpoint

    messages = ({"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"})
    req = GenerationRequest(messages=messages, breakpoints=(1, 3, 4, 9))
    prompt = render_chat(ChatML(), req)
    first = len("<|im_start|>system\nRules.<|im_end|>\n")
    third = first + len("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n")
    assert breakpoint_positions(ChatML(), req, prompt) == (first, third)  # 4 = the whole prompt, 9: none
    assert system_breakpoint(messages) == (1,) and system_breakpoint(messages[:1]) == ()
