"""SSD tier benchmarks on the default model: restart TTFT vs cold prefill, restore vs dd, write-behind overhead.

1. restart: a ~--context-token conversation is sent to a server with the SSD tier on (temporary
   directory), flushed, and the server is stopped with SIGTERM. A new server on the same directory
   receives the next turn (the conversation + its reply + a short new user message): its TTFT is
   compared with the TTFT of the same next turn on a cold server (--no-ssd-cache), alternating
   which one runs first over --rounds rounds. Target: restart TTFT <= 1.5% of cold.
2. restore throughput: the server's own restore MB/s (/stats) vs the disk's sequential read of the
   same file measured with dd right after dropping the page cache (when permitted). Target >= 0.5.
3. write-behind overhead: decode tok/s with the SSD tier on vs off, two servers alternated, each
   request a new prompt so every request schedules a write. Target >= 0.98.

JSON (with a preflight of the machine before the first round and after the last) in bench/results/ssd_restart.json.

    python bench/ssd_restart.py --rounds 3 --context 4000
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from common import ROOT, ServerProc, ensure_blas_here, median_range, preflight, run_record, sse_chunks, write_result

FILLER = (
    "    def handle(self, request):\n        # route the request to its handler and log the outcome\n"
    "        handler = self.routes.get(request.path)\n        if handler is None:\n"
    "            return Response(404, 'not found')\n        result = handler(request)\n"
    "        self.log.info('%s %s -> %s', request.method, request.path, result.status)\n"
    "        return result\n"
)


def conversation(context_tokens: int, tokenizer) -> list[dict]:
    text, i = "", 0
    while len(tokenizer.encode(text)) < context_tokens - 60:
        text += f"# file part {i}\n" + FILLER
        i += 1
    return [{"role": "system", "content": "You are a coding agent. Read the tool output and answer briefly."},
            {"role": "user", "content": "Tool output of `cat server.py`:\n" + text}]


def ttft(url: str, messages: list[dict], max_tokens: int = 4) -> tuple[float, dict, str]:
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first, usage, parts = None, None, []
    for elapsed, chunk in sse_chunks(httpx, url + "/v1/chat/completions", body, timeout=1800):
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            first = first or elapsed
            parts.append(chunk["choices"][0]["delta"]["content"])
    return first, usage, "".join(parts)


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dd_read_mb_s(path: str) -> float:
    drop_page_cache()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M"], check=True, capture_output=True)
    return os.path.getsize(path) / (time.perf_counter() - t0) / 1e6


def restart_round(turn1, turn2, root: str) -> dict:
    import httpx

    a = ServerProc("--model", "default", "--ssd-cache", root)
    try:
        cold1, _, _ = ttft(a.url, turn1)
        assert httpx.post(a.url + "/admin/cache/flush?timeout=120", timeout=200).status_code == 200
    finally:
        assert a.stop() == 0
    files = glob.glob(os.path.join(root, "*", "*", "*.safetensors"))
    dd = dd_read_mb_s(max(files, key=os.path.getsize)) if files else None
    dropped = drop_page_cache()
    b = ServerProc("--model", "default", "--ssd-cache", root)
    try:
        warm, usage, text_warm = ttft(b.url, turn2)
        ssd = httpx.get(b.url + "/stats").json()["ssd_cache"]
    finally:
        assert b.stop() == 0
    c = ServerProc("--model", "default", "--no-ssd-cache")
    try:
        cold2, usage_cold, text_cold = ttft(c.url, turn2)
    finally:
        assert c.stop() == 0
    assert text_warm == text_cold, (text_warm, text_cold)
    return {"cold_turn1_s": cold1, "restart_ttft_s": warm, "cold_ttft_s": cold2, "ratio": warm / cold2,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "restore_mb_s": ssd.get("restore_mb_s"), "restore_ms_last": ssd.get("restore_ms_last"),
            "dd_mb_s": dd, "page_cache_dropped": dropped}


def decode_rate(url: str, i: int, tokens: int, eos: list[int]) -> float:
    import httpx

    body = {"messages": [{"role": "user", "content": f"Story {i}: write a long story about a lighthouse."}],
            "max_tokens": tokens, "temperature": 0, "stream": True, "logit_bias": {str(e): -100 for e in eos}}
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                stamps.append(time.perf_counter())
    stamps = stamps[1:]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def write_behind(rounds: int, tokens: int, eos: list[int]) -> dict:
    root = tempfile.mkdtemp(prefix="mlx-lane-wb-")
    on = ServerProc("--model", "default", "--ssd-cache", root, "--write-behind-debounce", "0.2")
    off = ServerProc("--model", "default", "--no-ssd-cache")
    rates = {"on": [], "off": []}
    try:
        for i in range(rounds):
            order = [("on", on), ("off", off)] if i % 2 == 0 else [("off", off), ("on", on)]
            for name, srv in order:
                rates[name].append(decode_rate(srv.url, i, tokens, eos))
        writes = __import__("httpx").get(on.url + "/stats").json()["ssd_cache"]["writes"]
    finally:
        on.stop()
        off.stop()
        shutil.rmtree(root, ignore_errors=True)
    ratio = [a / b for a, b in zip(rates["on"], rates["off"])]
    return {"on_tok_s": median_range(rates["on"]), "off_tok_s": median_range(rates["off"]),
            "ratio_median": round(statistics.median(ratio), 3), "ratio_per_round": [round(x, 3) for x in ratio],
            "ssd_writes_during_run": writes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--wb-rounds", type=int, default=6)
    ap.add_argument("--wb-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ssd_restart.json"))
    args = ap.parse_args()
    ensure_blas_here()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from models import ensure_default_model

    tok = load_tokenizer(ensure_default_model(progress=False))
    turn1 = conversation(args.context, tok)
    turn2 = turn1 + [{"role": "assistant", "content": "I read it."},
                     {"role": "user", "content": "Which method logs the request outcome? One word."}]
    restarts = []
    pf = preflight()
    for i in range(args.rounds):
        root = tempfile.mkdtemp(prefix="mlx-lane-restart-")
        try:
            restarts.append(restart_round(turn1, turn2, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(restarts[-1]), flush=True)
    wb = write_behind(args.wb_rounds, args.wb_tokens, sorted(tok.eos_token_ids))
    pf_end = preflight()
    ratios = [r["ratio"] for r in restarts]
    restore_vs_dd = [r["restore_mb_s"] / r["dd_mb_s"] for r in restarts if r["restore_mb_s"] and r["dd_mb_s"]]
    result = {
        **run_record(),
        "preflight": pf,
        "restart_over_cold_median": round(statistics.median(ratios), 4),
        "restart_over_cold_per_round": [round(x, 4) for x in ratios],
        "restart_ttft_s": median_range([r["restart_ttft_s"] for r in restarts]),
        "cold_ttft_s": median_range([r["cold_ttft_s"] for r in restarts]),
        "restore_over_dd": [round(x, 3) for x in restore_vs_dd],
        "write_behind": wb,
        "rounds": restarts,
        "preflight_end": pf_end,
    }
    write_result(result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
