"""Output parsing per model family (server.core.output_parse): tool calls through mlx-lm's parsers, reasoning split.

Model-free: the "tokenizers" here are small objects carrying the attributes mlx-lm's TokenizerWrapper exposes
(has_tool_calling, tool_call_start/end, tool_parser, has_thinking, think_start/end), which is all the parser
reads. One test at the end loads the real default model's tokenizer.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from server.core.output_parse import HERMES, Piece, make_output_parser, parse_complete, tool_format

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


# -- every family mlx-lm ships ------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}},
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"zone": "CET"})
XTML_THINK = {"has_thinking": True, "think_start": "<|open|>think<|sep|>", "think_end": "<|close|>think<|sep|>",
              "structural_markers": ("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>")}


def _muse_format():
    from mlx_lm.chat_templates.muse_spark import RESPONSE_FORMAT

    return {"response_transitions": RESPONSE_FORMAT["transitions"],
            "response_initial_state": RESPONSE_FORMAT["initial_state"]}


# (family module, thinking attrs, raw reply in the family's own format, reasoning, content, calls)
FAMILIES = [
    ("json_tools", THINK,
     '<think>\nNeed weather and time.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
     '\n</tool_call>', "Need weather and time.", "Checking.", [WEATHER, TIME]),
    ("qwen3_coder", THINK,
     "<think>plan</think>\n\nLet me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>"
     "\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>", "plan", "Let me look.", [WEATHER, TIME]),
    ("glm47", THINK,
     "<think>plan</think>Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "plan", "Sure.", [WEATHER]),
    ("laguna", None,
     "<tool_call>get_time<arg_key>zone</arg_key><arg_value>CET</arg_value></tool_call>\nThen I will answer.",
     "", "Then I will answer.", [TIME]),
    ("longcat", {"has_thinking": True, "think_start": "<longcat_think>", "think_end": "</longcat_think>"},
     "<longcat_think>plan</longcat_think>\n<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
     "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n"
     "<longcat_arg_value>3</longcat_arg_value>\n</longcat_tool_call>", "plan", "", [WEATHER]),
    ("minimax_m2", THINK,
     '<think>plan</think>\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>'
     '\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="zone">CET'
     '</parameter>\n</invoke>\n</minimax:tool_call>\nOne moment.', "plan", "One moment.", [WEATHER, TIME]),
    ("kimi_k2", THINK,
     "<think>plan</think>Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>'
     'functions.get_time:1<|tool_call_argument_begin|>{"zone": "CET"}<|tool_call_end|><|tool_calls_section_end|>',
     "plan", "Calling.", [WEATHER, TIME]),
    ("kimi_k3", XTML_THINK,
     "<|open|>think<|sep|>plan<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
     '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
     'type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" type="integer"<|sep|>3'
     '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="get_time" index="2"<|sep|><|open|>json '
     'type="object"<|sep|>{"zone": "CET"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
     "plan", "Checking.", [WEATHER, TIME]),
    ("pythonic", None,
     'Sure.<|tool_call_start|>[get_weather(city="Paris", days=3), get_time(zone="CET")]<|tool_call_end|>Done.',
     "", "Sure.Done.", [WEATHER, TIME]),
    ("function_gemma", None,
     "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>"
     "<start_function_call>call:get_time{zone:<escape>CET<escape>}<end_function_call>", "", "", [WEATHER, TIME]),
    ("gemma4", {"has_thinking": True, "think_start": "<|channel>thought", "think_end": "<channel|>"},
     '<|channel>thought\nplan<channel|>Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}'
     '<tool_call|><|tool_call>call:get_time{zone:<|"|>CET<|"|>}<tool_call|>', "plan", "Checking.", [WEATHER, TIME]),
    ("mistral", None,
     'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     "", "Checking.", [WEATHER, TIME]),
    ("minicpm5", None,
     'Sure.\n<function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>'
     '\n<function name="get_time"><param name="zone"><![CDATA[CET]]></param></function>', "", "Sure.",
     [WEATHER, TIME]),
    ("muse_spark", _muse_format(),
     "to=self<|message|>The user wants the weather.<|eom|><|start|>assistant to=functions.get_weather<|message|>"
     '<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Paris</atem:parameter>'
     '<atem:parameter name="days">3</atem:parameter></atem:invoke><atem:invoke name="get_time">'
     '<atem:parameter name="zone">CET</atem:parameter></atem:invoke></atem:function_calls>',
     "The user wants the weather.", "", [WEATHER, TIME]),
]
FAMILY_IDS = [f[0] for f in FAMILIES]


def test_every_shipped_mlx_lm_parser_has_a_case():
    from pathlib import Path

    import mlx_lm.tool_parsers as pkg

    shipped = {p.stem for p in Path(pkg.__file__).parent.glob("*.py") if p.stem != "__init__"}
    assert shipped == set(FAMILY_IDS)


@pytest.mark.parametrize("case", FAMILIES, ids=FAMILY_IDS)
def test_family_chosen_from_the_wrapper(case):
    family, think, *_ = case
    fmt = tool_format(fake_tokenizer(family, think))
    expected = "glm47" if family == "laguna" else family  # laguna re-exports glm47's parser
    assert fmt.name == expected
    assert fmt is not HERMES


@pytest.mark.parametrize("case", FAMILIES, ids=FAMILY_IDS)
def test_family_streamed_and_whole(case):
    family, think, raw, reasoning, content, expected = case
    tok = fake_tokenizer(family, think)
    want = [Piece(k, t) for k, t in (("reasoning", reasoning), ("text", content)) if t]
    for how, parts in chunkings(raw, seed=len(family)):
        got, calls, _ = stream(tok, parts, tools=True, tool_specs=TOOLS)
        assert got == want, how
        assert names_args(calls) == expected, how
        check_shape(calls)
    assert parse_complete(tok, raw, tools=True, tool_specs=TOOLS)[:2] == (reasoning, content)


@pytest.mark.parametrize("case", FAMILIES, ids=FAMILY_IDS)
def test_family_never_streams_raw_markup(case):
    """Char by char, no emitted piece holds any part of the family's start marker longer than one char."""
    family, think, raw, *_ = case
    tok = fake_tokenizer(family, think)
    start = tool_format(tok).start
    _, _, per_feed = stream(tok, list(raw), tools=True, tool_specs=TOOLS)
    emitted = "".join(p.text for ps in per_feed for p in ps)
    assert start not in emitted and start[:2] not in emitted


@pytest.mark.parametrize("family", ["json_tools", "qwen3_coder", "minimax_m2", "kimi_k2", "gemma4", "pythonic"])
def test_family_unparsable_markup_falls_back_to_text(family):
    fmt = tool_format(fake_tokenizer(family))
    raw = f"before {fmt.start}@@ not a call @@{fmt.end} after"
    reasoning, content, calls = parse_complete(fake_tokenizer(family), raw, tools=True, tool_specs=TOOLS)
    assert (reasoning, content, calls) == ("", raw, [])


# -- the real default model ---------------------------------------------------------------------------------
@pytest.mark.model
def test_default_model_tokenizer_gets_the_hermes_fallback():
    """SmolLM2's template names no tool format and its vocabulary has no think tags (what mlx-lm reports)."""
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load

    from models import ensure_default_model

    tok = load(Path(ensure_default_model()))
    assert (tok.has_tool_calling, tok.has_thinking) == (False, False)
    assert tool_format(tok) is HERMES
    raw = '<think>x</think>Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    reasoning, content, calls = parse_complete(tok, raw, tools=True)
    assert (reasoning, content, names_args(calls)) == ("", "<think>x</think>Hi", [("f", {"a": 1})])
