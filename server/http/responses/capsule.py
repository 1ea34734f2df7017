"""The ``compaction`` item of ``/v1/responses/compact``: a compacted conversation as one opaque input item the server
expands again (OpenAI's ``{"type": "compaction", "id", "encrypted_content"}``).

``seal(summary)`` writes the item; ``expand(content, param)`` reads its ``encrypted_content`` back into the summary
text, which a conversation shows as an assistant message (``SUMMARY_HEADING`` and the summary). The content is
``mlx-lane.compaction.v1.`` + URL-safe base64 of a small JSON object. It is neither encrypted nor signed, on purpose:
everything it can say, a client may send as an input message directly, so hiding or signing it would protect
nothing; it names its format and version so that another server's item (OpenAI's, mlx-vlm's) is a 400 that says so,
never a silently dropped part of the conversation.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid

from server.errors import InvalidRequest

__all__ = ["seal", "expand", "summary_message_text", "PREFIX", "SUMMARY_HEADING"]

PREFIX = "mlx-lane.compaction.v1."
SUMMARY_HEADING = "Summary of the conversation so far (it replaces the earlier turns):"


def seal(summary: str) -> dict:
    """The compaction item holding ``summary``."""
    payload = json.dumps({"summary": summary}, ensure_ascii=False, separators=(",", ":")).encode()
    content = PREFIX + base64.urlsafe_b64encode(payload).decode().rstrip("=")
    return {"id": "cmp_" + uuid.uuid4().hex, "type": "compaction", "encrypted_content": content}


def expand(content: str, param: str) -> str:
    """The summary a compaction item's ``encrypted_content`` holds; InvalidRequest naming ``param`` for content this
    server did not write."""
    if not isinstance(content, str) or not content.startswith(PREFIX):
        raise InvalidRequest("this compaction item was not made by this server (mlx-lane expands only the items its "
                             "/v1/responses/compact returned); send the conversation itself instead",
                             param=param, code="invalid_compaction")
    body = content[len(PREFIX):]
    try:
        value = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"this compaction item's content is damaged ({exc}); send the conversation itself "
                             "instead", param=param, code="invalid_compaction") from exc
    if not isinstance(value, dict) or not isinstance(value.get("summary"), str):
        raise InvalidRequest("this compaction item holds no summary; send the conversation itself instead",
                             param=param, code="invalid_compaction")
    return value["summary"]


def summary_message_text(summary: str) -> str:
    """What the conversation shows in place of the compacted turns (an assistant message's text)."""
    return f"{SUMMARY_HEADING}\n{summary.strip()}"
