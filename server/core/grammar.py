"""Constrained decoding: a compiled grammar per request and the logits processor that enforces it.

Library: llguidance (PyPI ``llguidance``, Rust core, no Python dependencies). Chosen over
- outlines-core 0.2.14: regular languages only (a JSON schema becomes one regex and a
  token-level DFA index built eagerly over the whole vocabulary, seconds for a large schema),
  so no recursive schemas and no "text | tool call" grammar without writing our own CFG;
- xgrammar 0.2.8: a CFG engine as capable as llguidance, but its wheel requires torch,
  transformers and triton (gigabytes) for a server that otherwise needs none of them.
llguidance compiles JSON schemas and Lark grammars (with ``%json`` schemas inlined) lazily
(measured here: ~1 ms for a schema, 1.5-4 ms for a tool-call grammar), computes a token mask
in 10-120 us on the 49k vocabulary of the default model (the whole processor call, mask applied
and evaluated: median ~0.1-0.23 ms, against ~100 ms per decoded token on this CPU), and reports
schema errors with a reason ("Invalid type: strin") that we return as a 400.

Contract
- ``GrammarSpec.compile(tokenizer, grammar, param=...)`` runs on the handler side (off the
  lane). A grammar that does not compile raises ``InvalidRequest`` (400) whose message carries
  llguidance's reason and whose ``param`` names the request field. The spec is immutable and
  shareable: it holds a prototype matcher that is only ever copied.
- ``GrammarSpec.processor()`` returns a fresh ``GrammarProcessor``, a logits processor
  ``(tokens, logits[1, V]) -> logits[1, V]`` created ONCE per request and called exactly once
  per sampled token, in order. On every call after the first, ``tokens[-1]`` is the token
  sampled at the previous call: the processor advances its matcher with it, then masks every
  token the grammar does not allow to -inf. Once the grammar is complete only EOS is allowed.
- The llguidance tokenizer is built from the model's own ``tokenizer.json`` (no hub; about
  0.2 s for the default model) and cached per tokenizer object.

Grammars are built by ``json_schema_grammar`` (response_format) and ``tool_call_grammar``
(forced or strict tool calls in the Hermes ``<tool_call>{json}</tool_call>`` format that
server/core/output_parse.py parses, and calls to custom tools, whose raw input follows the tool's own
Lark or regex grammar). JSON is generated without free whitespace, with ", " and ": "
separators (what ``json.dumps`` writes): flexible whitespace lets small models loop on
newlines until max_tokens.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence, Union

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from server.errors import APIError, InvalidRequest

__all__ = [
    "GrammarSpec",
    "GrammarProcessor",
    "GrammarError",
    "json_schema_grammar",
    "tool_call_grammar",
    "CustomInput",
    "custom_call_header",
    "check_custom_grammar",
    "ll_tokenizer",
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # Hermes markers (server/core/output_parse.py)

# llguidance JSON options: no free whitespace (see the module doc), json.dumps-style separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(APIError):
    """The matcher refused a token it had allowed, or hit one of its resource limits mid-generation (500)."""

    code = "grammar_error"


# -- the llguidance tokenizer, built once per tokenizer object -------------------------------------------------
_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def _tokenizer_json(tokenizer) -> str:
    """The serialized ``tokenizers`` tokenizer behind an mlx-lm TokenizerWrapper, a transformers fast tokenizer,
    or a ``tokenizers.Tokenizer``. (``llguidance.hf.from_tokenizer`` does the same for transformers objects only,
    and imports transformers to check the type.)"""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps the HF tokenizer
    backend = getattr(inner, "backend_tokenizer", inner)
    if not hasattr(backend, "to_str"):
        raise InvalidRequest(
            "structured output needs a model whose tokenizer is a Hugging Face fast tokenizer (tokenizer.json); "
            "this model's is not. Drop response_format / forced tool_choice for this model.",
            param="response_format")
    backend = copy.copy(backend)  # the copy's padding/truncation settings must not leak into the grammar vocabulary
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _eos_ids(tokenizer) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)  # mlx-lm: a set (the config's list, or the tokenizer's EOS)
    if not ids:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = [eos] if eos is not None else []
    return sorted(int(i) for i in ids)


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of ``tokenizer`` (cached while the tokenizer object lives)."""
    with _LL_LOCK:
        cached = _LL_TOKENIZERS.get(tokenizer)
        if cached is None:
            eos = _eos_ids(tokenizer)
            cached = llguidance.LLTokenizer(_tokenizer_json(tokenizer), eos_token=eos or None)
            _LL_TOKENIZERS[tokenizer] = cached
        return cached


