"""Claude Code's tool search on /v1/messages, model-free (issue 36 item 7): ``tool_reference`` blocks in a tool result
render in place as the referenced tool's definition, and ``defer_loading`` tools stay out of the chat template's tool
list yet callable. Replayed on three requests of one real Claude Code 2.1.332 session (tests/fixtures/agents; see
/work/notes/claude/REPORT.md): its ToolSearch call loads TaskCreate between turns 3 and 7, and turn 7 used to be a
400."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest

from server.core.output_parse import make_output_parser
from server.core.prompts import chat_grammar, render_chat_text
from server.http.messages.format import tool_use_block
from server.http.messages.schemas import MessagesRequest
from server.http.messages.translate import messages_request
from server.http.wire import validation_message
from tests.fixtures.byte_tokenizer import ByteTokenizer, accepts

AGENTS = Path(__file__).parents[1] / "fixtures" / "agents"


def turn(n: int) -> dict:
    """The body of request ``n`` of the captured session (1, 3 or 7)."""
    return json.loads((AGENTS / f"claude_code_2.1.332_turn{n}.json").read_text())["body"]


WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIDES = {"name": "get_tides", "input_schema": {"type": "object", "properties": {"port": {"type": "string"}}},
         "defer_loading": True}
# what the tool result shows for each: ToolSearch's own encoding (its description in the fixture promises it)
WEATHER_LINE = ('<function>{"description": "Weather of a city", "name": "get_weather", "parameters": '
                '{"type": "object", "properties": {"city": {"type": "string"}}}}</function>')
TIDES_LINE = ('<function>{"name": "get_tides", "parameters": {"type": "object", "properties": '
              '{"port": {"type": "string"}}}}</function>')


def searched(content, tools=(WEATHER, TIDES), **fields) -> MessagesRequest:
    """A conversation whose tool search answered with ``content``."""
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "tools": list(tools), **fields, "messages": [
        {"role": "user", "content": "Tides in Brest?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "tides"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": content}]}]})


def tool_message(req: MessagesRequest) -> str:
    (message,) = [m for m in messages_request(req).messages if m["role"] == "tool"]
    return message["content"]


# -- tool_reference -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,text", [
    ([{"type": "tool_reference", "tool_name": "get_tides"}], f"<functions>\n{TIDES_LINE}\n</functions>"),
    # a run of references is one <functions> block, in place between the texts around it
    ([{"type": "text", "text": "Found:"}, {"type": "tool_reference", "tool_name": "get_weather"},
      {"type": "tool_reference", "tool_name": "get_tides"}, {"type": "text", "text": "Done."}],
     f"Found:\n<functions>\n{WEATHER_LINE}\n{TIDES_LINE}\n</functions>\nDone."),
    # a name the request's tools lack: just its name
    ([{"type": "tool_reference", "tool_name": "get_moon"}], '<functions>\n<function>{"name": "get_moon"}</function>\n'
                                                            "</functions>"),
    # text blocks alone still read like a string
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
    ("plain", "plain"),
])
def test_a_tool_reference_renders_in_place_as_the_tools_definition(content, text):
    assert tool_message(searched(content)) == text


@pytest.mark.parametrize("content,param", [
    ([{"type": "tool_reference"}], "messages.2.content.0.content.0.tool_name"),
    ([{"type": "tool_reference", "tool_name": ""}], "messages.2.content.0.content.0.tool_name"),
    ([{"type": "tool_use", "id": "x", "name": "f", "input": {}}], "messages.2.content.0.content.0"),
])
def test_a_malformed_tool_result_block_is_a_400_naming_it(content, param):
    with pytest.raises(pydantic.ValidationError) as exc:
        searched(content)
    message, got = validation_message(exc.value.errors())
    assert got == param, message


def test_a_tool_reference_outside_a_tool_result_is_refused():
    with pytest.raises(pydantic.ValidationError):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "tool_reference", "tool_name": "get_tides"}]}]})


# -- defer_loading --------------------------------------------------------------------------------------------------
class ListingTokenizer:
    """A chat template stand-in: the tool list it is given, then each message (the prompt's text is its bytes)."""

    tool_call_start = None  # the Hermes format (server.core.template_input.writes_hermes)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True, **_):
        text = "tools: " + " ".join(t["function"]["name"] for t in tools or ()) + "\n"
        text += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return list(text.encode()) if tokenize else text


def prompt_text(body: dict) -> str:
    return render_chat_text(ListingTokenizer(), messages_request(MessagesRequest.model_validate(body)))


def test_deferred_tools_are_left_out_of_the_template_but_stay_offered():
    req = messages_request(searched([{"type": "tool_reference", "tool_name": "get_tides"}]))
    assert req.function_names == ["get_weather", "get_tides"] and req.deferred_tools == ("get_tides",)
    assert [t["function"]["name"] for t in req.template_tools] == ["get_weather"]
    assert render_chat_text(ListingTokenizer(), req).startswith("tools: get_weather\n<user>")
    # all tools deferred: the template is shown none of them
    assert prompt_text({"model": "m", "max_tokens": 5, "tools": [TIDES], "messages": [
        {"role": "user", "content": "x"}]}).startswith("tools: \n")


def test_a_call_to_a_deferred_tool_is_constrained_parsed_and_returned_as_tool_use():
    req = messages_request(searched([{"type": "tool_reference", "tool_name": "get_tides"}],
                                    tool_choice={"type": "tool", "name": "get_tides"}))
    call = '<tool_call>\n{"name": "get_tides", "arguments": {"port": "Brest"}}\n</tool_call>'
    tok = ByteTokenizer()
    grammar = chat_grammar(tok, req)  # forcing it is allowed: it is one of the request's tools
    assert grammar is not None and accepts(tok, grammar.grammar, call)
    assert not accepts(tok, grammar.grammar, call.replace('"Brest"', "7"))  # its arguments follow its schema
    parser = make_output_parser(SimpleNamespace(has_tool_calling=False, has_thinking=False), tools=True,
                                tool_specs=list(req.tools))
    parser.feed(call)
    _, calls = parser.finish()
    block = tool_use_block(calls[0])
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_tides", {"port": "Brest"})


# -- the captured Claude Code session -------------------------------------------------------------------------------
def test_claude_codes_turn_7_is_accepted_and_shows_the_loaded_tool_where_the_search_returned_it():
    body = turn(7)
    req = messages_request(MessagesRequest.model_validate(body))
    assert req.deferred_tools == ("TaskCreate", "DeferredToolPlaceholder")
    assert "TaskCreate" in req.function_names and "TaskCreate" not in [t["function"]["name"] for t in req.template_tools]
    task = next(t for t in body["tools"] if t["name"] == "TaskCreate")
    line = json.dumps({"description": task["description"], "name": "TaskCreate", "parameters": task["input_schema"]},
                      ensure_ascii=False)
    result = next(m for m in req.messages if m.get("tool_call_id") == "toolu_90de74966444409387f8")
    assert result["content"] == f"<functions>\n<function>{line}</function>\n</functions>"
    called = [c["function"]["name"] for m in req.messages for c in m.get("tool_calls", ())]
    assert called == ["Bash", "Read", "ToolSearch", "TaskCreate", "Bash"]


def test_loading_a_deferred_tool_keeps_the_prompt_an_extension_of_the_turn_before():
    before, after = prompt_text(turn(3)), prompt_text(turn(7))
    assert after.startswith(before.removesuffix("<assistant>"))
    assert before.splitlines()[0] == after.splitlines()[0]  # the same tool list: loading TaskCreate changed nothing
    assert prompt_text(turn(1)).removesuffix("<assistant>") in before
    # what the template would be shown had the tool not been deferred: the tool list, and every token after it, moves
    eager = turn(7)
    eager["tools"] = [{k: v for k, v in t.items() if k != "defer_loading"} for t in eager["tools"]]
    assert not prompt_text(eager).startswith(before.splitlines()[0] + "\n")
