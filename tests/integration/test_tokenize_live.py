"""/tokenize, /detokenize, /v1/responses/input_tokens and Anthropic's thinking / output_config fields on the real
default model through the shared live server (generations of one or two tokens)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.model

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
TEXTS = ["Hello, world!", "  two  spaces, a tab\tand a newline\n", "naïve café 😀 ünïcödé",
         "x = [1, 2, 3]  # code"]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


# -- /tokenize and /detokenize ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(server, text):
    llama = ok(post(server, "/tokenize", {"content": text}))
    assert llama["count"] == len(llama["tokens"]) > 0 and all(isinstance(t, int) for t in llama["tokens"])
    back = ok(post(server, "/detokenize", {"tokens": llama["tokens"]}))
    assert back["content"] == back["prompt"] == text
    vllm = ok(post(server, "/tokenize", {"model": "default", "prompt": text, "add_special_tokens": False}))
    assert vllm["tokens"] == llama["tokens"]


def test_pieces_and_token_strings_describe_the_same_ids(server):
    text = TEXTS[2]
    ids = ok(post(server, "/tokenize", {"content": text}))["tokens"]
    rich = ok(post(server, "/tokenize", {"content": text, "with_pieces": True, "return_token_strs": True}))
    assert [t["id"] for t in rich["tokens"]] == ids and len(rich["token_strs"]) == len(ids)
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in rich["tokens"])
    assert raw.decode("utf-8") == text  # pieces (text, or bytes of part of a character) add up to the text
    assert any(isinstance(p["piece"], list) for p in rich["tokens"])  # the emoji spans two tokens


def test_special_token_text_is_parsed_unless_told_not_to(server):
    text = "<|im_start|>user"
    parsed = ok(post(server, "/tokenize", {"content": text}))["tokens"]
    literal = ok(post(server, "/tokenize", {"content": text, "parse_special": False}))["tokens"]
    assert len(parsed) < len(literal)
    assert ok(post(server, "/detokenize", {"tokens": literal}))["content"] == text


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_ids_are_the_prompt_a_chat_completion_counts(server, client, tools):
    extra = {"tools": tools} if tools else {}
    tokenized = ok(post(server, "/tokenize", {"model": "default", "messages": CHAT, **extra}))
    completion = client.chat.completions.create(model="default", messages=CHAT, max_tokens=1, temperature=0, **extra)
    assert tokenized["count"] == completion.usage.prompt_tokens == len(tokenized["tokens"])
    assert tokenized["max_model_len"] > tokenized["count"]
    rendered = ok(post(server, "/detokenize", {"tokens": tokenized["tokens"]}))["prompt"]
    assert "You are terse." in rendered and "Name a colour." in rendered and "<|im_start|>assistant" in rendered


def test_chat_generation_prompt_switches(server):
    full = ok(post(server, "/tokenize", {"messages": CHAT}))["tokens"]
    bare = ok(post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}))["tokens"]
    assert bare == full[:len(bare)] and len(bare) < len(full)
    reply = CHAT + [{"role": "assistant", "content": "Blue"}]
    cont = ok(post(server, "/tokenize", {"messages": reply, "continue_final_message": True}))["tokens"]
    assert ok(post(server, "/detokenize", {"tokens": cont}))["prompt"].endswith("<|im_start|>assistant\nBlue")


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
])
def test_bad_input_is_a_400(server, path, body, param):
    err = error(post(server, path, body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_the_vocabularys_last_id_decodes_and_the_next_is_a_400(server):
    msg = error(post(server, "/detokenize", {"tokens": [10**7]}), 400)["message"]  # the 400 names the range
    last = int(msg.rsplit("ids 0 to ", 1)[1].rstrip(")"))
    assert last > 1000
    assert isinstance(ok(post(server, "/detokenize", {"tokens": [0, last]}))["prompt"], str)
    assert error(post(server, "/detokenize", {"tokens": [0, last + 1]}), 400)["param"] == "tokens"


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}),
                                       ("/tokenize", {"messages": CHAT})])
def test_unknown_model_is_an_openai_404(server, path, body):
    err = error(post(server, path, {**body, "model": "no-such-model"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


# -- /v1/responses/input_tokens -----------------------------------------------------------------------------------

def test_input_tokens_is_the_responses_usage(server, client):
    body = dict(model="default", instructions="Be brief.", input="Say hi.",
                tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    counted = client.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    first = client.responses.create(**body, max_output_tokens=2, temperature=0)
    assert counted.input_tokens == first.usage.input_tokens
    follow = dict(model="default", previous_response_id=first.id, input="And again?")
    again = client.responses.input_tokens.count(**follow)
    second = client.responses.create(**follow, max_output_tokens=2, temperature=0)
    assert again.input_tokens == second.usage.input_tokens > counted.input_tokens


def test_input_tokens_errors(server):
    assert error(post(server, "/v1/responses/input_tokens", {"input": "hi", "model": "nope"}), 404)["code"] == (
        "model_not_found")
    err = error(post(server, "/v1/responses/input_tokens", {"input": "hi", "previous_response_id": "resp_gone"}), 404)
    assert err["code"] == "previous_response_not_found"
    assert error(post(server, "/v1/responses/input_tokens", {}), 400)["param"] == "input"


# -- Anthropic thinking / output_config ---------------------------------------------------------------------------

HI = [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize("fields", [
    {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    {"thinking": {"type": "disabled"}},
    {"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}},
    {"output_config": {"effort": "max"}},
])
def test_sdk_thinking_and_effort_are_accepted(claude, fields):
    m = claude.messages.create(model="default", max_tokens=2, messages=HI, extra_body={"temperature": 0}, **fields)
    assert m.type == "message" and m.usage.output_tokens >= 1
    counted = claude.messages.count_tokens(model="default", messages=HI, **fields).input_tokens
    # the default model's template has no reasoning variables: the prompt is the one without the fields
    assert counted == claude.messages.count_tokens(model="default", messages=HI).input_tokens


@pytest.mark.parametrize("fields", [{"thinking": {"type": "sometimes"}}, {"output_config": {"effort": "extreme"}}])
def test_unknown_thinking_or_effort_is_anthropics_400(server, fields):
    r = post(server, "/v1/messages", {"model": "default", "max_tokens": 2, "messages": HI, **fields})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and next(iter(fields)) in r.json()["error"]["message"]


def test_thinking_blocks_in_history_are_accepted_and_not_rendered(claude):
    history = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two and two make four.", "signature": "c2ln"},
            {"type": "redacted_thinking", "data": "b3BhcXVl"},
            {"type": "text", "text": "4"}]},
        {"role": "user", "content": "And 3+3?"},
    ]
    plain = [history[0], {"role": "assistant", "content": "4"}, history[2]]
    m = claude.messages.create(model="default", max_tokens=2, messages=history,
                               thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    assert m.stop_reason in ("end_turn", "max_tokens")
    with_thinking = claude.messages.count_tokens(model="default", messages=history).input_tokens
    assert with_thinking == claude.messages.count_tokens(model="default", messages=plain).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens == (
        with_thinking)
