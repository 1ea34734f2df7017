"""A 2-turn chat with the same image: second-turn TTFT vs first, on the tiny random-weight vision model (gemma3:
a 1-layer SigLIP tower, 16 soft tokens per image, 2 text layers; tests/fixtures/vision_model.py).

Each round uses a new image (so turn 1 is cold for every server):

  turn 1        [image + question], streamed; TTFT = request sent -> first chunk with text
  turn 2        turn 1 + the reply + a new question, the same image: a server with a prefix cache that covers images
                reuses everything up to the new question
  turn 2 cold   the same turn-2 request after the cache was emptied (POST /admin/cache/clear; mlx-lane only): what
                turn 2 costs without the hit, for a like-for-like ratio

Servers: ``ours`` (mlx-lane serve) and ``mlx_vlm`` (mlx-vlm's own ``python -m mlx_vlm.server``, the same model
directory), alternated round by round. On a random tiny model the prompt is short (~60 tokens); what a real model
saves is the image's encoding and its tokens' prefill, the same mechanism at a larger scale. The vision encoder's
time on mlx-lane's lane is read from /stats (``vision.encode_s``).

    python bench/vision_turns.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import ROOT, ServerProc, ensure_blas_here, free_port, preflight, run_record, sse_chunks, write_result

MAX_TOKENS = 8


def ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f} ms ({1000 * min(values):.1f}-{1000 * max(values):.1f})"


def chat(client, url: str, model: str, messages: list) -> tuple[float, str, dict]:
    """(TTFT s, text, usage) of one streamed greedy chat completion."""
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, parts, usage = None, [], {}
    for elapsed, chunk in sse_chunks(client, url + "/v1/chat/completions", body, timeout=600):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            text = (ch.get("delta") or {}).get("content")
            if text:
                ttft = elapsed if ttft is None else ttft
                parts.append(text)
    return ttft if ttft is not None else float("nan"), "".join(parts), usage


def conversation(png: bytes) -> tuple[list, callable]:
    from tests.fixtures.vision_model import data_uri

    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png)}},
                                          {"type": "text", "text": "What is in this picture? Answer briefly."}]}]
    return first, lambda reply: first + [{"role": "assistant", "content": reply},
                                         {"role": "user", "content": "And what colour dominates it?"}]


class MlxVlmServer:
    """mlx-vlm's own server on the same model directory (its OpenAI-compatible chat completions)."""

    def __init__(self, model_dir: Path):
        from tests.serverproc import server_env

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="mlx-vlm-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_vlm.server", "--host", "127.0.0.1", "--port",
                                      str(self.port), "--model", str(model_dir)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=server_env())
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_vlm.server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("mlx_vlm.server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--servers", default="ours,mlx_vlm")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vision_turns.json"))
    args = ap.parse_args()
    ensure_blas_here()
    from models import ensure_default_model
    from tests.fixtures.vision_model import image_png, write_vision_model

    model_dir = write_vision_model(Path(tempfile.mkdtemp(prefix="vision-bench-")) / "tinyvision",
                                   ensure_default_model(progress=False))
    before = preflight()
    servers = {}
    for name in args.servers.split(","):
        servers[name] = ServerProc("--model", str(model_dir), "--cache-bytes", "256M") if name == "ours" \
            else MlxVlmServer(model_dir)
    rows: dict[str, dict[str, list]] = {n: {"turn1": [], "turn2": [], "turn2_cold": [], "cached2": [], "same": []}
                                        for n in servers}
    names = {"ours": "tinyvision", "mlx_vlm": str(model_dir)}  # mlx-vlm's server loads the model its request names
    client = httpx.Client()
    try:
        for name, srv in servers.items():  # warm-up: the first request of a process compiles and pages in
            first, _ = conversation(image_png(999))
            chat(client, srv.url, names[name], first)
        for r in range(args.rounds):
            for name in (list(servers) if r % 2 == 0 else list(reversed(servers))):
                srv = servers[name]
                first, second = conversation(image_png(r))
                t1, reply, _ = chat(client, srv.url, names[name], first)
                t2, text2, usage2 = chat(client, srv.url, names[name], second(reply))
                row = rows[name]
                row["turn1"].append(t1)
                row["turn2"].append(t2)
                row["cached2"].append((usage2.get("prompt_tokens_details") or {}).get("cached_tokens"))
                if name == "ours":
                    client.post(srv.url + "/admin/cache/clear")
                    t2c, text2c, _ = chat(client, srv.url, names[name], second(reply))
                    row["turn2_cold"].append(t2c)
                    row["same"].append(text2c == text2)
        stats = httpx.get(servers["ours"].url + "/stats").json() if "ours" in servers else {}
    finally:
        for srv in servers.values():
            srv.stop()
    after = preflight()
    result = {"bench": "vision_turns", **run_record(), "rounds": args.rounds, "max_tokens": MAX_TOKENS,
              "model": "tiny random gemma3 vision (tests/fixtures/vision_model.py)", "preflight": before,
              "preflight_after": after, "servers": rows, "ours_vision_stats": stats.get("vision")}
    write_result(result, args.out)
    for name, row in rows.items():
        t1, t2 = statistics.median(row["turn1"]), statistics.median(row["turn2"])
        line = (f"{name:8s} turn 1 TTFT {ms(row['turn1'])} | turn 2 {ms(row['turn2'])} (x{t2 / t1:.2f}) | "
                f"turn 2 cached tokens {row['cached2']}")
        if row["turn2_cold"]:
            t2c = statistics.median(row["turn2_cold"])
            line += f" | turn 2 cold {ms(row['turn2_cold'])} (hit/cold x{t2 / t2c:.2f}, same text {all(row['same'])})"
        print(line)
    print("vision on the lane:", json.dumps(stats.get("vision")))


if __name__ == "__main__":
    main()