# -- grammars --------------------------------------------------------------------------------------------------
def _with_options(schema: dict) -> dict:
    """The schema with our JSON options as defaults (a schema's own ``x-guidance`` still wins)."""
    if not isinstance(schema, dict):
        raise InvalidRequest("a JSON schema must be a JSON object", param="response_format")
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}}


def json_schema_grammar(schema: dict) -> str:
    """A grammar for one JSON value matching ``schema`` (``{"type": "object"}`` for json_object)."""
    return llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema))


def _lark_json(schema: dict) -> str:
    return "%json " + json.dumps(_with_options(schema), ensure_ascii=False)


def _call_schema(name: str, parameters: Optional[dict]) -> dict:
    """``{"name": <name>, "arguments": <parameters>}``, name first (the order llguidance emits properties)."""
    if parameters is None:  # OpenAI: omitting parameters declares an empty parameter list
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# Free text that never contains the call marker (so a call cannot hide inside "text").
_TEXT = r"/(?s:.*)/ & ~/(?s:.*)" + TOOL_CALL_OPEN + r"(?s:.*)/"
_NAME_OPEN, _CLOSE_BRACE = json.dumps('{"name": '), json.dumps("}")  # Lark literals of a call's JSON opening, end
# A free-text custom input and the end of its call (a lazy lexeme: it ends at the first end of the call).
_CUSTOM_TEXT = r"/(?s:.*)\n<\/tool_call>/"


@dataclass(frozen=True)
class CustomInput:
    """A custom (freeform) tool as the grammar sees it: its name, and its input's grammar (``syntax`` "lark" or
    "regex" with a ``definition``; None: free text)."""

    name: str
    syntax: Optional[str] = None
    definition: Optional[str] = None


def custom_call_header(name: str) -> str:
    r"""What opens a call to a custom tool after the ``<tool_call>\n`` marker: ``{"name": NAME}`` and a newline;
    the raw input follows, then ``\n</tool_call>`` (the Hermes format, with the input written as it is: a patch
    in a JSON string would need escaping that small models get wrong)."""
    return "{" + '"name": ' + json.dumps(name, ensure_ascii=False) + "}\n"


def check_custom_grammar(tool: CustomInput) -> Optional[str]:
    """Why a custom tool's grammar does not compile (llguidance's reason), or None when it does."""
    if tool.syntax is None:
        return None
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(_custom_lark(tool))
    except (ValueError, TypeError) as exc:
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar) or None


def _custom_lark(tool: CustomInput) -> str:
    if tool.syntax == "regex":
        return "start: /" + tool.definition.replace("/", "\\/") + "/\n"
    return tool.definition


