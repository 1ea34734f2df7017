"""What Codex CLI and Claude Code send, on the real default model behind a live server, through the official SDKs:
Codex's custom apply_patch tool (a forced call's input follows Codex's own Lark grammar, streamed as the SDK's
custom-tool events, and the call and its output come back in the next request, also through previous_response_id),
its client-side tool search, the session-id header; Claude Code's billing header (two sessions share their system
prompt) and the cache usage Anthropic's SDK reads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.byte_tokenizer import ByteTokenizer, accepts

CODEX = json.loads((Path(__file__).parents[1] / "fixtures" / "agents" / "codex_0171_gpt55_request.json").read_text())
CODEX_TOOLS = [t for t in CODEX["body"]["tools"] if t["type"] in ("custom", "tool_search", "web_search")]
PATCH_GRAMMAR = next(t for t in CODEX_TOOLS if t["type"] == "custom")["format"]["definition"]
# the small default model copies a patch it is shown (what is tested here is the grammar's hold on the call's input,
# not the model's skill: a real coding model writes its own, bench/agent_sessions.py)
ASK = [{"role": "developer", "content": "To create a file, call apply_patch with a patch such as:\n*** Begin Patch\n"
                                        "*** Add File: notes.txt\n+some text\n*** End Patch"},
       {"role": "user", "content": "Create hello.txt containing hi."}]
FORCE = {"type": "custom", "name": "apply_patch"}


def parses_as_a_patch(text: str) -> bool:
    """Does ``text`` follow Codex's apply_patch grammar? (Checked byte by byte with llguidance, no model.)"""
    from llguidance import LLMatcher

    return accepts(ByteTokenizer(), LLMatcher.grammar_from_lark(PATCH_GRAMMAR), text)


@pytest.fixture()
def oa(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_forced_apply_patch_call_is_a_patch_and_goes_back_in(oa):
    r = oa.responses.create(model="default", input=ASK, tools=CODEX_TOOLS, tool_choice=FORCE,
                            max_output_tokens=80, temperature=0, store=True)
    calls = [o for o in r.output if o.type == "custom_tool_call"]
    assert len(calls) == 1 and calls[0].name == "apply_patch", r.output
    patch = calls[0].input
    assert patch.startswith("*** Begin Patch\n") and parses_as_a_patch(patch), patch
    # Codex's next request: the call and what applying it printed, resent whole
    again = oa.responses.create(model="default", tools=CODEX_TOOLS, max_output_tokens=4, temperature=0, input=[
        *ASK, {"type": "custom_tool_call", "call_id": calls[0].call_id, "name": "apply_patch", "input": patch},
        {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Success. Updated: A hello.txt"}])
    assert again.status in ("completed", "incomplete") and again.usage.input_tokens > r.usage.input_tokens
    # or continued from the stored response: the same conversation, so the same prompt
    cont = oa.responses.create(model="default", previous_response_id=r.id, tools=CODEX_TOOLS, max_output_tokens=4,
                               temperature=0, input=[{"type": "custom_tool_call_output", "call_id": calls[0].call_id,
                                                      "output": "Success. Updated: A hello.txt"}])
    assert cont.usage.input_tokens == again.usage.input_tokens
    assert cont.usage.input_tokens_details.cached_tokens > 0


def test_a_streamed_custom_call_arrives_as_the_sdks_custom_tool_events(oa):
    kinds, done = [], None
    with oa.responses.stream(model="default", input=ASK, tools=CODEX_TOOLS, tool_choice=FORCE,
                             max_output_tokens=80, temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.custom_tool_call_input.done":
                done = event.input
        final = stream.get_final_response()
    assert "response.custom_tool_call_input.delta" in kinds and done is not None and parses_as_a_patch(done)
    (item,) = [o for o in final.output if o.type == "custom_tool_call"]
    assert item.input == done


def test_tool_choice_required_counts_custom_tools_and_a_broken_grammar_is_a_400(server, oa):
    r = oa.responses.create(model="default", input=ASK, tools=CODEX_TOOLS, tool_choice="required",
                            max_output_tokens=60, temperature=0)
    assert [o.type for o in r.output if o.type.endswith("call")], r.output  # some call: apply_patch or the search
    bad = [{"type": "custom", "name": "broken_tool", "format": {"type": "grammar", "syntax": "lark",
                                                                "definition": "start: ("}}]
    resp = httpx.post(server.url + "/v1/responses", json={"model": "default", "input": "x", "tools": bad},
                      timeout=60)
    assert resp.status_code == 400 and "broken_tool" in resp.json()["error"]["message"]


def test_codexs_session_id_header_is_the_cache_session(server, oa):
    def session_hits():
        return httpx.get(server.url + "/stats").json()["prompt_cache"]["session_hits"]

    sid = f"codex-{time.time()}"
    first = [{"role": "user", "content": f"Say hello. ({sid})"}]
    r1 = oa.responses.create(model="default", input=first, max_output_tokens=3, temperature=0,
                             extra_headers={"session-id": sid})
    before = session_hits()
    follow = [*first, {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "Again."}]
    r2 = oa.responses.create(model="default", input=follow, max_output_tokens=3, temperature=0,
                             extra_headers={"session-id": sid})
    assert session_hits() == before + 1 and r2.usage.input_tokens_details.cached_tokens > 0


def test_two_claude_code_sessions_share_their_system_prompt(server, default_model_dir):
    import anthropic
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    rules = "You are a careful coding agent. " * 40 + f"({time.time()})"  # a system prompt no earlier test sent
    tools = [{"name": "Write", "description": "Write a file", "cache_control": {"type": "ephemeral"},
              "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]

    def session(suffix: str, question: str):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; "
                                           "cc_entrypoint=sdk-cli;"},
                  {"type": "text", "text": rules, "cache_control": {"type": "ephemeral"}}]
        return ant.messages.create(model="default", max_tokens=2, extra_body={"temperature": 0}, system=system,
                                   tools=tools,
                                   messages=[{"role": "user", "content": question}],
                                   metadata={"user_id": json.dumps({"session_id": f"s-{suffix}"})})

    first = session("a1f", "Write hello.txt please.")
    second = session("7c0", "Something else entirely?")
    u1, u2 = first.usage, second.usage
    # the system prompt and the tools as the model's template renders them (the billing header dropped)
    tok = load_tokenizer(Path(default_model_dir))
    as_function = [{"type": "function", "function": {"name": "Write", "description": "Write a file",
                                                      "parameters": tools[0]["input_schema"]}}]
    system_tokens = len(tok.apply_chat_template([{"role": "system", "content": rules}], tools=as_function,
                                                add_generation_prompt=False))
    # the first session can reuse at most the template's opening that earlier tests on this server left (a few
    # tokens, before the new system text); what it computes it reports as created
    assert u1.cache_read_input_tokens < 20 and u1.cache_creation_input_tokens > 0
    assert u2.cache_read_input_tokens >= system_tokens - 2  # served from the first session's entries
    for u, question in ((u1, "Write hello.txt please."), (u2, "Something else entirely?")):
        total = ant.messages.count_tokens(model="default", system=rules, tools=tools,
                                          messages=[{"role": "user", "content": question}]).input_tokens
        assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == total
