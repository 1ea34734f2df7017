"""Test helpers: read one SSE chat stream on a thread and keep everything a test needs to judge how it ended."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Optional

import httpx


@dataclass
class StreamRecord:
    """What one streaming client saw: status, every `data:` payload, and how the connection ended."""

    status: Optional[int] = None
    data: list[str] = field(default_factory=list)  # payloads of `data:` lines, "[DONE]" included
    transport_error: Optional[str] = None  # the connection was cut (or never made)
    first_token: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def chunks(self) -> list[dict]:
        return [json.loads(d) for d in self.data if d != "[DONE]"]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices"))

    @property
    def finish_reasons(self) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in self.chunks
                if c.get("choices") and c["choices"][0].get("finish_reason")]

    @property
    def errors(self) -> list[dict]:
        return [c["error"] for c in self.chunks if "error" in c]

    @property
    def done(self) -> bool:
        return bool(self.data) and self.data[-1] == "[DONE]"


def start_stream(url: str, messages: list[dict], max_tokens: int, headers: dict | None = None,
                 **extra) -> StreamRecord:
    """POST a greedy streaming chat request on a daemon thread; the record fills in as chunks arrive. ``extra``:
    more body fields (e.g. a ``logit_bias`` that keeps the model from ending early)."""
    rec = StreamRecord()
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}

    def run() -> None:
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
                rec.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue  # keep-alive comments, blank separators
                    rec.data.append(line[6:])
                    if line != "data: [DONE]" and rec.text:
                        rec.first_token.set()
        except httpx.HTTPError as exc:
            rec.transport_error = f"{type(exc).__name__}: {exc}"
        finally:
            rec.first_token.set()  # never leave a waiter hanging on a stream that ended early
            rec.ended.set()

    threading.Thread(target=run, daemon=True).start()
    return rec
