"""/v1/responses/compact's pieces without a model (issue 47 item 3): the compaction item the server expands again,
and which messages a compacted conversation keeps."""

from __future__ import annotations

import pytest

from server.errors import InvalidRequest
from server.http.responses.capsule import PREFIX, expand, seal, summary_message_text
from server.http.responses.compact import kept_messages
from server.http.responses.schemas import INPUT_ITEMS
from server.http.responses.translate import items_to_messages


def test_a_sealed_summary_expands_back_into_the_conversation():
    item = seal("Goal: fix parser.py. Done: 'name' -> 'title'. Next: README.")
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert item["encrypted_content"].startswith(PREFIX)
    messages = items_to_messages(INPUT_ITEMS.validate_python([item, {"role": "user", "content": "Go on."}]))
    assert messages[0] == {"role": "assistant", "content": summary_message_text(
        "Goal: fix parser.py. Done: 'name' -> 'title'. Next: README.")}
    assert messages[1] == {"role": "user", "content": "Go on."}


@pytest.mark.parametrize("content", ["gAAAAABpM0Yj-opaque", PREFIX + "%%%", PREFIX + "e30"])  # foreign, damaged, {}
def test_content_this_server_did_not_write_is_a_400(content):
    with pytest.raises(InvalidRequest) as exc:
        expand(content, "input.3.encrypted_content")
    assert exc.value.param == "input.3.encrypted_content" and exc.value.code == "invalid_compaction"


def test_kept_messages_are_the_instructions_and_the_latest_user_words_that_fit():
    items = INPUT_ITEMS.validate_python([
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "one two three"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"role": "user", "content": "four five"},
        {"role": "user", "content": "six"},
    ])
    words = lambda text: len(text.split())  # noqa: E731 - a tokenizer's count, in words
    kept = kept_messages(items, words, budget=3)
    assert [(m["role"], m["content"][0]["text"]) for m in kept] == [
        ("developer", "Rules."), ("user", "four five"), ("user", "six")]  # "one two three" no longer fits
    assert all(m["type"] == "message" and m["status"] == "completed" for m in kept)
