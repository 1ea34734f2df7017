"""Concurrent agents (issue 12): K coding agents x T turns each, all at once, back to back; mlx-lane vs its peers.

Each agent is a thread with its own HTTP client: its next turn starts as soon as its previous reply has finished.
All K start together, their first requests --stagger-ms apart (mlx_lm.server listens with a backlog of 5), so up
to K requests are in flight - unlike agent_replay.py, which sends one request at a time. The conversations are
agent_workload.py's (shared system prompt, a task, tool-output chunks of --chunk-min..--chunk-max tokens), the same
for every server (same --seed; K agents = the first K conversations); each server keeps its own histories (its own
replies). Every turn asks for --max-tokens tokens, greedy (temperature 0), streamed with include_usage.

Servers (--servers; bench/peers.py) run ONE AFTER THE OTHER on that workload, each started fresh for every (round,
K) so no cache carries over from another run, in an order rotated over rounds and K values:
  ours       `mlx-lane serve` (+ --ours-args)
  mlx_lm     mlx_lm.server with its continuous batching: --decode-concurrency / --prompt-concurrency (its defaults,
             32 / 8) and --prompt-cache-size max(10, 2K) so its LRU of conversations is not what limits it
  llama_cpp  llama-cpp-python's server. It has NO parallel slots (no n_parallel setting: one request at a time
             behind a lock), and is started with --interrupt_requests false: its default ends a running stream as
             soon as another request waits, which would cut the replies short here.
Each server first answers one warm-up request unrelated to the workload.

Measured per server, K and round: wall time (first request sent -> last reply finished), TTFT of every request (its
send -> first non-empty content chunk; mean and p95), aggregate generated tok/s (sum of usage.completion_tokens /
wall), cached prompt tokens (sum of usage.prompt_tokens_details.cached_tokens), requests failed (an HTTP error: the
agent retries that turn once and stops when the retry fails too), and whether each reply equals ours (same round,
K, agent, turn). Summaries are median (min-max) over rounds; ratios ours/peer are of the medians at each K. For ours,
/stats' lane block before and after every run. Issue 12's target at K=8, T=3, 64 tokens: ours' wall <= 0.8x
mlx_lm.server's and mean TTFT <= 0.7x (printed as met / missed).

    python bench/concurrent_agents.py                                   # ours,mlx_lm; K 1,4,8,16; T 3; 64 tokens
    python bench/concurrent_agents.py --servers ours,mlx_lm,llama_cpp --rounds 2
    python bench/concurrent_agents.py --servers ours,mlx_lm --k 2 --turns 1 --max-tokens 8 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import statistics
import tempfile
import threading
import time
from pathlib import Path

import peers as peer_servers
from agent_workload import SYSTEM_PROMPT, stream_chat, user_message, workload
from common import ROOT, preflight, run_record, spread, write_result

TARGET = {"k": 8, "turns": 3, "max_tokens": 64, "wall": 0.8, "ttft_mean": 0.7}  # issue 12, ours / mlx_lm.server


def pct(values: list[float], q: float) -> float:
    """Linear-interpolated quantile q of values (agent_replay.py's rule)."""
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------------------- one run

PROBE = [{"role": "system", "content": SYSTEM_PROMPT},
         {"role": "user", "content": "Reply with the word ok and nothing else."}]


def run_probe(url: str, every_s: float, stop: threading.Event, out: list[dict]) -> None:
    """Issue 22 item 7's yardstick: while the agents run, every ``every_s`` one request whose prompt the server
    has cached whole (PROBE, sent once at warm-up), 2 tokens: its TTFT under load is what a fully cached turn waits.
    Appends {"sent", "ttft_s", "cached_tokens", "prompt_tokens"} to ``out``."""
    import httpx

    with httpx.Client() as client:
        while not stop.wait(every_s):
            sent = time.perf_counter()
            try:
                r = stream_chat(client, url, PROBE, 2)
            except Exception as exc:  # a failed probe is recorded, the agents go on
                out.append({"sent": sent, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            usage = r["usage"]
            out.append({"sent": sent, "ttft_s": round(r["ttft"], 4), "prompt_tokens": usage.get("prompt_tokens"),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})


def run_agents(url: str, tasks: list[str], chunks: list[list[str]], K: int, T: int, max_tokens: int,
               stagger_s: float, system: str = SYSTEM_PROMPT, probe_every_s: float = 0.0,
               probes: list | None = None) -> tuple[list[dict], float]:
    """K agent threads x T turns against `url`, every conversation opening with `system`; (one record per request
    sent, wall seconds). ``probe_every_s`` > 0: a fully cached probe request that often meanwhile (run_probe),
    its records appended to ``probes`` (not counted in the agents' records or wall)."""
    import httpx

    stop_probe = threading.Event()
    prober = None
    if probe_every_s > 0:
        prober = threading.Thread(target=run_probe, args=(url, probe_every_s, stop_probe,
                                                          probes if probes is not None else []), name="probe")
        prober.start()
    records: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(K)

    def agent(k: int) -> None:
        msgs = [{"role": "system", "content": system}]
        with httpx.Client() as client:
            start.wait()
            time.sleep(k * stagger_s)
            for t in range(T):
                msgs.append(user_message(tasks[k], chunks[k][t], t))
                for attempt in (1, 2):
                    sent = time.perf_counter()
                    rec = {"agent": k, "turn": t + 1, "attempt": attempt, "sent": sent}
                    try:
                        r = stream_chat(client, url, msgs, max_tokens)
                    except Exception as exc:  # HTTP or a malformed stream: a failed request, never a dead thread
                        rec.update(ok=False, end=time.perf_counter(), error=f"{type(exc).__name__}: {exc}"[:300])
                        with lock:
                            records.append(rec)
                        continue
                    usage = r["usage"]
                    rec.update(ok=True, end=sent + r["total"], ttft_s=round(r["ttft"], 4), total_s=round(r["total"], 4),
                               prompt_tokens=usage.get("prompt_tokens"),
                               completion_tokens=usage.get("completion_tokens"),
                               cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                               text_sha1=hashlib.sha1(r["text"].encode()).hexdigest()[:12])
                    with lock:
                        records.append(rec)
                    msgs.append({"role": "assistant", "content": r["text"]})
                    break
                else:
                    return  # the retry failed too: this agent stops (its remaining turns are not sent)

    threads = [threading.Thread(target=agent, args=(k,), name=f"agent-{k}") for k in range(K)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if prober is not None:
        stop_probe.set()
        prober.join()
    t0 = min(r["sent"] for r in records)
    for p in probes or []:
        p["sent"] = round(p["sent"] - t0, 4)
    wall = max(r["end"] for r in records) - t0
    for r in records:  # seconds since the run's first request, instead of perf_counter stamps
        r["sent"], r["end"] = round(r["sent"] - t0, 4), round(r["end"] - t0, 4)
    records.sort(key=lambda r: (r["agent"], r["turn"], r["attempt"]))
    return records, wall


def run_metrics(records: list[dict], wall: float, K: int, T: int) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    gen = sum(r.get("completion_tokens") or 0 for r in ok)
    return {"wall_s": round(wall, 3), "requests_ok": len(ok), "requests_failed": len(records) - len(ok),
            "turns_not_sent": K * T - len(ok),
            "ttft_mean_s": round(statistics.mean(ttft), 4) if ttft else None,
            "ttft_p95_s": round(pct(ttft, 0.95), 4) if ttft else None,
            "completion_tokens": gen, "tok_s": round(gen / wall, 3) if wall > 0 else None,
            "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok)}


def probe_metrics(probes: list[dict], before: dict | None, after: dict | None) -> dict:
    """The probe's TTFTs under load, and for ours the mean batched decode step over the run (/stats: seconds in
    ``batch_step`` over the ticks that stepped a batch): item 7's target is TTFT <= 3 such steps."""
    ok = [p["ttft_s"] for p in probes if "ttft_s" in p]
    m = {"probes": len(probes), "probe_failed": len(probes) - len(ok),
         "probe_ttft_mean_s": round(statistics.mean(ok), 4) if ok else None,
         "probe_ttft_median_s": round(statistics.median(ok), 4) if ok else None,
         "probe_ttft_max_s": round(max(ok), 4) if ok else None,
         "probe_cached_of_prompt": [[p.get("cached_tokens"), p.get("prompt_tokens")] for p in probes[:3]]}
    if before and after:
        steps = (sum((after.get("batch_size") or {}).get("histogram", {}).values())
                 - sum((before.get("batch_size") or {}).get("histogram", {}).values()))
        secs = ((after.get("tick_seconds") or {}).get("batch_step", 0.0)
                - (before.get("tick_seconds") or {}).get("batch_step", 0.0))
        if steps > 0 and secs > 0:
            step = secs / steps
            m["batch_step_mean_s"] = round(step, 4)
            if ok:
                m["probe_ttft_mean_over_step"] = round(statistics.mean(ok) / step, 2)
                m["probe_ttft_median_over_step"] = round(statistics.median(ok) / step, 2)
    return m


def lane_block(url: str) -> dict | None:
    import httpx

    try:
        return httpx.get(url + "/stats", timeout=30).json().get("lane")
    except (httpx.HTTPError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------------ summary

def summarize(runs: list[dict], names: list[str], ks: list[int]) -> tuple[dict, dict]:
    """(summary[K][server], ratios[K][peer]) from the per-run records of main()."""
    summary: dict = {}
    for K in ks:
        for n in names:
            rs = [r for r in runs if r["k"] == K and r["server"] == n and r.get("metrics")]
            if not rs:
                continue
            m = [r["metrics"] for r in rs]
            s = {key: spread([x[key] for x in m]) for key in ("wall_s", "ttft_mean_s", "ttft_p95_s", "tok_s")
                 if all(x[key] is not None for x in m)}
            s.update(rounds=len(rs), cached_tokens=[x["cached_tokens"] for x in m],
                     prompt_tokens=[x["prompt_tokens"] for x in m],
                     requests_failed=sum(x["requests_failed"] for x in m),
                     turns_not_sent=sum(x["turns_not_sent"] for x in m))
            same = [r["replies_equal_ours"] for r in rs if r.get("replies_equal_ours") is not None]
            if same and n != "ours":
                s["replies_equal_ours"] = round(statistics.mean(same), 3)
            summary.setdefault(str(K), {})[n] = s
    ratios: dict = {}
    for K, per in summary.items():
        o = per.get("ours")
        for p, s in per.items():
            if p == "ours" or not o:
                continue
            r = {}
            for key, name in (("wall_s", "wall"), ("ttft_mean_s", "ttft_mean"), ("tok_s", "tok_s")):
                if key in o and key in s and s[key]["median"]:
                    r[f"{name}_ours_over_peer"] = round(o[key]["median"] / s[key]["median"], 3)
            per_round = [(a["metrics"]["wall_s"] / b["metrics"]["wall_s"]) for a in runs for b in runs
                         if a["k"] == b["k"] == int(K) and a["round"] == b["round"] and a["server"] == "ours"
                         and b["server"] == p and a.get("metrics") and b.get("metrics")]
            r["wall_ours_over_peer_per_round"] = [round(x, 3) for x in per_round]
            ratios.setdefault(K, {})[p] = r
    return summary, ratios


def target_verdict(ratios: dict, args) -> dict:
    """Issue 12's target: at K=8 ours/mlx_lm wall <= 0.8 and mean TTFT <= 0.7 (None where not measured)."""
    r = (ratios.get(str(TARGET["k"])) or {}).get("mlx_lm") or {}
    wall, ttft = r.get("wall_ours_over_peer"), r.get("ttft_mean_ours_over_peer")
    v = {"k": TARGET["k"], "wall_ratio": wall, "wall_target": TARGET["wall"], "ttft_mean_ratio": ttft,
         "ttft_mean_target": TARGET["ttft_mean"],
         "met": (wall <= TARGET["wall"] and ttft <= TARGET["ttft_mean"]) if wall and ttft else None,
         "conditions_as_issue": args.turns == TARGET["turns"] and args.max_tokens == TARGET["max_tokens"]}
    return v


def print_table(summary: dict, ratios: dict, verdict: dict) -> None:
    def mr(x, nd=2):
        return f"{x['median']:.{nd}f} ({x['min']:.{nd}f}-{x['max']:.{nd}f})" if x else "-"
    print(f"\n{'K':>3} {'server':14} {'wall s':>22} {'mean TTFT s':>22} {'p95 TTFT s':>22} {'tok/s':>20} "
          f"{'cached':>8} {'failed':>6} {'wall o/p':>8} {'TTFT o/p':>8}")
    for K, per in summary.items():
        for n, s in per.items():
            r = (ratios.get(K) or {}).get(n) or {}
            print(f"{K:>3} {n:14} {mr(s.get('wall_s')):>22} {mr(s.get('ttft_mean_s'), 3):>22} "
                  f"{mr(s.get('ttft_p95_s'), 3):>22} {mr(s.get('tok_s')):>20} "
                  f"{statistics.median(s['cached_tokens']):>8.0f} {s['requests_failed']:>6} "
                  f"{r.get('wall_ours_over_peer', ''):>8} {r.get('ttft_mean_ours_over_peer', ''):>8}")
    if verdict["met"] is None:
        print(f"\ntarget (K={verdict['k']}: ours/mlx_lm wall <= {verdict['wall_target']}, mean TTFT <= "
              f"{verdict['ttft_mean_target']}): not measured (needs K={verdict['k']} with ours and mlx_lm)")
    else:
        cond = "" if verdict["conditions_as_issue"] else " (NOT the issue's T=3, 64 tokens)"
        print(f"\ntarget at K={verdict['k']}{cond}: wall ours/mlx_lm {verdict['wall_ratio']} (<= "
              f"{verdict['wall_target']}), mean TTFT {verdict['ttft_mean_ratio']} (<= {verdict['ttft_mean_target']})"
              f": {'MET' if verdict['met'] else 'MISSED'}")


# --------------------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours,mlx_lm", help=f"comma list (from: {', '.join(peer_servers.ALL)})")
    ap.add_argument("--k", default="1,4,8,16", help="comma list of agent counts (default 1,4,8,16)")
    ap.add_argument("--turns", type=int, default=3, help="turns per agent (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64, help="reply length per turn (default 64)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; server order rotates every round and K")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-min", type=int, default=150)
    ap.add_argument("--chunk-max", type=int, default=400)
    ap.add_argument("--stagger-ms", type=float, default=5.0, help="gap between the agents' first requests")
    ap.add_argument("--mlx-lm-decode-concurrency", type=int, default=32)
    ap.add_argument("--mlx-lm-prompt-concurrency", type=int, default=8)
    ap.add_argument("--mlx-lm-cache-size", type=int, default=0,
                    help="mlx_lm.server --prompt-cache-size (0: max(10, 2K), so every conversation fits)")
    ap.add_argument("--probe-every-ms", type=float, default=0.0,
                    help="also send a fully cached 2-token request this often while the agents run, and report "
                         "its TTFT against the lane's batched decode step (issue 22 item 7); 0: no probe")
    ap.add_argument("--ours-args", default="", help="extra `mlx-lane serve` arguments (one shell-quoted string)")
    ap.add_argument("--mlx-lm-args", default="", help="extra mlx_lm.server arguments")
    ap.add_argument("--llama-cpp-args", default="", help="extra llama_cpp.server arguments")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "concurrent_agents.json"))
    args = ap.parse_args()
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    ks = [int(x) for x in args.k.split(",") if x.strip()]
    T = args.turns

    import httpx
    from mlx_lm.utils import load_tokenizer

    model_dir = peer_servers.default_paths()[0]
    tokenizer = load_tokenizer(Path(model_dir))
    tasks, chunks = workload(tokenizer, max(ks), T, args.seed, args.chunk_min, args.chunk_max)
    base_extra = {"ours": tuple(shlex.split(args.ours_args)), "mlx_lm": tuple(shlex.split(args.mlx_lm_args)),
                  "llama_cpp": ("--interrupt_requests", "false", *shlex.split(args.llama_cpp_args))}
    workdir = Path(tempfile.mkdtemp(prefix="concurrent-agents-"))
    peers = {p.name: p for p in peer_servers.make(names, workdir, extra=base_extra)}
    pf = preflight()
    runs: list[dict] = []
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        for ki, K in enumerate(ks):
            shift = (rnd + ki) % len(names)
            for n in names[shift:] + names[:shift]:
                peer = peers[n]
                if n == "mlx_lm":
                    size = args.mlx_lm_cache_size or max(10, 2 * K)
                    peer.extra = ("--decode-concurrency", str(args.mlx_lm_decode_concurrency), "--prompt-concurrency",
                                  str(args.mlx_lm_prompt_concurrency), "--prompt-cache-size", str(size),
                                  *base_extra["mlx_lm"])
                run = {"round": rnd + 1, "k": K, "server": n, "server_args": list(getattr(peer, "extra", ()))}
                try:
                    peer.start()
                    with httpx.Client() as c:
                        stream_chat(c, peer.url, [{"role": "user", "content": "Say hi."}], 2)  # warm-up
                        if args.probe_every_ms > 0:
                            stream_chat(c, peer.url, PROBE, 2)  # the probe's prompt, cached from now on
                    if n == "ours":
                        run["lane_before"] = lane_block(peer.url)
                    probes: list[dict] = []
                    records, wall = run_agents(peer.url, tasks, chunks, K, T, args.max_tokens, args.stagger_ms / 1e3,
                                               probe_every_s=args.probe_every_ms / 1e3, probes=probes)
                    if n == "ours":
                        run["lane_after"] = lane_block(peer.url)
                    run["metrics"] = run_metrics(records, wall, K, T)
                    if args.probe_every_ms > 0:
                        run["probe"] = probe_metrics(probes, run.get("lane_before"), run.get("lane_after"))
                        run["probe_records"] = probes
                    run["records"] = records
                except Exception as exc:  # a server that cannot start or run is a result, not the end of the run
                    run["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    print(f"round {rnd + 1} K={K} {n}: FAILED: {run['error']}", flush=True)
                finally:
                    run["exit_code"] = peer.stop() if peer.pid() is not None else peer.exit_code()
                    run["peak_rss_mib"] = round(peer.peak_rss_mib, 1) if peer.peak_rss_mib else None
                runs.append(run)
                m = run.get("metrics")
                if m:
                    print(f"round {rnd + 1} K={K:<2} {n:9s} wall {m['wall_s']:7.2f}s  mean TTFT "
                          f"{m['ttft_mean_s'] if m['ttft_mean_s'] is not None else float('nan'):6.3f}s  "
                          f"p95 {m['ttft_p95_s'] if m['ttft_p95_s'] is not None else float('nan'):6.3f}s  "
                          f"{m['tok_s']:6.2f} tok/s  cached {m['cached_tokens']:6d}  failed {m['requests_failed']}",
                          flush=True)
                    if run.get("probe"):
                        print(f"    probe: {run['probe']}", flush=True)
            ours = next((r for r in runs if r["round"] == rnd + 1 and r["k"] == K and r["server"] == "ours"
                         and r.get("records")), None)
            for r in runs:  # replies equal to ours at the same (round, K, agent, turn)
                if ours and r["round"] == rnd + 1 and r["k"] == K and r.get("records") and r["server"] != "ours":
                    mine = {(x["agent"], x["turn"]): x.get("text_sha1") for x in ours["records"] if x["ok"]}
                    pairs = [(mine.get((x["agent"], x["turn"])), x["text_sha1"]) for x in r["records"] if x["ok"]]
                    pairs = [(a, b) for a, b in pairs if a]
                    r["replies_equal_ours"] = round(sum(a == b for a, b in pairs) / len(pairs), 3) if pairs else None
    summary, ratios = summarize(runs, names, ks)
    verdict = target_verdict(ratios, args)
    result = {
        **run_record(),
        "preflight": pf,
        "preflight_end": preflight(),
        "config": {"servers": {n: peers[n].label for n in names}, "k": ks, "turns": T, "max_tokens": args.max_tokens,
                   "rounds": args.rounds, "seed": args.seed, "chunk_tokens": [args.chunk_min, args.chunk_max],
                   "stagger_ms": args.stagger_ms, "system_prompt_tokens": len(tokenizer.encode(SYSTEM_PROMPT)),
                   "mlx_lm_decode_concurrency": args.mlx_lm_decode_concurrency,
                   "mlx_lm_prompt_concurrency": args.mlx_lm_prompt_concurrency,
                   "llama_cpp_parallel": "none: llama-cpp-python's server has no parallel slots (one request at a "
                                         "time behind a lock); run with --interrupt_requests false",
                   "order": "servers one after the other per (round, K), each started fresh; order rotated by "
                            "round + K index"},
        "script_wall_s": round(time.perf_counter() - t_start, 1),
        "summary": summary,
        "ratios": ratios,
        "target": verdict,
        "runs": runs,
    }
    write_result(result, args.out)
    print_table(summary, ratios, verdict)


if __name__ == "__main__":
    main()
