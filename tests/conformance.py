"""Our answers against the published API schemas: which schema each door's bodies and SSE events must satisfy.

The schemas are the vendored subsets in tests/fixtures/api_schemas/ (SOURCES.md: where each comes from, pinned by
commit and sha256):

    door          what                                   schema(s)
    chat          POST /v1/chat/completions              OpenAI CreateChatCompletionResponse; events:
                                                         CreateChatCompletionStreamResponse
    completions   POST /v1/completions                   OpenAI CreateCompletionResponse (events too)
    responses     POST /v1/responses, GET /v1/responses/{id}, /v1/responses/compact, WebSocket /v1/responses
                                                         OpenAI Response / CompactResource / the
                                                         ResponseStreamEvent of the event's type, AND Open Responses
                                                         ResponseResource / CompactResource / its event of that type
    input_tokens  POST /v1/responses/input_tokens        OpenAI TokenCountsResource
    messages      POST /v1/messages                      Anthropic Message; events: MessageStreamEvent of the type
    count_tokens  POST /v1/messages/count_tokens         Anthropic CountMessageTokensResponse
    models        GET /v1/models, /v1/models/{id}        OpenAI ListModelsResponse, Model
    embeddings    POST /v1/embeddings                    OpenAI CreateEmbeddingResponse
    errors        any status >= 400 under /v1/           Anthropic ErrorResponse under /v1/messages, else OpenAI
                                                         ErrorResponse; an error event in a stream the same
                                                         (Responses: OpenAI ResponseErrorEvent + Open Responses
                                                         ErrorStreamingEvent; a WebSocket's failure: Open
                                                         Responses WebSocketErrorEvent)

Rules read where a spec is ambiguous (each follows what the vendor's own API sends):
- OpenAPI 3.0's ``nullable: true``, left in places of OpenAI's 3.1 document (e.g. a stream chunk's
  ``finish_reason``), allows null, as it means in 3.0 (JSON Schema 2020-12 would ignore the keyword).
- OpenAI's Response ``usage`` may be null (its schema says an object; its own examples of response.created and
  response.in_progress, and its API, send null before the response is done; Open Responses says nullable).
- An embedding may be a base64 string: what OpenAI's API returns for ``encoding_format: "base64"`` (its SDK asks
  for it by default); the schema types only the float array.
- Open Responses' JsonSchemaResponseFormat ``schema`` is any JSON value or null, as its source says
  (schema/components/schemas/JsonSchemaResponseFormat.json: ``anyOf: [{}, {"type": "null"}]``); the published
  openapi.json lost the ``{}`` branch, leaving null only.
- A streamed ``text_completion`` chunk may have ``finish_reason: null`` (CreateCompletionResponse says the chunks
  share its shape, whose finish_reason is not nullable; OpenAI's API sends null until the last chunk).
- Open Responses defines function tools and function calls only: an output item, an echoed tool or a tool_choice of
  a type it lacks (custom_tool_call, tool_search_call, a custom, namespace or tool_search tool: the OpenAI features
  Codex CLI uses) is checked against OpenAI's schema of that type, and an event type it lacks against OpenAI's
  event alone.
- Likewise an echoed ``reasoning.effort`` of OpenAI's scale that Open Responses' lacks (``minimal``, ``max``): echoed
  as the client sent it, checked against OpenAI's enum (an Open Responses client cannot send it: its request takes
  the same five levels its response does).
- An SSE event's ``event:`` name, where sent, must equal its data's ``type`` (both vendors' streams do).
- Anthropic's ``ping`` event (its streaming documentation's keep-alive) is the one event its spec leaves out; the
  mirror the spec is read from adds it as ``Ping`` (SOURCES.md).
- DELETE /v1/responses/{id} (``response.deleted``): OpenAI publishes no body schema for it; not checked.
Paths outside the published APIs (/health, /stats, /tokenize, /admin, the dashboard) are not checked.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

SCHEMAS = Path(__file__).resolve().parent / "fixtures" / "api_schemas"
SPECS = ("openai", "open_responses", "anthropic")


def _nullable(schema):
    """OpenAPI 3.0's ``nullable: true`` as JSON Schema (see the module docstring)."""
    if isinstance(schema, list):
        return [_nullable(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _nullable(v) for k, v in schema.items()}
    if out.get("nullable") is True:
        del out["nullable"]
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _refs(union: list) -> list[str]:
    return [branch["$ref"].rsplit("/", 1)[1] for branch in union]


def _types(schemas: dict, names) -> dict[str, str]:
    """``type`` value -> schema name, for the schemas ``names`` (each with a one-value ``type`` property)."""
    out = {}
    for name in names:
        prop = schemas[name].get("properties", {}).get("type", {})
        value = prop.get("const", (prop.get("enum") or [None])[0])
        if value is not None:
            out[value] = name
    return out


@lru_cache(maxsize=1)
def _specs():
    """The three documents (with the rules of the module docstring applied), their registry and event maps."""
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    docs = {spec: _nullable(json.loads((SCHEMAS / f"{spec}.json").read_text())) for spec in SPECS}
    oa, orr, an = (docs[s]["components"]["schemas"] for s in SPECS)

    chunk = copy.deepcopy(oa["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    oa["CreateCompletionResponse (stream chunk)"] = chunk
    vector = oa["Embedding"]["properties"]["embedding"]
    oa["Embedding"]["properties"]["embedding"] = {"anyOf": [vector, {"type": "string"}]}
    orr["JsonSchemaResponseFormat"]["properties"]["schema"] = {"anyOf": [{}, {"type": "null"}]}
    own = next(part for part in oa["Response"]["allOf"] if "usage" in part.get("properties", {}))
    own["properties"]["usage"] = {"anyOf": [own["properties"]["usage"], {"type": "null"}]}

    scale = orr["ReasoningEffortEnum"]["enum"]
    scale += [v for v in oa["ReasoningEffort"]["anyOf"][0]["enum"] if v not in scale]
    choice = orr["ResponseResource"]["properties"]["tool_choice"]
    for ours, theirs in ((orr["ItemField"], oa["OutputItem"]), (orr["Tool"], oa["Tool"]),
                         (choice, oa["ToolChoiceParam"])):  # Open Responses' missing types, from OpenAI's spec
        known = _types(orr, _refs(b for b in ours["oneOf"] if "$ref" in b))
        extra = _types(oa, _refs(b for b in theirs["oneOf"] if "$ref" in b))
        ours["oneOf"] += [{"$ref": f"urn:openai#/components/schemas/{name}"}
                          for t, name in sorted(extra.items()) if t not in known]

    events = {
        "openai": _types(oa, _refs(oa["ResponseStreamEvent"]["anyOf"])),
        "open_responses": _types(orr, [name for name in orr if name.endswith("StreamingEvent")]),
        "anthropic": {t: ref.rsplit("/", 1)[1]
                      for t, ref in an["MessageStreamEvent"]["discriminator"]["mapping"].items()},
    }
    registry = Registry().with_resources((f"urn:{spec}", Resource(doc, DRAFT202012)) for spec, doc in docs.items())
    return registry, events


@lru_cache(maxsize=None)
def validator(spec: str, name: str):
    """A compiled validator of component schema ``name`` of ``spec`` (built once per schema)."""
    from jsonschema import Draft202012Validator

    registry, _ = _specs()
    return Draft202012Validator({"$ref": f"urn:{spec}#/components/schemas/{name}"}, registry=registry)


def _mismatch(err) -> bool:
    """An error that only says "this is another kind of thing": a wrong ``type`` tag, or the wrong JSON type."""
    path = list(err.relative_path)
    return (path == ["type"] and err.validator in ("const", "enum")) or (not path and err.validator == "type")


def _reason(err):
    """The error to report: inside a oneOf / anyOf, the one branch the body meant (its ``type`` tag and JSON type
    match), followed down as long as there is exactly one such branch; then jsonschema's own best match."""
    from jsonschema.exceptions import best_match, relevance

    while err.validator in ("oneOf", "anyOf") and err.context:
        branches: dict = {}
        for e in err.context:
            branches.setdefault(e.relative_schema_path[0], []).append(e)
        meant = [errs for errs in branches.values() if not any(_mismatch(e) for e in errs)]
        if len(meant) != 1:
            break
        err = max(meant[0], key=relevance)
    return best_match([err])


def rejections(obj, targets) -> list[str]:
    """Why ``obj`` fails each (spec, schema name) of ``targets``: one line each, the path in the body first."""
    from jsonschema.exceptions import relevance

    out = []
    for spec, name in targets:
        errors = list(validator(spec, name).iter_errors(obj))
        if errors:
            err = _reason(max(errors, key=relevance))
            where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
            rule = "/".join(str(p) for p in err.absolute_schema_path)
            message = err.message if len(err.message) < 300 else err.message[:300] + "..."
            out.append(f"{where}: {message} [{spec} {name}: '{err.validator}' at {rule}]")
    return out


# (door, method, path pattern, targets of a 2xx JSON body, kind of its events)
_DOORS = [
    ("chat", "POST", r"/v1/chat/completions", [("openai", "CreateChatCompletionResponse")], "chat"),
    ("completions", "POST", r"/v1/completions", [("openai", "CreateCompletionResponse")], "completions"),
    ("input_tokens", "POST", r"/v1/responses/input_tokens", [("openai", "TokenCountsResource")], None),
    ("responses", "POST", r"/v1/responses/compact",
     [("openai", "CompactResource"), ("open_responses", "CompactResource")], None),
    ("responses", "POST|GET", r"/v1/responses(/[^/]+)?",
     [("openai", "Response"), ("open_responses", "ResponseResource")], "responses"),
    ("responses", "DELETE", r"/v1/responses/[^/]+", [], None),  # no published body schema
    ("count_tokens", "POST", r"/v1/messages/count_tokens", [("anthropic", "CountMessageTokensResponse")], None),
    ("messages", "POST", r"/v1/messages", [("anthropic", "Message")], "messages"),
    ("models", "GET", r"/v1/models", [("openai", "ListModelsResponse")], None),
    ("models", "GET", r"/v1/models/.+", [("openai", "Model")], None),
    ("embeddings", "POST", r"/v1/embeddings", [("openai", "CreateEmbeddingResponse")], None),
]


def _door(method: str, path: str):
    for door, methods, pattern, targets, events in _DOORS:
        if method in methods.split("|") and re.fullmatch(pattern, path):
            return door, targets, events
    return None


def _error_targets(path: str):
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    return [("anthropic", "ErrorResponse")] if anthropic else [("openai", "ErrorResponse")]


def check_body(method: str, path: str, status: int, ctype: str, body: bytes) -> tuple[Optional[str], list[str]]:
    """(the door, the rejections) of one whole response body; door None: a body no published schema covers."""
    found = _door(method, path)
    door = "errors" if status >= 400 else (found[0] if found and found[1] else None)
    if door is None:  # no door, or one whose success body no published schema covers
        return None, []
    head = f"{door}: {method} {path} -> {status}"
    if not ctype.startswith("application/json"):
        return door, [f"{head}: content type {ctype!r}, not application/json"]
    try:
        obj = json.loads(body)
    except ValueError:
        return door, [f"{head}: the body is not JSON: {body[:200]!r}"]
    targets = _error_targets(path) if status >= 400 else found[1]
    return door, [f"{head}: {line}" for line in rejections(obj, targets)]


def event_targets(kind: str, obj) -> list[tuple[str, str]]:
    """The schemas one event of a ``kind`` stream must satisfy (none known: an empty list)."""
    _, events = _specs()
    if kind == "chat":
        return [("openai", "ErrorResponse" if "error" in obj else "CreateChatCompletionStreamResponse")]
    if kind == "completions":
        return [("openai", "ErrorResponse" if "error" in obj else "CreateCompletionResponse (stream chunk)")]
    t = obj.get("type")
    if kind == "messages":
        return [("anthropic", "ErrorResponse" if t == "error" else events["anthropic"].get(t))]
    if t == "error" and "status" in obj:  # a WebSocket's failure (Open Responses' WebSocketErrorEvent)
        return [("open_responses", "WebSocketErrorEvent")]
    return [(spec, events[spec][t]) for spec in ("openai", "open_responses") if t in events[spec]]


def check_event(method: str, path: str, status: int, name: Optional[str], data: str) -> tuple[Optional[str], list[str]]:
    """(the door, the rejections) of one SSE event (``name``: its ``event:`` field) or WebSocket message."""
    found = _door(method, path)
    if found is None or found[2] is None:
        return None, []
    door, _, kind = found
    head = f"{door}: {method} {path} event {name or ''}".rstrip()
    try:
        obj = json.loads(data)
    except ValueError:
        return door, [f"{head}: the data is not JSON: {data[:200]!r}"]
    if not isinstance(obj, dict):
        return door, [f"{head}: the data is not a JSON object"]
    head = f"{door}: {method} {path} event {obj.get('type') or name or '(data)'}"
    problems = []
    if name is not None and kind in ("responses", "messages") and name != obj.get("type"):
        problems.append(f"{head}: SSE event name {name!r} differs from its data's type {obj.get('type')!r}")
    targets = event_targets(kind, obj)
    if not targets or any(n is None for _, n in targets):
        return door, problems + [f"{head}: no published event has the type {obj.get('type')!r}"]
    return door, problems + [f"{head}: {line}" for line in rejections(obj, targets)]
