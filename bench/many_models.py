"""Many models in one server (issue 25): what loading on demand costs, against starting a server for the model.

Two packaged models are served on demand from one --models-dir (symlinks in a temporary folder) beside the
default base model: A (--a, default Qwen2.5-Coder-0.5B-Instruct) and B (--b, default SmolLM2-135M-Instruct under
another name: its own entry, the base's weights loaded again). Per round, side by side:

  serve_first_token   `mlx-lane serve --model A` from the process start to the first token of one request
  load_first_token    a running server (base model warm), the first request for A: load + prefill to first token
  warm_first_token    the same server, a new prompt of the same length to A once loaded: prefill only
  alternate_max1      --max-loaded-models 1: --turns requests alternating A, B, A, ... (every one loads its model;
                      both were loaded once before, so their files are in the page cache)
  alternate_max2      --max-loaded-models 2: the same requests, both models resident

and the ratios load_first_token / serve_first_token and alternate_max1 / alternate_max2 (the switching cost).
Prompts are distinct per request (nothing cached); replies are --max-tokens long. JSON in
bench/results/many_models.json with a preflight before and after.

    python bench/many_models.py --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from common import ServerProc, ensure_blas_here, preflight, run_record, sse_chunks, write_result


def first_token(url: str, model: str | None, text: str, max_tokens: int) -> float:
    body = {**({"model": model} if model else {}), "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    first = None
    for elapsed, chunk in sse_chunks(httpx, url + "/v1/chat/completions", body, timeout=1800):
        if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None:
            first = elapsed
    return first if first is not None else float("nan")


def prompt(tag: str) -> str:
    return f"[{tag}] Explain in two sentences what a hash map is and when a list is the better choice."


def main() -> int:
    ensure_blas_here()
    from models import ensure_packaged

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="qwen2.5-coder-0.5b")
    ap.add_argument("--b", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default="bench/results/many_models.json")
    args = ap.parse_args()
    a_dir, b_dir = ensure_packaged(args.a, progress=True), ensure_packaged(args.b, progress=True)
    folder = Path(tempfile.mkdtemp(prefix="mlx-lane-models-"))
    (folder / "model-a").symlink_to(a_dir)
    (folder / "model-b").symlink_to(b_dir)
    common = ("--cache-bytes", "1G", "--no-ssd-cache", "--embedding-model", "none")
    pre = preflight()
    rounds = []
    for r in range(args.rounds):
        row: dict = {}
        t0 = time.perf_counter()
        srv = ServerProc("--model", str(a_dir), *common)
        try:
            ready = time.perf_counter() - t0
            row["serve_ready_s"] = ready
            row["serve_first_token"] = ready + first_token(srv.url, None, prompt(f"serve {r}"), args.max_tokens)
        finally:
            srv.stop()
        for max_loaded in (1, 2):
            srv = ServerProc("--models-dir", str(folder), "--max-loaded-models", str(max_loaded), *common)
            try:
                if max_loaded == 1:
                    row["load_first_token"] = first_token(srv.url, "model-a", prompt(f"load {r}"), args.max_tokens)
                    row["warm_first_token"] = first_token(srv.url, "model-a", prompt(f"warm {r}"), args.max_tokens)
                for name in ("model-a", "model-b"):  # both loaded once (page cache warm): the loop times switches
                    first_token(srv.url, name, prompt(f"pre {r} {max_loaded} {name}"), args.max_tokens)
                t = time.perf_counter()
                for i in range(args.turns):
                    first_token(srv.url, "model-a" if i % 2 == 0 else "model-b", prompt(f"alt {r} {max_loaded} {i}"),
                                args.max_tokens)
                row[f"alternate_max{max_loaded}"] = time.perf_counter() - t
                row[f"loads_max{max_loaded}"] = {k: v["loads"] for k, v in
                                                 httpx.get(srv.url + "/stats").json()["models"].items()}
            finally:
                srv.stop()
        row["load_over_serve"] = row["load_first_token"] / row["serve_first_token"]
        row["switching_max1_over_max2"] = row["alternate_max1"] / row["alternate_max2"]
        print(row, flush=True)
        rounds.append(row)
    post = preflight()
    med = {k: statistics.median(r[k] for r in rounds) for k in
           ("serve_first_token", "load_first_token", "warm_first_token", "alternate_max1", "alternate_max2",
            "load_over_serve", "switching_max1_over_max2")}
    write_result({**run_record(), "preflight": pre, "preflight_end": post, "a": args.a, "b": args.b,
                  "turns": args.turns, "max_tokens": args.max_tokens, "rounds": rounds, "median": med}, args.out)
    print(med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
