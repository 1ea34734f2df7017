"""Anthropic usage of /v1/messages: the prompt split into read, created and the rest (issue 39), and where a
request's last cache breakpoint falls in its prompt. Pure functions and fake tokenizers, no model."""

from __future__ import annotations

import json

import anthropic.types as at
import pytest

from server.core.prompts import BreakpointMarks, breakpoint_marks, render_chat
from server.core.request import GenerationRequest
from server.http.messages.format import MessagesStream, message_object, message_usage, prompt_split
from server.lane.events import Finished

# (prompt, cached, last breakpoint, written) -> (input_tokens, cache_creation_input_tokens, cache_read_input_tokens)
SPLITS = [
    ((100, 0, 0, 100), (100, 0, 0)),  # no breakpoint, cold: all of it is input, whatever the server stored
    ((100, 99, 0, 1), (1, 0, 99)),  # no breakpoint, warm
    ((100, 0, 60, 100), (40, 60, 0)),  # a breakpoint, cold: up to it created, the rest input
    ((100, 30, 60, 70), (40, 30, 30)),  # read part of the way to the breakpoint
    ((100, 60, 60, 40), (40, 0, 60)),  # read exactly up to it
    ((100, 80, 60, 20), (20, 0, 80)),  # read past it: nothing created
    ((100, 0, 97, 100), (3, 97, 0)),  # a breakpoint on the last turn: only the generation prompt is input
    ((100, 0, 150, 100), (0, 100, 0)),  # a position past the prompt counts as the prompt's end
    ((100, 0, 60, 0), (100, 0, 0)),  # the cache off: nothing was created
    ((100, 10, 60, 20), (70, 20, 10)),  # stored less than the breakpoint asked for: only what was stored
    ((100, 0, 60, None), (40, 60, 0)),  # written not known yet (message_start): as if all of it were
    ((100, 120, 60, 0), (0, 0, 100)),  # a read past the prompt is capped at the prompt
]


@pytest.mark.parametrize("args,expected", SPLITS)
def test_prompt_split_adds_up_to_the_prompt(args, expected):
    split = prompt_split(*args)
    assert (split["input_tokens"], split["cache_creation_input_tokens"], split["cache_read_input_tokens"]) == expected
    assert sum(split.values()) == args[0]


def finished(prompt=100, cached=30, written=70, completion=5) -> Finished:
    return Finished("stop", prompt, completion, cached, prompt - cached, 0.1, completion - 1, 0.2, 0.0,
                    cache_write_tokens=written)


def _counts(usage: dict) -> dict:
    return {k: usage[k] for k in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                                  "cache_creation_input_tokens")}


def test_message_usage_and_object_follow_the_last_breakpoint():
    assert _counts(message_usage(finished(), 60)) == {"input_tokens": 40, "output_tokens": 5,
                                                      "cache_read_input_tokens": 30, "cache_creation_input_tokens": 30}
    assert _counts(message_usage(finished())) == {"input_tokens": 70, "output_tokens": 5, "cache_read_input_tokens": 30,
                                                  "cache_creation_input_tokens": 0}  # no breakpoint: nothing created
    # the rest of Anthropic's usage: creation by TTL (all of it the default 5-minute kind), thinking, nulls
    full = message_usage(finished(), 60, thinking_tokens=3)
    assert full["cache_creation"] == {"ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 0}
    assert full["output_tokens_details"] == {"thinking_tokens": 3}
    assert (full["server_tool_use"], full["service_tier"], full["inference_geo"]) == (None, "standard", None)
    m = at.Message.model_validate(message_object("msg_1", "m", "Hi", "", [], "stop", None, finished(), 60))
    assert (m.usage.input_tokens, m.usage.cache_creation_input_tokens, m.usage.cache_read_input_tokens) == (40, 30, 30)


def _events(chunks: list[bytes]) -> dict:
    out = {}
    for chunk in chunks:
        name, data = chunk.decode().strip().split("\n")
        out[name.removeprefix("event: ")] = json.loads(data.removeprefix("data: "))
    return out


def test_stream_starts_with_nothing_read_and_ends_with_the_true_split():
    fmt = MessagesStream("msg_1", "m", 100, last_breakpoint=60)
    events = _events(fmt.start() + fmt.text("Hi") + fmt.finish([], "stop", None, finished(cached=80, written=20)))
    start = at.RawMessageStartEvent.model_validate(events["message_start"]).message.usage
    assert (start.input_tokens, start.cache_creation_input_tokens, start.cache_read_input_tokens) == (40, 60, 0)
    delta = at.RawMessageDeltaEvent.model_validate(events["message_delta"]).usage
    assert (delta.input_tokens, delta.cache_creation_input_tokens, delta.cache_read_input_tokens) == (20, 0, 80)
    assert delta.output_tokens == 5


class ChatML:
    """apply_chat_template of a ChatML model, one id per byte; ``text``: also renders text and encodes it (what a
    real tokenizer offers, and what ``breakpoint_marks`` uses for a breakpoint on the last turn)."""

    tool_call_start = None

    def __init__(self, text: bool = True, last_turn_differs: bool = False):
        self.text, self.last_turn_differs = text, last_turn_differs
        self.calls: list[int] = []  # messages rendered in tokens, per call

    def _render(self, messages, add_generation_prompt):
        turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if self.last_turn_differs and not add_generation_prompt:  # a template that closes the last turn otherwise
            turns[-1] = turns[-1].replace("<|im_end|>\n", "<|eot|>\n")
        return "".join(turns) + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None, tokenize=True):
        if not tokenize:
            if not self.text:
                raise TypeError("tokenize=False is not supported")
            return self._render(messages, add_generation_prompt)
        self.calls.append(len(messages))
        return list(self._render(messages, add_generation_prompt).encode())

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


MESSAGES = ({"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"})
FIRST = len("<|im_start|>system\nRules.<|im_end|>\n")
END = len("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES))


@pytest.mark.parametrize("tok", [ChatML(), ChatML(text=False)], ids=["from text", "from tokens"])
def test_the_last_breakpoint_may_be_the_end_of_the_last_turn_but_no_anchor(tok):
    req = GenerationRequest(messages=MESSAGES, breakpoints=(1, 4))
    prompt = render_chat(tok, req)
    assert len(prompt) == END + len("<|im_start|>assistant\n")
    assert breakpoint_marks(tok, req, prompt) == BreakpointMarks(anchors=(FIRST,), last=END)


def test_a_breakpoint_on_the_last_turn_is_found_without_tokenizing_the_conversation_again():
    tok = ChatML()
    req = GenerationRequest(messages=MESSAGES, breakpoints=(4,))
    prompt = render_chat(tok, req)
    tok.calls.clear()
    assert breakpoint_marks(tok, req, prompt) == BreakpointMarks(anchors=(), last=END)
    assert tok.calls == []


def test_a_last_turn_rendered_otherwise_is_cut_where_the_tokens_agree():
    tok = ChatML(last_turn_differs=True)
    req = GenerationRequest(messages=MESSAGES, breakpoints=(4,))
    prompt = render_chat(tok, req)
    assert breakpoint_marks(tok, req, prompt).last == END - len("im_end|>\n")  # "<|" still agrees


def test_no_breakpoint_marks_nothing():
    req = GenerationRequest(messages=MESSAGES)
    assert breakpoint_marks(ChatML(), req, render_chat(ChatML(), req)) == BreakpointMarks(anchors=(), last=0)
