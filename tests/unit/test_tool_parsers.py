"""Output parsing per model family (server.output_parse): tool calls through mlx-lm's parsers, reasoning split.

Model-free: the "tokenizers" here are small objects carrying the attributes mlx-lm's TokenizerWrapper exposes
(has_tool_calling, tool_call_start/end, tool_parser, has_thinking, think_start/end), which is all the parser
reads. One test at the end loads the real default model's tokenizer.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from server.output_parse import HERMES, Piece, make_output_parser, parse_complete, tool_format

THINK = {"has_thinking": True, "think_start": "<think>", "think_end": "</think>"}


def fake_tokenizer(family: str | None = None, think: dict | None = None, **extra) -> SimpleNamespace:
    """A stand-in for mlx-lm's TokenizerWrapper: the tool family mlx-lm would detect, and thinking tags."""
    attrs = {"has_tool_calling": False, "tool_call_start": None, "tool_call_end": None, "tool_parser": None,
             "has_thinking": False, "think_start": None, "think_end": None}
    if family is not None:
        import importlib

        mod = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
        attrs.update(has_tool_calling=True, tool_call_start=mod.tool_call_start, tool_call_end=mod.tool_call_end,
                     tool_parser=mod.parse_tool_call)
    attrs.update(think or {})
    attrs.update(extra)
    return SimpleNamespace(**attrs)


def chunkings(text: str, seed: int = 0):
    """The same text as one piece, char by char, and in random 3-7 char chunks."""
    yield "whole", [text]
    yield "chars", list(text)
    rng = random.Random(seed)
    parts, i = [], 0
    while i < len(text):
        n = rng.randint(3, 7)
        parts.append(text[i : i + n])
        i += n
    yield "3-7", parts


