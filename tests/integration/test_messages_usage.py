"""Usage on /v1/messages as Anthropic's API counts it (issue 39), through the official anthropic SDK on the real
default model and the shared live server: cache_read_input_tokens = prompt tokens served from the prefix cache,
cache_creation_input_tokens = the tokens up to the request's last cache_control breakpoint that were not read,
input_tokens = the rest; the three add up to what /v1/messages/count_tokens says. Each test clears the RAM tier
first (the shared server holds other tests' entries), so "read" is known exactly; a resend whose hit depends on
how the model's reply re-tokenizes takes it from the cache's own counter (/stats prompt_cache.tokens_hit)."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.model

GREEDY = {"temperature": 0}  # current SDKs dropped `temperature` from messages.create; the API field exists
MARK = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def clear(server) -> None:
    """Empty the RAM tier (the test server has no SSD tier): nothing is read from the cache until the caller
    puts something there (every prompt of this model shares at least the template's opening)."""
    r = httpx.post(server.url + "/admin/cache/clear", timeout=30)
    assert r.status_code == 200, r.text


@pytest.fixture()
def cold(server):
    clear(server)


def split(usage) -> tuple[int, int, int]:
    return usage.input_tokens, usage.cache_creation_input_tokens, usage.cache_read_input_tokens


def unique(text: str) -> str:
    return f"{text} (run {time.time_ns()})"  # a prompt no earlier request on this server sent


def tokens_hit(server) -> int:
    return httpx.get(server.url + "/stats", timeout=30).json()["prompt_cache"]["tokens_hit"]


def position(tok, chat: list[dict], upto: int, prompt_tokens: int) -> int:
    """Token position where the first ``upto`` chat messages end in the prompt (the breakpoint after them): the
    template's rendering of those messages alone, as far as it agrees with the whole prompt's."""
    whole = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert len(whole) == prompt_tokens  # the chat messages below are what the server renders for the request
    cut = tok.apply_chat_template(chat[:upto], add_generation_prompt=False)
    return next((i for i, (a, b) in enumerate(zip(cut, whole)) if a != b), min(len(cut), len(whole)))


def common_prefix(tok, a: list[dict], b: list[dict]) -> int:
    x, y = (tok.apply_chat_template(m, add_generation_prompt=True) for m in (a, b))
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def streamed(claude, **kw):
    """(message_start's usage, the SDK's accumulated final message) of a streamed request."""
    start = None
    with claude.messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "message_start":
                start = event.message.usage
        final = stream.get_final_message()
    assert start is not None
    return start, final


def test_no_breakpoint_is_all_input_cold_and_the_rest_warm(claude, server, cold):
    messages = [{"role": "user", "content": unique("Name a colour.")}]
    kw = dict(model="default", max_tokens=3, messages=messages, extra_body=GREEDY)
    prompt = claude.messages.count_tokens(model="default", messages=messages).input_tokens
    first = claude.messages.create(**kw)
    assert split(first.usage) == (prompt, 0, 0)  # nothing read, nothing asked to be cached: all input
    again = claude.messages.create(**kw)  # the same prompt: all of it but the last token is read
    assert split(again.usage) == (1, 0, prompt - 1)
    start, final = streamed(claude, **kw)
    assert split(start) == (prompt, 0, 0)  # message_start: the cache hit is not known yet
    assert split(final.usage) == (1, 0, prompt - 1)  # message_delta's true split is what the SDK keeps
    assert 1 <= final.usage.output_tokens <= 3


def test_a_breakpoint_in_system_creates_up_to_it(claude, server, tok, cold):
    rules = unique("You are a terse assistant. Answer in one word.")
    system = [{"type": "text", "text": rules, "cache_control": MARK}]
    q1, q2 = [{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "Name a tree."}]
    chat1, chat2 = ([{"role": "system", "content": rules}] + q for q in (q1, q2))
    kw = dict(model="default", max_tokens=3, system=system, extra_body=GREEDY)
    p1 = claude.messages.count_tokens(model="default", system=system, messages=q1).input_tokens
    p2 = claude.messages.count_tokens(model="default", system=system, messages=q2).input_tokens
    mark1, mark2 = position(tok, chat1, 1, p1), position(tok, chat2, 1, p2)
    assert mark1 == mark2 and 0 < mark1 < p1
    first = claude.messages.create(messages=q1, **kw)
    assert split(first.usage) == (p1 - mark1, mark1, 0)
    # another question under the same system prompt, streamed: read as far as the two prompts agree (past the
    # breakpoint, into the user turn's opening), so nothing is created
    read = common_prefix(tok, chat1, chat2)
    assert mark2 <= read < p2
    start, final = streamed(claude, messages=q2, **kw)
    assert split(start) == (p2 - mark2, mark2, 0)
    assert split(final.usage) == (p2 - read, 0, read)


def test_breakpoints_in_tools_and_messages_create_up_to_the_last(claude, server, tok, cold):
    tools = [{"name": "get_weather", "description": "Current weather of a city", "cache_control": MARK,
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    rules = unique("You help with the weather.")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello.", "cache_control": MARK}]},
        {"role": "assistant", "content": "Hi! Which city?"},
        {"role": "user", "content": [{"type": "text", "text": "Paris, please."}, {"type": "text", "text": "Be brief.",
                                                                                   "cache_control": MARK}]},
    ]
    chat = [{"role": "system", "content": rules}, {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi! Which city?"},
            {"role": "user", "content": "Paris, please.\nBe brief."}]  # a turn's text blocks join with a newline
    kw = dict(model="default", system=rules, tools=tools, messages=messages)
    prompt = claude.messages.count_tokens(**kw).input_tokens
    as_functions = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in tools]
    assert len(tok.apply_chat_template(chat, tools=as_functions, add_generation_prompt=True)) == prompt
    end = position(tok, chat, len(chat), prompt)  # the last breakpoint: the last turn's last block
    assert position(tok, chat, 2, prompt) < end < prompt  # the earlier ones (system + tools, turn 1) come first
    first = claude.messages.create(max_tokens=3, extra_body=GREEDY, **kw)
    assert split(first.usage) == (prompt - end, end, 0)  # only the generation prompt after the breakpoint is input
    start, again = streamed(claude, max_tokens=3, extra_body=GREEDY, **kw)
    assert split(start) == (prompt - end, end, 0)
    assert split(again.usage) == (1, 0, prompt - 1)


def test_a_two_turn_resend_reads_turn_one_and_creates_up_to_the_new_breakpoint(claude, server, tok, cold):
    """Claude Code's shape: a marked system prompt and the marker on the last user block of every turn."""
    rules = unique("You are a coding agent.")
    system = [{"type": "text", "text": rules, "cache_control": MARK}]
    turn1 = [{"role": "user", "content": [{"type": "text", "text": "Say one word.", "cache_control": MARK}]}]
    chat1 = [{"role": "system", "content": rules}, {"role": "user", "content": "Say one word."}]
    kw = dict(model="default", max_tokens=4, system=system, extra_body=GREEDY,
              metadata={"user_id": unique("usage-session")})
    p1 = claude.messages.count_tokens(model="default", system=system, messages=turn1).input_tokens
    end1 = position(tok, chat1, 2, p1)
    r1 = claude.messages.create(messages=turn1, **kw)
    assert split(r1.usage) == (p1 - end1, end1, 0)
    reply = "".join(b.text for b in r1.content if b.type == "text")
    turn2 = [{"role": "user", "content": "Say one word."}, {"role": "assistant", "content": reply},
             {"role": "user", "content": [{"type": "text", "text": "Another one.", "cache_control": MARK}]}]
    chat2 = chat1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one."}]
    p2 = claude.messages.count_tokens(model="default", system=system, messages=turn2).input_tokens
    end2 = position(tok, chat2, 4, p2)
    before = tokens_hit(server)
    start, r2 = streamed(claude, messages=turn2, **kw)
    read = tokens_hit(server) - before  # turn 1's prompt, and as much of the reply as re-tokenizes the same
    assert p1 <= read < end2
    assert split(start) == (p2 - end2, end2, 0)
    assert split(r2.usage) == (p2 - end2, end2 - read, read)
    assert sum(split(r2.usage)) == p2


def test_openai_doors_report_cached_tokens_within_the_prompt(server, cold):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": unique("Name a bird.")}]
    cold_chat = client.chat.completions.create(model="default", messages=messages, max_tokens=2, temperature=0)
    prompt = cold_chat.usage.prompt_tokens
    assert cold_chat.usage.prompt_tokens_details.cached_tokens == 0
    warm = client.chat.completions.create(model="default", messages=messages, max_tokens=2, temperature=0)
    assert warm.usage.prompt_tokens == prompt and warm.usage.prompt_tokens_details.cached_tokens == prompt - 1
    question = unique("Name a fish.")
    clear(server)
    r1 = client.responses.create(model="default", input=question, max_output_tokens=2, temperature=0)
    details = r1.usage.input_tokens_details
    assert details.cached_tokens == 0
    assert details.cache_write_tokens == r1.usage.input_tokens  # OpenAI's field, our count: all of it stored
    r2 = client.responses.create(model="default", input=question, max_output_tokens=2, temperature=0)
    details = r2.usage.input_tokens_details
    assert r2.usage.input_tokens == r1.usage.input_tokens
    assert details.cached_tokens == r2.usage.input_tokens - 1 and details.cache_write_tokens == 1
