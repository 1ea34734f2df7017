"""Serving overhead per streamed token: CPU time of the server's threads per generated token, this checkout vs a
baseline checkout, with N concurrent streams on a tiny random model (model compute is small, so the HTTP / SSE /
lane bookkeeping that a GPU run pays per token per stream is what shows).

Both servers run the same tiny random llama (bench/gpu.py's "tiny" shape, float32, built once under .bench/) with
the same flags; every round sends N streamed /v1/completions at once (EOS banned, greedy, --tokens each) to one
server, then the other (order rotated). Measured per round, from /proc/PID/task/*/stat: CPU seconds of the event
loop's thread (the main thread: HTTP, SSE framing, socket writes), of the lane thread (`mlx-lane`: scheduling,
detokenizing, the batched step's Python) and of all the rest (MLX's and OpenBLAS's worker threads), each over the
tokens generated; plus aggregate tok/s and the number of SSE chunks that carried text.

    python bench/stream_overhead.py --baseline-tree /tmp/base [--streams 16] [--tokens 128] [--rounds 3]

--baseline-tree is another checkout of this repository (e.g. `git worktree add /tmp/base <rev>`); its `server`
package is what the baseline server runs (same venv).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, ServerProc, ensure_blas_here, preflight, run_record, spread, sse_chunks, write_result  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds by thread group: "loop" (the main thread), "lane", "other"."""
    out = {"loop": 0.0, "lane": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        key = "loop" if int(task.name) == pid else "lane" if name == "mlx-lane" else "other"
        out[key] += cpu
    return out


def one_round(url: str, pid: int, prompts: list[str], tokens: int, bias: dict) -> dict:
    import httpx

    results: list = [None] * len(prompts)

    def stream(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "logit_bias": bias}
        chunks, usage = 0, None
        with httpx.Client(timeout=600) as client:
            for _, chunk in sse_chunks(client, url + "/v1/completions", body):
                usage = chunk.get("usage") or usage
                chunks += any(ch.get("text") for ch in chunk.get("choices") or [])
        results[i] = (usage["completion_tokens"], chunks)

    cpu0, t0 = thread_cpu(pid), time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall, cpu1 = time.perf_counter() - t0, thread_cpu(pid)
    if any(r is None for r in results):
        raise RuntimeError("a stream failed")
    n = sum(r[0] for r in results)
    per_tok = {k: round((cpu1[k] - cpu0[k]) / n * 1e3, 4) for k in cpu0}
    return {"tokens": n, "chunks": sum(r[1] for r in results), "wall_s": round(wall, 3), "tok_s": round(n / wall, 2),
            "cpu_ms_per_token": per_tok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-tree", required=True, help="another checkout whose server package is the baseline")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stream_overhead.json"))
    args = ap.parse_args()
    ensure_blas_here()

    import gpu
    from mlx_lm.utils import load_tokenizer

    from models import ensure_default_model

    tok_dir = Path(ensure_default_model(progress=False))
    model_dir = ROOT / ".bench" / "mlx-lane-bench-model-tiny"
    if not (model_dir / "config.json").is_file():
        gpu.build_model(model_dir, "tiny", "float32", tok_dir)
    bias = {str(e): -100 for e in gpu.eos_ids(model_dir)}
    tokenizer = load_tokenizer(model_dir)
    words = [w for w in ("alpha beta gamma delta river stone cloud paper light music garden window").split()]
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(48)) + f" {i}" for i in range(args.streams)]
    prompt_tokens = [len(tokenizer.encode(p)) for p in prompts]

    flags = ("--model", str(model_dir), "--dtype", "float32", "--max-batch", str(max(32, args.streams)),
             "--cache-bytes", "512M", "--log-level", "warning")
    trees = {"this": ROOT, "baseline": Path(args.baseline_tree).resolve()}
    servers = {name: ServerProc(*flags, cwd=tree) for name, tree in trees.items()}
    rows: dict[str, list] = {name: [] for name in servers}
    try:
        for name, s in servers.items():  # warm-up: shapes, kernels
            one_round(s.url, s.proc.pid, prompts[:4], 8, bias)
        pf = preflight()
        names = list(servers)
        for i in range(args.rounds):
            for name in names[i % 2:] + names[:i % 2]:
                s = servers[name]
                r = one_round(s.url, s.proc.pid, prompts, args.tokens, bias)
                rows[name].append(r)
                print(f"round {i} {name:8s} {r['tok_s']:7.1f} tok/s  chunks {r['chunks']}/{r['tokens']}  "
                      f"cpu ms/token {r['cpu_ms_per_token']}", flush=True)
        pf_end = preflight()
    finally:
        for s in servers.values():
            s.stop()

    summary = {name: {"tok_s": spread([r["tok_s"] for r in v]),
                      "chunks_per_token": spread([round(r["chunks"] / r["tokens"], 3) for r in v]),
                      **{f"cpu_ms_per_token_{k}": spread([r["cpu_ms_per_token"][k] for r in v])
                         for k in ("loop", "lane", "other")}} for name, v in rows.items()}
    ratios = {k: round(summary["this"][k]["median"] / summary["baseline"][k]["median"], 3)
              for k in ("tok_s", "cpu_ms_per_token_loop", "cpu_ms_per_token_lane")
              if summary["baseline"][k]["median"]}
    result = {**run_record(), "note": args.note, "preflight": pf, "preflight_end": pf_end,
              "config": {"streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
                         "prompt_tokens": prompt_tokens, "server_flags": list(flags),
                         "baseline_tree": str(trees["baseline"]),
                         "baseline_rev": _rev(trees["baseline"])},
              "summary": summary, "this_over_baseline": ratios}
    write_result(result, args.out)
    print("this / baseline:", ratios)


def _rev(tree: Path) -> str:
    import subprocess

    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=tree, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
