"""Structured output on the real default model through the live server and the openai client.

Every answer must parse and validate against its schema (jsonschema), streamed and not. The
schemas bound their strings, arrays and numbers so that a complete answer fits in
MAX_TOKENS (48: JSON needs more room than the suite's usual 16; these are the only tests here
that use it). The validity rate over the set is printed (run with -s to see it).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.model

MAX_TOKENS = 48


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props),
            "additionalProperties": False}


SCHEMAS = {
    "person": (obj({"name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
               "Invent a person and describe them."),
    "enums": (obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}),
              "Pick a T-shirt."),
    "array": (obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                              "minItems": 1, "maxItems": 4}}),
              "Give three test scores."),
    "nested": (obj({"city": {"type": "string", "maxLength": 12},
                    "location": obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                     "north": {"type": "boolean"}})}),
               "Describe the location of Paris."),
    "optional": (obj({"title": {"type": "string", "maxLength": 12}, "done": {"type": "boolean"},
                      "priority": {"type": "integer", "minimum": 1, "maximum": 5}}, required=["title", "done"]),
                 "Describe one task on a to-do list."),
}


def ask(client, prompt: str, stream: bool, **kw):
    """(text of the answer, finish_reason, tool_calls as [(name, arguments)])."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model="default", messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, **kw)
        ch = r.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or ()]
        return ch.message.content or "", ch.finish_reason, calls
    text, reason, calls = [], None, []
    for chunk in client.chat.completions.create(model="default", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, **kw):
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            calls += [(c.function.name, c.function.arguments) for c in ch.delta.tool_calls or ()]
            reason = ch.finish_reason or reason
    return "".join(text), reason, calls


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_schema_set_answers_validate_streamed_and_not(client):
    results = []
    # every other schema streamed (the same greedy answer either way: test_streamed_and_plain_answers_are_the_same_text)
    for i, (name, (schema, prompt)) in enumerate(SCHEMAS.items()):
        stream = i % 2 == 1
        text, reason, _ = ask(client, prompt, stream, response_format=json_schema_format(name, schema))
        try:
            jsonschema.validate(json.loads(text), schema)
            results.append((name, stream, reason, None))
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            results.append((name, stream, reason, f"{text!r}: {str(exc).splitlines()[0]}"))
    valid = sum(1 for *_, err in results if err is None)
    print(f"\nstructured output validity: {valid}/{len(results)} "
          f"(finish reasons: {sorted({r[2] for r in results})})")
    failures = [r for r in results if r[3] is not None]
    assert not failures, failures
    assert all(r[2] == "stop" for r in results), results  # complete answers, ended by the grammar's EOS


def test_streamed_and_plain_answers_are_the_same_text(client):
    schema, prompt = SCHEMAS["person"]
    fmt = json_schema_format("person", schema)
    assert ask(client, prompt, False, response_format=fmt)[0] == ask(client, prompt, True, response_format=fmt)[0]


def test_json_object_is_a_json_object(client):
    text, reason, _ = ask(client, 'Reply with a JSON object whose key "ok" is true.', False,
                          response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict), text
    assert reason == "stop"


WEATHER = obj({"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}})
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                      "parameters": obj({"city": {"type": "string", "maxLength": 20}})}},
]


@pytest.mark.parametrize(
    "tool_choice, stream",
    [({"type": "function", "function": {"name": "get_weather"}}, False), ("required", True)],
)
def test_forced_tool_call_arguments_validate(client, tool_choice, stream):
    text, reason, calls = ask(client, "What is the weather in Paris?", stream, tools=TOOLS,
                              tool_choice=tool_choice, parallel_tool_calls=False)
    assert reason == "tool_calls" and len(calls) == 1, (text, reason, calls)
    name, arguments = calls[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if isinstance(tool_choice, dict):
        assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), schemas[name])
    assert "<tool_call>" not in text


def test_uncompilable_schema_is_a_400_with_the_reason(client):
    bad = {"type": "object", "properties": {"when": {"type": "string", "format": "stardate"}}}
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "hi", False, response_format=json_schema_format("bad", bad))
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == "response_format" and "stardate" in body["message"], body


def test_strict_tool_with_auto_choice_answers_or_calls_validly(client):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    text, reason, calls = ask(client, "What is the weather in Paris? Use the tools.", False, tools=strict,
                              tool_choice="auto", parallel_tool_calls=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])
    assert "<tool_call>" not in text, text  # a started call always completes into a parsed one
    assert (reason == "tool_calls") == bool(calls), (text, reason, calls)  # a text answer may run to max_tokens