def stream(tok, parts, **kw):
    """Feed the parts; return (all pieces merged by kind in order, calls, the pieces each feed returned)."""
    parser = make_output_parser(tok, **kw)
    per_feed = [parser.feed(p) for p in parts]
    rest, calls = parser.finish()
    merged: list[Piece] = []
    for p in [p for ps in per_feed for p in ps] + rest:
        if merged and merged[-1].kind == p.kind:
            merged[-1] = Piece(p.kind, merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged, calls, per_feed


def names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def check_shape(calls):
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == len(ids)
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        assert isinstance(c["function"]["arguments"], str)


# -- Hermes fallback and <think> reasoning ------------------------------------------------------------------
def test_tokenizer_without_tool_format_falls_back_to_hermes():
    assert tool_format(fake_tokenizer()) is HERMES
    assert tool_format(SimpleNamespace()) is HERMES  # no wrapper attributes at all


HERMES_CASES = [
    # (id, raw reply, expected pieces, expected calls)
    ("one call", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [Piece("text", "Let me check.")], [("get_weather", {"city": "Paris"})]),
    ("two calls then text",
     '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}'
     '</tool_call>\nDone.', [Piece("text", "Done.")], [("a", {}), ("b", {"x": [1, 2]})]),
    ("parameters key", '<tool_call>{"name": "f", "parameters": {"q": "é"}}</tool_call>', [], [("f", {"q": "é"})]),
    ("unclosed last call", 'x<tool_call>{"name": "g", "arguments": {"n": 1}}', [Piece("text", "x")], [("g", {"n": 1})]),
    ("invalid json stays text", "a <tool_call>{not json}</tool_call> b",
     [Piece("text", "a <tool_call>{not json}</tool_call> b")], []),
    ("json without a name stays text", '<tool_call>{"x": 1}</tool_call>', [Piece("text", '<tool_call>{"x": 1}</tool_call>')], []),
    ("truncated call stays text", 'ok <tool_call>{"name": "h", "argu', [Piece("text", 'ok <tool_call>{"name": "h", "argu')], []),
    ("no markup", "plain answer <tool box>", [Piece("text", "plain answer <tool box>")], []),
]


@pytest.mark.parametrize("case", HERMES_CASES, ids=[c[0] for c in HERMES_CASES])
def test_hermes_streamed_and_whole(case):
    _, raw, pieces, expected = case
    for how, parts in chunkings(raw):
        got, calls, _ = stream(fake_tokenizer(), parts, tools=True)
        assert got == pieces, how
        assert names_args(calls) == expected, how
        check_shape(calls)
    reasoning, content, calls = parse_complete(fake_tokenizer(), raw, tools=True)
    assert (reasoning, content, names_args(calls)) == ("", "".join(p.text for p in pieces), expected)


def test_tools_off_leaves_markup_as_text():
    raw = 'a <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_complete(fake_tokenizer(), raw, tools=False) == ("", raw, [])


def test_partial_marker_is_held_back_never_emitted():
    parser = make_output_parser(fake_tokenizer(think=THINK), tools=True)
    assert parser.feed("Hi <tool_") == [Piece("text", "Hi")]
    assert parser.feed("ca") == []
    assert parser.feed('ll>{"name": "f", "arguments": {}}</tool_call>') == []
    assert parser.feed("<thi") == []
    assert parser.feed("nk>why</th") == [Piece("reasoning", "why")]
    rest, calls = parser.finish()
    assert rest == [Piece("reasoning", "</th")]  # held while it could become </think>; the reply ended first
    assert names_args(calls) == [("f", {})]


def test_held_back_prefix_that_is_not_a_marker_is_released():
    parser = make_output_parser(fake_tokenizer(think=THINK), tools=True)
    assert parser.feed("a <tool") == [Piece("text", "a")]
    assert parser.feed("box") == [Piece("text", " <toolbox")]
    assert parser.feed(" <thin") == []
    assert parser.finish() == ([Piece("text", " <thin")], [])


THINK_CASES = [
    ("think then answer", "<think>\nstep one\nstep two\n</think>\n\nThe answer.", False,
     [Piece("reasoning", "step one\nstep two"), Piece("text", "The answer.")]),
    ("reply starts inside thinking", "hmm, 2+2\n</think>\n4", True,
     [Piece("reasoning", "hmm, 2+2"), Piece("text", "4")]),
    ("unclosed thinking", "<think>still going", False, [Piece("reasoning", "still going")]),
    ("answer only", "Just text.", True, [Piece("reasoning", "Just text.")]),  # opened by the prompt, never closed
    ("text before think", "A <think>b</think> c", False,
     [Piece("text", "A"), Piece("reasoning", "b"), Piece("text", "c")]),
]


@pytest.mark.parametrize("case", THINK_CASES, ids=[c[0] for c in THINK_CASES])
def test_reasoning_split(case):
    _, raw, in_reasoning, pieces = case
    tok = fake_tokenizer(think=THINK)
    for how, parts in chunkings(raw, seed=1):
        for tools in (False, True):
            got, calls, _ = stream(tok, parts, tools=tools, in_reasoning=in_reasoning)
            assert got == pieces, (how, tools)
            assert calls == []


def test_think_tags_are_text_for_a_model_without_them():
    raw = "<think>x</think>y"
    assert parse_complete(fake_tokenizer(), raw, tools=True) == ("", raw, [])
    # in_reasoning is ignored when the model has no thinking tags
    assert parse_complete(fake_tokenizer(), raw, tools=True, in_reasoning=True) == ("", raw, [])


def test_reasoning_then_tool_call_then_text():
    raw = ('<think>I should call f.</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
           'Calling f now.')
    for how, parts in chunkings(raw, seed=2):
        got, calls, _ = stream(fake_tokenizer(think=THINK), parts, tools=True)
        assert got == [Piece("reasoning", "I should call f."), Piece("text", "Calling f now.")], how
        assert names_args(calls) == [("f", {"a": 1})]


def test_tool_call_inside_reasoning_is_parsed():
    raw = '<think>let me look <tool_call>{"name": "f", "arguments": {}}</tool_call></think>ok'
    reasoning, content, calls = parse_complete(fake_tokenizer(think=THINK), raw, tools=True)
    assert reasoning == "let me look"
    assert names_args(calls) == [("f", {})]
    # mlx-lm's machine returns to "normal" after a call; the think block's late end marker is dropped there
    assert content == "ok"