def tool_call_grammar(
    tools: Sequence[tuple[str, Optional[dict]]],
    *,
    answer: Union[Literal["text"], dict, None],
    parallel: bool,
    custom: Sequence[CustomInput] = (),
) -> str:
    r"""A grammar for Hermes tool calls ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``.

    ``tools``: (name, parameters schema or None) of the functions the calls may name; each call's arguments
    follow its function's schema. ``custom``: the custom tools a call may name instead, written
    ``<tool_call>\n{"name": NAME}\n<input>\n</tool_call>`` with the input in that tool's own grammar (a Lark
    grammar is composed in as a sub-grammar of its own, so its rule names never clash with ours). ``answer``: None
    = at least one call is required (tool_choice "required" or a named tool); "text" = free text (never containing
    ``<tool_call>``) or text followed by calls (tool_choice "auto" with strict or grammar tools); a dict = a JSON
    answer matching that schema, or calls. ``parallel``: more than one call may follow, one per line. A single
    trailing newline may end the output.
    """
    if not tools and not custom:
        raise InvalidRequest("a tool call was required but the request declares no tools", param="tools")
    more = ' ("\\n" call)*' if parallel else ""
    open_, close = json.dumps(TOOL_CALL_OPEN + "\n"), json.dumps("\n" + TOOL_CALL_CLOSE)
    lines, subs = [], []
    if not custom:  # one JSON value names the function and holds its arguments
        schemas = [_call_schema(name, params) for name, params in tools]
        lines += [f"after: body {close}",
                  f"body: {_lark_json(schemas[0] if len(schemas) == 1 else {'anyOf': schemas})}"]
    else:
        # Every call opens with {"name": ; the name then decides the rest: a function's arguments (JSON), or a custom
        # tool's raw input. (Alternatives that both start inside one JSON lexeme and a literal would be ambiguous to
        # llguidance's lexer, so the shared opening is a literal of its own.)
        names = []
        for i, (name, params) in enumerate(tools):
            if params is None:  # OpenAI: omitting parameters declares an empty parameter list
                params = {"type": "object", "properties": {}, "additionalProperties": False}
            head = json.dumps(json.dumps(name, ensure_ascii=False) + ', "arguments": ')
            lines += [f"fn_{i}: {head} args_{i} {_CLOSE_BRACE} {close}", f"args_{i}: {_lark_json(params)}"]
            names.append(f"fn_{i}")
        for i, tool in enumerate(custom):
            end = close
            if tool.syntax is None:  # lazy: free text up to the first end of the call (the lexer is greedy)
                item, end = f"custom_text_{i}", ""
                lines.append(f"custom_text_{i}[lazy]: {_CUSTOM_TEXT}")
            elif tool.syntax == "regex":
                item = "/" + tool.definition.replace("/", "\\/") + "/"
            else:
                item = f"@custom_{i}"
                subs.append({"name": f"custom_{i}", "lark_grammar": tool.definition})
            header = custom_call_header(tool.name).removeprefix('{"name": ')
            lines.append(f"custom_{i}: {json.dumps(header)} {item} {end}".rstrip())
            names.append(f"custom_{i}")
        lines.insert(0, f"after: {_NAME_OPEN} ({' | '.join(names)})")
    lines.insert(1, f"call: {open_} after")
    if answer is None:
        lines.insert(0, f'start: call{more} "\\n"?')
    elif answer == "text":
        # lazy: the header ends at the first marker, where a call's grammar takes over
        lines.insert(0, f'start: TEXT | lead after{more} "\\n"?')
        lines += [f"TEXT: {_TEXT}", f"lead[lazy]: /(?s:.*){TOOL_CALL_OPEN}\\n/"]
    else:
        lines.insert(0, f'start: answer | call{more} "\\n"?')
        lines.append(f"answer: {_lark_json(answer)}")
    main = "\n".join(lines) + "\n"
    if not subs:
        return llguidance.LLMatcher.grammar_from_lark(main)
    return json.dumps({"grammars": [{"lark_grammar": main}, *subs]})


# -- the compiled spec and its per-request processor ------------------------------------------------------------
@dataclass(frozen=True)
class GrammarSpec:
    """A compiled grammar bound to a tokenizer. Immutable: the prototype matcher is only copied."""

    grammar: str  # the llguidance grammar (JSON text), kept for logs and tests
    _tokenizer: llguidance.LLTokenizer
    _prototype: llguidance.LLMatcher

    @classmethod
    def compile(cls, tokenizer, grammar: str, *, param: str = "response_format") -> "GrammarSpec":
        """Compile ``grammar`` for ``tokenizer``; InvalidRequest (400, ``param``) with llguidance's reason."""
        ll = ll_tokenizer(tokenizer)
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            reason = matcher.get_error().strip()
            raise InvalidRequest(f"Invalid schema for '{param}': {reason}", param=param)
        return cls(grammar, ll, matcher)

    def processor(self) -> "GrammarProcessor":
        return GrammarProcessor(self._prototype.deep_copy(), self._tokenizer.vocab_size)


class GrammarProcessor:
    """One request's matcher as an mlx-lm logits processor (see the module doc for the calling contract)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._bitmask = allocate_token_bitmask(1, vocab_size)
        self._vocab = vocab_size
        self._started = False
        self.tokens = 0  # tokens consumed (for tests and logs)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Start the forward pass now: it runs while we wait for the previous token and compute the mask.
        mx.async_eval(logits)
        allowed = self.allowed(lambda: int(tokens[-1].item()))
        width = logits.shape[-1]
        if width != allowed.shape[0]:  # the model's logits may be padded past the tokenizer's vocabulary
            allowed = np.pad(allowed[:width], (0, max(0, width - allowed.shape[0])))
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def allowed(self, previous: Callable[[], int]) -> np.ndarray:
        """The tokens the grammar allows next, as a bool array over the tokenizer's vocabulary, after advancing
        over ``previous()`` (the token sampled at the last call; not called at the first). The same contract as a
        call: once per sampled token, in order (a decode batch masks its rows together with these)."""
        if self._started:
            self._advance(previous())
        self._started = True
        fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():
            raise GrammarError(f"the output grammar failed: {self._matcher.get_error()}")
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab].view(np.bool_)

    def _advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(
                f"the output grammar refused token {token} after {self.tokens} tokens: "
                f"{self._matcher.get_error() or 'not allowed here'}")
        self.tokens += 1

    @property
    def done(self) -> bool:
        """True once the grammar is complete (only EOS is allowed from here)."""
        return self._matcher.is_stopped()
