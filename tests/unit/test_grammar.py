"""server/core/grammar.py and its request wiring, without the real model.

The tokenizer is a byte-level BPE without merges (one token per byte, 256 = <eos>), built with
the `tokenizers` library (token id = byte value), so every expected mask can be written down by hand. The decode test
runs a tiny random llama (vocab 257) under a grammar through PlainDecode, as the lane does.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import pytest
from pydantic import ValidationError

from server.core.grammar import GrammarError, GrammarSpec, json_schema_grammar, ll_tokenizer, tool_call_grammar
from server.core.prompts import chat_grammar, sampling_params
from server.errors import InvalidRequest
from server.http.chat.door import chat_request
from server.http.chat.schemas import ChatCompletionRequest
from tests.fixtures.byte_tokenizer import EOS, ByteTokenizer, accepts, allowed

@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def run(proc, ids: list[int], width: int = 257) -> list[set[int]]:
    """Call ``proc`` as the lane does (first call with a prompt token, then each sampled token); return the
    allowed set before each token of ``ids`` and after the last one."""
    logits = mx.zeros((1, width))
    sets = [allowed(proc(mx.array([ord("x")]), logits))]
    for t in ids:
        assert t in sets[-1], f"token {t} ({chr(t)!r}) not allowed"
        sets.append(allowed(proc(mx.array([ord("x"), t]), logits)))
    return sets


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_mask_forces_the_next_bytes_and_keeps_allowed_logits(tok):
    proc = GrammarSpec.compile(tok, json_schema_grammar(SCHEMA)).processor()
    logits = mx.arange(257, dtype=mx.float32)[None]
    out = proc(mx.array([5]), logits)  # first call: tokens[-1] is a prompt token, never consumed
    assert allowed(out) == {ord("{")}
    assert out[0, ord("{")].item() == ord("{")  # the allowed logit is untouched


def test_processor_advances_then_only_eos(tok):
    proc = GrammarSpec.compile(tok, json_schema_grammar(SCHEMA)).processor()
    doc = '{"a": 12}'
    sets = run(proc, tok.encode(doc))
    assert sets[1] == {ord('"')}  # after "{" only the required key can start
    assert sets[5] == {ord(" ")}  # json.dumps separators, no free whitespace
    assert ord("-") in sets[6] and ord("9") in sets[6] and ord("x") not in sets[6]  # the integer
    assert sets[-1] == {EOS}
    assert proc.done and proc.tokens == len(doc)


def test_each_request_gets_its_own_matcher(tok):
    spec = GrammarSpec.compile(tok, json_schema_grammar(SCHEMA))
    a, b = spec.processor(), spec.processor()
    run(a, tok.encode('{"a": 1'))
    assert run(b, [])[0] == {ord("{")}  # b is still at the start


def test_a_token_outside_the_mask_raises(tok):
    proc = GrammarSpec.compile(tok, json_schema_grammar(SCHEMA)).processor()
    logits = mx.zeros((1, 257))
    proc(mx.array([1]), logits)
    with pytest.raises(GrammarError, match="refused token"):
        proc(mx.array([ord("x")]), logits)


def test_logits_wider_than_the_vocabulary_are_masked_past_it(tok):
    proc = GrammarSpec.compile(tok, json_schema_grammar({"type": "object"})).processor()
    out = proc(mx.array([1]), mx.zeros((1, 300)))
    assert out.shape == (1, 300) and allowed(out) == {ord("{")}


@pytest.mark.parametrize(
    "schema, reason",
    [
        ({"type": "strin"}, "strin"),
        ({"type": "string", "format": "bogus"}, "bogus"),
        ({"$ref": "#/definitions/missing"}, "missing"),
        ({"type": "string", "pattern": "("}, "regex"),
    ],
)
def test_schema_that_does_not_compile_is_a_400_with_the_reason(tok, schema, reason):
    with pytest.raises(InvalidRequest) as err:
        GrammarSpec.compile(tok, json_schema_grammar(schema))
    assert err.value.status_code == 400 and err.value.param == "response_format"
    assert reason in err.value.message


def test_llguidance_tokenizer_is_cached_per_tokenizer_object(tok):
    assert ll_tokenizer(tok) is ll_tokenizer(tok)
    assert ll_tokenizer(ByteTokenizer()) is not ll_tokenizer(tok)


# -- tool calls ---------------------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("ping", None)]
GOOD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WRONG_ARGS = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    "answer, text, expected",
    [
        (None, GOOD, True),
        (None, GOOD + "\n", True),
        (None, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', True),
        (None, WRONG_ARGS, False),
        (None, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),
        (None, "It is sunny.", False),
        (None, "", False),
        (None, GOOD + "\n" + GOOD, True),
        ("text", "It is sunny.", True),
        ("text", "", True),
        ("text", "Let me check. " + GOOD, True),
        ("text", "Let me check. " + WRONG_ARGS, False),
        ("text", GOOD + " and some chatter", False),
        ({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, '{"ok": true}', True),
        ({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, GOOD, True),
        ({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, "sunny", False),
    ],
)
def test_tool_call_grammar(tok, answer, text, expected):
    assert accepts(tok, tool_call_grammar(TOOLS, answer=answer, parallel=True), text) is expected


def test_no_parallel_calls_means_one_call(tok):
    g = tool_call_grammar(TOOLS, answer=None, parallel=False)
    assert accepts(tok, g, GOOD) and not accepts(tok, g, GOOD + "\n" + GOOD)


# -- request wiring -----------------------------------------------------------------------------------------
def chat(**fields):
    """A chat completions body as the internal request the grammar is built from."""
    return chat_request(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                              **fields}), {})


def tool(name, params=WEATHER, strict=None):
    fn = {"name": name, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def outputs(tok, spec, text: str) -> bool:
    if spec is None:
        return True
    proc, logits = spec.processor(), mx.zeros((1, 257))
    ok = allowed(proc(mx.array([1]), logits))
    for t in tok.encode(text):
        if t not in ok:
            return False
        ok = allowed(proc(mx.array([t]), logits))
    return EOS in ok


def test_response_formats(tok):
    assert chat_grammar(tok, chat()) is None
    assert chat_grammar(tok, chat(response_format={"type": "text"})) is None
    obj = chat_grammar(tok, chat(response_format={"type": "json_object"}))
    assert outputs(tok, obj, '{"x": [1, 2]}') and not outputs(tok, obj, "[1]")
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    spec = chat_grammar(tok, chat(response_format=rf))
    assert outputs(tok, spec, '{"a": 3}') and not outputs(tok, spec, '{"b": 3}')


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [tool("get_weather")], "tool_choice": {"type": "function", "function": {"name": "other"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"tools": [tool("f", {"type": "object", "properties": {"x": {"type": "nope"}}})], "tool_choice": "required"},
         "tools"),
    ],
)
def test_requests_whose_grammar_cannot_be_built_are_400(tok, fields, param):
    with pytest.raises(InvalidRequest) as err:
        chat_grammar(tok, chat(**fields))
    assert err.value.param == param


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},  # name is required
        {"tool_choice": "always"},
        {"tool_choice": {"type": "function"}},
    ],
)
def test_malformed_fields_fail_validation(body):
    with pytest.raises(ValidationError):
        chat(**body)


def test_tool_choice_named_required_auto_and_none(tok):
    tools = [tool("get_weather"), tool("ping", None)]
    named = chat_grammar(tok, chat(tools=tools, tool_choice={"type": "function", "function": {"name": "ping"}}))
    assert outputs(tok, named, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert not outputs(tok, named, GOOD)
    assert not outputs(tok, named, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n' + GOOD)
    required = chat_grammar(tok, chat(tools=tools, tool_choice="required"))
    assert outputs(tok, required, GOOD) and not outputs(tok, required, "no call")
    serial = chat_grammar(tok, chat(tools=tools, tool_choice="required", parallel_tool_calls=False))
    assert not outputs(tok, serial, GOOD + "\n" + GOOD)
    assert chat_grammar(tok, chat(tools=tools)) is None  # auto without strict tools: free text, as before
    assert chat_grammar(tok, chat(tools=[tool("get_weather", strict=True)], tool_choice="none")) is None


def test_strict_tool_with_auto_choice_enforces_its_arguments_only(tok):
    loose = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    spec = chat_grammar(tok, chat(tools=[tool("get_weather", strict=True), tool("search", loose)]))
    assert outputs(tok, spec, "Hello!") and outputs(tok, spec, GOOD)
    assert not outputs(tok, spec, WRONG_ARGS)
    assert outputs(tok, spec, '<tool_call>\n{"name": "search", "arguments": {"other": 1}}\n</tool_call>')


def test_other_tool_call_formats_refuse_forced_calls(tok):
    other = ByteTokenizer(tool_call_start="[TOOL_CALLS]")
    with pytest.raises(InvalidRequest) as err:
        chat_grammar(other, chat(tools=[tool("get_weather")], tool_choice="required"))
    assert err.value.param == "tool_choice" and "[TOOL_CALLS]" in err.value.message
    assert chat_grammar(other, chat(tools=[tool("get_weather", strict=True)])) is None  # strict: best effort


def test_grammar_requests_do_not_speculate(tok):
    req = chat(response_format={"type": "json_object"}, num_draft_tokens=4)
    spec = chat_grammar(tok, req)
    params = sampling_params(req, 5, 100, default_max_tokens=8, vocab_size=257, grammar=spec)
    assert params.grammar is spec and params.num_draft_tokens == 0
    plain = sampling_params(req, 5, 100, default_max_tokens=8, vocab_size=257)
    assert plain.grammar is None and plain.num_draft_tokens == 4


# -- the lane's decode loop under a grammar (tiny random model) --------------------------------------------
DECODE_SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["n"],
     "additionalProperties": False},
    {"type": "object", "properties": {"c": {"enum": ["red", "green"]}, "tags": {"type": "array", "maxItems": 2,
     "items": {"type": "string", "maxLength": 3}}}, "required": ["c", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"ok": {"type": "boolean"}},
     "required": ["ok"], "additionalProperties": False}}, "required": ["p"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def random_model():
    from tests.fixtures.tiny_models import tiny_llama

    return tiny_llama(seed=7)


@pytest.mark.parametrize("schema", DECODE_SCHEMAS)
def test_random_model_output_under_a_schema_validates(tok, random_model, schema):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from server.engine.batch.rules import LogitsRules
    from server.engine.batch.solo import PlainDecode
    from server.lane.events import SamplingParams

    prompt = tok.encode("json please")
    caches = make_prompt_cache(random_model)
    random_model(mx.array(prompt[:-1])[None], cache=caches)
    params = SamplingParams(max_tokens=80, temperature=0.0)
    grammar = GrammarSpec.compile(tok, json_schema_grammar(schema)).processor()  # ONE per request
    steps = PlainDecode(random_model, caches, prompt, max_tokens=80, sampler=make_sampler(0.0),
                        processors_for=LogitsRules.of(params, grammar).processors,
                        stream=mx.default_stream(mx.default_device()))
    out = []
    for t, _ in steps:
        if t == EOS:
            break
        out.append(t)
    steps.close()
    text = tok.decode(out)
    jsonschema.validate(json.loads(text), schema)
    assert grammar.done
