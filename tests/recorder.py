"""What the test servers answer under /v1, recorded, so the suite can check every body and SSE event against the
published API schemas (tests/conformance.py) whichever client a test used (the SDKs, httpx, Codex CLI, Claude Code).

Two halves, one record format:

- in the server (``record_app``, put around the app by tests/seamed_server.py when ``MLX_LANE_TEST_RECORD=<dir>``
  is set, as tests/conftest.py sets it for every server the suite starts): each HTTP response or WebSocket under
  ``/v1/`` is appended to ``<dir>/<pid>.jsonl`` as it leaves, one line per ASGI message, before the bytes go out,
  so a client that has read a response finds it recorded;
- in pytest (``Records.drain``): the lines new since the last drain, put back together per response; every
  complete JSON body and SSE event is checked (tests/conformance.py), and each rejection comes back as a line
  naming the door, the request, the path in the body and the schema's rule.

Lines: ``{"r": n, "k": "http"|"ws", "m": method, "p": path, "s": status, "t": content type}`` when a response
starts, ``{"r": n, "b": base64 bytes}`` per body chunk (HTTP) or ``{"r": n, "w": text}`` per WebSocket text
message, ``{"r": n, "e": 1}`` at its end.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ENV = "MLX_LANE_TEST_RECORD"
PREFIX = "/v1/"


def record_app(app, folder: str):
    """``app`` (an ASGI app) with its ``/v1/`` responses appended to ``<folder>/<pid>.jsonl``."""
    fd: Optional[int] = None
    counter = itertools.count()

    def write(obj: dict) -> None:
        nonlocal fd
        if fd is None:
            fd = os.open(os.path.join(folder, f"{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, (json.dumps(obj, separators=(",", ":")) + "\n").encode())

    async def recorded(scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not scope["path"].startswith(PREFIX):
            return await app(scope, receive, send)
        rid, kind = next(counter), "http" if scope["type"] == "http" else "ws"
        head = {"r": rid, "k": kind, "m": scope.get("method", "GET"), "p": scope["path"]}

        async def send_recorded(message):
            t = message["type"]
            if t == "http.response.start":
                headers = message.get("headers", ())
                ctype = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), "")
                write({**head, "s": message["status"], "t": ctype})
            elif t == "http.response.body":
                if message.get("body"):
                    write({"r": rid, "b": base64.b64encode(message["body"]).decode()})
                if not message.get("more_body", False):
                    write({"r": rid, "e": 1})
            elif t == "websocket.accept":
                write({**head, "s": 101, "t": "websocket"})
            elif t == "websocket.send" and message.get("text") is not None:
                write({"r": rid, "w": message["text"]})
            elif t == "websocket.close":
                write({"r": rid, "e": 1})
            await send(message)

        return await app(scope, receive, send_recorded)

    return recorded


@dataclass
class _Open:
    """One response being put back together."""

    kind: str
    method: str
    path: str
    status: int
    ctype: str
    buf: bytearray = field(default_factory=bytearray)


class Records:
    """The pytest side: ``drain()`` checks what the servers recorded since the last call."""

    def __init__(self, folder: str):
        from tests import conformance

        self.folder = Path(folder)
        self.check = conformance
        self._offsets: dict[Path, int] = {}
        self._open: dict[tuple, _Open] = {}
        self.checked: Counter = Counter()  # door -> bodies + events checked
        self.left = ""  # what the last drain, after the last test, rejected (the terminal summary shows it)
        self.seconds = 0.0  # spent draining and checking

    def drain(self) -> list[str]:
        """Rejections of the bodies and events completed since the last drain (an empty list: all valid)."""
        start = time.perf_counter()
        problems: list[str] = []
        for path in sorted(self.folder.glob("*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                problems += self._line(path.name, json.loads(line))
        self.seconds += time.perf_counter() - start
        return problems

    def _line(self, source: str, rec: dict) -> list[str]:
        key = (source, rec["r"])
        if "k" in rec:
            self._open[key] = _Open(rec["k"], rec["m"], rec["p"], rec["s"], rec["t"])
            return []
        resp = self._open.get(key)
        if resp is None:
            return []
        if "w" in rec:  # one WebSocket message: one event
            return self._event(resp, None, rec["w"])
        if "b" in rec:
            resp.buf += base64.b64decode(rec["b"])
            return self._sse(resp) if resp.ctype.startswith("text/event-stream") else []
        del self._open[key]  # the end
        if resp.ctype.startswith("text/event-stream") or resp.kind == "ws":
            return []
        return self._body(resp)

    def _body(self, resp: _Open) -> list[str]:
        door, problems = self.check.check_body(resp.method, resp.path, resp.status, resp.ctype, bytes(resp.buf))
        if door:
            self.checked[door] += 1
        return problems

    def _sse(self, resp: _Open) -> list[str]:
        problems: list[str] = []
        while (cut := resp.buf.find(b"\n\n")) >= 0:
            frame, resp.buf = bytes(resp.buf[:cut]).decode(), resp.buf[cut + 2:]
            name, data = None, []
            for line in frame.split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            if data and data != ["[DONE]"]:  # comments (keep-alives) and OpenAI's [DONE] carry no JSON
                problems += self._event(resp, name, "\n".join(data))
        return problems

    def _event(self, resp: _Open, name: Optional[str], data: str) -> list[str]:
        door, problems = self.check.check_event(resp.method, resp.path, resp.status, name, data)
        if door:
            self.checked[door] += 1
        return problems
