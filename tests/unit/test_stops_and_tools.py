"""Stop-string hold-back and tool-call parsing (pure text logic, no model)."""

import json
from types import SimpleNamespace

import pytest

from server.core.output_parse import make_output_parser, parse_complete
from server.lane.stops import StopMatcher

# A tokenizer that names no tool format and has no thinking tags: the parser falls back to Hermes.
PLAIN = SimpleNamespace(has_tool_calling=False, has_thinking=False)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content without tool-call blocks, tool_calls) of a finished reply in the Hermes format."""
    _, content, calls = parse_complete(PLAIN, text, tools=True)
    return content, calls


class ToolCallFilter:
    """A streamed reply's text pieces up to a ``<tool_call>``; the calls at the end."""

    def __init__(self):
        self._parser = make_output_parser(PLAIN, tools=True)

    def feed(self, text: str) -> str:
        return "".join(p.text for p in self._parser.feed(text))

    def finish(self) -> tuple[str, list[dict]]:
        pieces, calls = self._parser.finish()
        return "".join(p.text for p in pieces), calls


def run(stops, pieces):
    m = StopMatcher(list(stops))
    out = [m.feed(p) for p in pieces]
    return out, m


@pytest.mark.parametrize(
    "stops,pieces,emitted,stopped",
    [
        ([], ["ab", "cd"], "abcd", False),
        (["END"], ["hello E", "N", "D tail"], "hello ", True),
        (["END"], ["hello E", "Nx"], "hello ENx", False),
        (["\n\n"], ["a\n", "\nb"], "a", True),
        (["stop", "st"], ["xs", "t"], "x", True),
        (["abc"], ["a", "b", "c"], "", True),
        (["abc"], ["zab", "d"], "zabd", False),
    ],
)
def test_stop_matcher(stops, pieces, emitted, stopped):
    out, m = run(stops, pieces)
    text = "".join(out) + m.flush()
    assert text == emitted
    assert m.stopped is stopped


def test_partial_stop_never_emitted_before_it_resolves():
    m = StopMatcher(["<|end|>"])
    assert m.feed("ok <|e") == "ok "
    assert m.feed("nd") == ""
    assert m.feed("|>more") == ""
    assert m.stopped


def test_parse_tool_calls_extracts_json_and_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert len(calls) == 1
    assert calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_")


def test_parse_tool_calls_two_calls_and_unclosed_last():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}'
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert content == ""


def test_parse_tool_calls_invalid_json_stays_text():
    text = "<tool_call>{not json}</tool_call>"
    content, calls = parse_tool_calls(text)
    assert calls == []
    assert content == text


def test_tool_filter_streams_content_and_buffers_call():
    f = ToolCallFilter()
    pieces = ["Sure", ". <tool", '_call>{"name": "f", ', '"arguments": {"a": 2}}</tool_call>']
    streamed = "".join(f.feed(p) for p in pieces)
    rest, calls = f.finish()
    assert streamed == "Sure."  # whitespace bordering a parsed call is dropped, as parse_tool_calls does
    assert rest == ""
    assert calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2}


def test_tool_filter_without_call_releases_everything():
    f = ToolCallFilter()
    streamed = f.feed("a <tool") + f.feed("box")
    rest, calls = f.finish()
    assert streamed + rest == "a <toolbox"
    assert calls == []


def test_top_p_zero_means_greedy_and_defaults_follow_openai():
    from server.core.prompts import sampling_params
    from server.http.chat.door import chat_request
    from server.http.chat.schemas import ChatCompletionRequest

    def chat(**fields):
        return chat_request(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields), {})

    greedy = sampling_params(chat(top_p=0, temperature=0.8), 5, 100, default_max_tokens=50, vocab_size=1000)
    assert greedy.temperature == 0.0 and greedy.top_p == 1.0
    default = sampling_params(chat(), 5, 100, default_max_tokens=50, vocab_size=1000)
    assert (default.temperature, default.top_p, default.max_tokens) == (1.0, 1.0, 50)
    short_room = sampling_params(chat(), 90, 100, default_max_tokens=50, vocab_size=1000)
    assert short_room.max_tokens == 10  # never past the context
