"""Agent replay: K interleaved coding-agent conversations x T turns, mlx-lane vs its peers (bench/peers.py).

Every conversation = one shared system prompt + its own task. Each turn appends the assistant's
reply to the previous turn and a tool-output-sized user chunk (150-400 tokens of code / test
logs / grep output, deterministic from --seed), then asks for --max-tokens tokens at
temperature 0 (streamed, include_usage). Conversations go round-robin, so they interleave.

The servers (--servers: ours, mlx_lm, llama_cpp; see bench/peers.py) are started by this script on
free loopback ports: mlx-lane and mlx_lm.server on the same converted directory (OpenBLAS preloaded),
llama.cpp's server on the original GGUF with its prompt cache on. They are ALTERNATED PER REQUEST:
every (turn, conversation) step is sent to every server back to back, the order rotating every step;
each server keeps its own conversation history (its own replies; the script reports whether the
replies ever differed). With --restart-after-turn N every server is restarted (SIGTERM, start
again) after turn N: mlx-lane with its SSD tier on, llama.cpp with `--cache_type disk`, mlx_lm.server
with nothing to keep. Peak RSS per server (VmHWM) is read before each stop.

Measured per request: TTFT (request sent -> first non-empty content chunk), prompt tokens,
cached tokens (each server's usage.prompt_tokens_details.cached_tokens), reusable tokens
(computed here with the model's tokenizer: the longest common prefix of this prompt with any
earlier prompt, or earlier prompt + completion, sent to the same server, capped at len-1),
and total request time. The "ideal" TTFT of a request is new tokens / prefill rate, where the
prefill rate is measured in this process with raw mlx_lm (same model, OpenBLAS, 512-token
chunks) on the same conversations' new tokens at the same context offsets, interleaved with the
replay (so it sees the same machine load).

    python bench/agent_replay.py                      # K=16, T=6 (the issue's sizes), ours vs mlx_lm
    python bench/agent_replay.py --servers ours,mlx_lm,llama_cpp --restart-after-turn 3
    python bench/agent_replay.py --convs 2 --turns 2  # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import peers as peer_servers
from agent_workload import SYSTEM_PROMPT, stream_chat, user_message, workload
from common import ROOT, ensure_blas_here, git_rev, machine_facts, preflight

MODEL_DIR = Path.home() / ".cache" / "mlx-lane" / "models" / "SmolLM2-135M-Instruct"

# The conversations (SYSTEM_PROMPT, TASKS, tool_chunk) and stream_chat live in agent_workload.py, shared with
# concurrent_agents.py.

# ------------------------------------------------------------------------------------ raw prefill rate

class RawPrefill:
    """Raw mlx_lm prefill of one conversation's new tokens, on a cache that follows it."""

    def __init__(self, model, chunk: int = 512):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.chunk = chunk
        self.cache = make_prompt_cache(model)
        self.tokens: list[int] = []

    def measure(self, prompt: list[int]) -> tuple[int, float]:
        import mlx.core as mx
        from mlx_lm.models.cache import trim_prompt_cache

        lcp = _lcp(self.tokens, prompt)
        lcp = min(lcp, len(prompt) - 1)
        if lcp < len(self.tokens):
            trim_prompt_cache(self.cache, len(self.tokens) - lcp)
            self.tokens = self.tokens[:lcp]
        new = prompt[lcp:]
        t0 = time.perf_counter()
        for i in range(0, len(new), self.chunk):
            out = self.model(mx.array(new[i:i + self.chunk])[None], cache=self.cache)
            mx.eval(out, [c.state for c in self.cache])
        dt = time.perf_counter() - t0
        self.tokens = list(prompt)
        return len(new), dt


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable(prompt: list[int], history: list[list[int]]) -> int:
    best = max((_lcp(h, prompt) for h in history), default=0)
    return min(best, len(prompt) - 1)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ------------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convs", type=int, default=16, help="K interleaved conversations (default 16)")
    ap.add_argument("--turns", type=int, default=6, help="T turns per conversation (default 6)")
    ap.add_argument("--max-tokens", type=int, default=8, help="reply length per turn (default 8)")
    ap.add_argument("--chunk-min", type=int, default=150)
    ap.add_argument("--chunk-max", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-convs", type=int, default=2,
                    help="conversations whose new tokens are re-prefilled raw each turn for the rate (default 2)")
    ap.add_argument("--model-dir", default=str(MODEL_DIR))
    ap.add_argument("--servers", default="ours,mlx_lm",
                    help=f"comma list of servers to compare, ours first (from: {', '.join(peer_servers.ALL)})")
    ap.add_argument("--restart-after-turn", type=int, default=0,
                    help="restart every server after this turn (0 = never); mlx-lane then runs with its SSD tier "
                         "and llama.cpp with --cache_type disk")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_replay.json"))
    ap.add_argument("--plot", default=str(ROOT / "bench" / "agent_replay_ttft.png"))
    ap.add_argument("--from-log", help="rebuild the results from the per-request lines of an interrupted run's "
                    "stdout (only the complete turns are kept) instead of running")
    ap.add_argument("--stats-json", help="with --from-log: our /stats JSON fetched by hand before the interrupt")
    args = ap.parse_args()
    if args.from_log:
        return from_log(args)
    ensure_blas_here()

    import httpx
    from mlx_lm import load

    model_dir = Path(args.model_dir)
    model, tokenizer = load(str(model_dir))
    K, T = args.convs, args.turns
    tasks, chunks = workload(tokenizer, K, T, args.seed, args.chunk_min, args.chunk_max)

    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="agent-replay-"))
    peers = {p.name: p for p in peer_servers.make(names, workdir, persistent=args.restart_after_turn > 0)}
    t_start = time.perf_counter()
    for p in peers.values():
        p.start()
    servers = {n: p.url for n, p in peers.items()}
    restarts: dict[str, float] = {}
    failures: list[dict] = []
    pf = preflight()
    histories = {n: [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(K)] for n in names}
    seen = {n: [] for n in names}  # earlier prompt and prompt+completion token lists per server
    raws = [RawPrefill(model) for _ in range(min(args.calib_convs, K))]
    calib_convs = [round(i * K / len(raws)) for i in range(len(raws))] if raws else []
    rates: dict[int, list[float]] = {}
    records = []
    replies_differ = 0
    stats = None
    client = httpx.Client()
    try:
        # warm-up each server with a request unrelated to the replay prefixes
        for n in names:
            warm = [{"role": "user", "content": "Say hi."}]
            stream_chat(client, servers[n], warm, 2)
            seen[n].append(tokenizer.apply_chat_template(warm, add_generation_prompt=True))
        step = 0
        replay_t0 = time.perf_counter()
        for t in range(T):
            for k in range(K):
                order = names[step % len(names):] + names[:step % len(names)]
                step += 1
                texts = {}
                for n in order:
                    msgs = histories[n][k]
                    msgs.append(user_message(tasks[k], chunks[k][t], t))
                    prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
                    reuse = reusable(prompt, seen[n])
                    try:
                        r = stream_chat(client, servers[n], msgs, args.max_tokens)
                    except httpx.HTTPError as exc:
                        # a peer that fails mid-run is a result, not the end of the run: record it, restart the
                        # server if it died (its cache is gone), and retry this request once
                        alive = peers[n].pid() is not None
                        failures.append({"server": n, "conv": k, "turn": t + 1, "error": f"{type(exc).__name__}: {exc}",
                                         "process_alive": alive, "exit_code": None if alive else peers[n].exit_code()})
                        print(f"t{t + 1} c{k:02d} {n:9s} FAILED ({type(exc).__name__}: {exc}); process "
                              f"{'alive' if alive else 'dead, exit ' + str(failures[-1]['exit_code'])}", flush=True)
                        if not alive:
                            peers[n].restart()
                            servers[n] = peers[n].url
                        r = stream_chat(client, servers[n], msgs, args.max_tokens)
                    usage = r["usage"]
                    msgs.append({"role": "assistant", "content": r["text"]})
                    # the completion's token ids as the next prompt will carry them (the templated reply,
                    # cut to the number of tokens the server generated)
                    n_gen = usage.get("completion_tokens") or args.max_tokens
                    with_reply = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
                    completion = with_reply[len(prompt):len(prompt) + n_gen] if with_reply[:len(prompt)] == prompt else []
                    seen[n].append(list(prompt))
                    seen[n].append(list(prompt) + list(completion))
                    texts[n] = r["text"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    rec = {"server": n, "conv": k, "turn": t + 1, "step": step, "ttft_s": round(r["ttft"], 4),
                           "after_restart": args.restart_after_turn > 0 and t + 1 == args.restart_after_turn + 1,
                           "total_s": round(r["total"], 4), "prompt_tokens": len(prompt),
                           "server_prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached,
                           "reusable_tokens": reuse, "new_tokens": len(prompt) - reuse}
                    records.append(rec)
                    print(f"t{t + 1} c{k:02d} {n:9s} prompt {len(prompt):5d} reusable {reuse:5d} "
                          f"cached {cached!s:>5} ttft {r['ttft']:7.2f}s total {r['total']:7.2f}s", flush=True)
                if len(set(texts.values())) > 1:
                    replies_differ += 1
                if k in calib_convs:
                    # same conversation's new tokens, raw, at the same offset (ours' history)
                    raw = raws[calib_convs.index(k)]
                    prompt = tokenizer.apply_chat_template(histories[names[0]][k][:-1], add_generation_prompt=True)
                    n_new, dt = raw.measure(prompt)
                    rates.setdefault(t + 1, []).append(n_new / dt)
                    print(f"t{t + 1} c{k:02d} raw       new {n_new:5d} prefill {dt:7.2f}s = {n_new / dt:6.1f} tok/s",
                          flush=True)
            if t + 1 == args.restart_after_turn and t + 1 < T:
                for n in names:
                    restarts[n] = round(peers[n].restart(), 2)
                    servers[n] = peers[n].url
                    print(f"restart {n}: ready again in {restarts[n]:.1f}s", flush=True)
        replay_wall = time.perf_counter() - replay_t0
        if "ours" in servers:
            stats = client.get(servers["ours"] + "/stats", timeout=30).json()
    finally:
        client.close()
        for p in peers.values():
            p.stop()

    summary, ratios = summarize(records, rates, names, T)
    result = {
        "command": "python bench/" + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_rev": git_rev(),
        "machine": machine_facts(),
        "load_avg_end": os.getloadavg(),
        "preflight": pf,
        "preflight_end": preflight(),
        "config": {"convs": K, "turns": T, "max_tokens": args.max_tokens, "chunk_tokens": [args.chunk_min, args.chunk_max],
                   "seed": args.seed, "system_prompt_tokens": len(tokenizer.encode(SYSTEM_PROMPT)),
                   "servers": {n: peers[n].label for n in names},
                   "restart_after_turn": args.restart_after_turn,
                   "alternation": "per request: each (turn, conversation) step goes to every server back to back, "
                                  "order rotated every step"},
        "restart_ready_s": restarts,
        "failures": failures,
        "peak_rss_mib": {n: round(p.peak_rss_mib, 1) if p.peak_rss_mib else None for n, p in peers.items()},
        "raw_prefill_tok_s_by_turn": {t: [round(x, 1) for x in v] for t, v in rates.items()},
        "replay_wall_s": round(replay_wall, 1),
        "script_wall_s": round(time.perf_counter() - t_start, 1),
        "replies_differ_steps": replies_differ,
        "summary": summary,
        "ratios": ratios,
        "ours_stats_prompt_cache": (stats or {}).get("prompt_cache"),
        "ours_stats_lane": (stats or {}).get("lane"),
        "records": records,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=2))
    print(f"wrote {out}")
    try:
        plot(records, names, K, Path(args.plot), args.restart_after_turn)
        print(f"wrote {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot")


_LINE = re.compile(r"t(\d+) c(\d+) (ours|mlx_lm|llama_cpp)\s+prompt\s+(\d+) reusable\s+(\d+) cached\s+(\S+) "
                   r"ttft\s+([\d.]+)s total\s+([\d.]+)s")
_RAW = re.compile(r"t(\d+) c(\d+) raw\s+new\s+(\d+) prefill\s+([\d.]+)s")


def from_log(args) -> None:
    records, rates = [], {}
    for line in Path(args.from_log).read_text().splitlines():
        m = _LINE.match(line)
        if m:
            t, k, n, prompt, reuse, cached, ttft, total = m.groups()
            records.append({"server": n, "conv": int(k), "turn": int(t), "step": None,
                            "ttft_s": float(ttft), "total_s": float(total), "prompt_tokens": int(prompt),
                            "server_prompt_tokens": None, "cached_tokens": None if cached == "None" else int(cached),
                            "reusable_tokens": int(reuse), "new_tokens": int(prompt) - int(reuse)})
        m = _RAW.match(line)
        if m:
            t, _k, n_new, dt = m.groups()
            rates.setdefault(int(t), []).append(int(n_new) / float(dt))
    names = [n for n in peer_servers.ALL if any(r["server"] == n for r in records)]
    K = max(r["conv"] for r in records) + 1
    complete = [t for t in sorted({r["turn"] for r in records})
                if all(sum(1 for r in records if r["turn"] == t and r["server"] == n) == K for n in names)]
    records = [r for r in records if r["turn"] in complete]
    T = len(complete)
    summary, ratios = summarize(records, rates, names, T)
    stats = json.loads(Path(args.stats_json).read_text()) if args.stats_json else {}
    result = {
        "command": f"python bench/agent_replay.py (interrupted after {T} complete turns; rebuilt with --from-log)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_rev": git_rev(),
        "config": {"convs": K, "turns_complete": T, "max_tokens": args.max_tokens,
                   "chunk_tokens": [args.chunk_min, args.chunk_max], "seed": args.seed,
                   "alternation": "per request: each (turn, conversation) step goes to both servers back to back, "
                                  "order flipped every step"},
        "raw_prefill_tok_s_by_turn": {t: [round(x, 1) for x in v] for t, v in rates.items() if t in complete},
        "summary": summary,
        "ratios": ratios,
        "ours_stats_prompt_cache": stats.get("prompt_cache"),
        "ours_stats_lane": stats.get("lane"),
        "records": records,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=2))
    try:
        plot(records, names, K, Path(args.plot))
        print(f"wrote {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot")


def summarize(records: list[dict], rates: dict, names: list[str], T: int) -> tuple[dict, dict]:
    for rec in records:
        rate = statistics.median(rates[rec["turn"]]) if rates.get(rec["turn"]) else None
        rec["ideal_s"] = round(rec["new_tokens"] / rate, 4) if rate else None
    summary = {}
    for n in names:
        rs = [r for r in records if r["server"] == n]
        ttft = [r["ttft_s"] for r in rs]
        cached = sum(r["cached_tokens"] or 0 for r in rs)
        reuse = sum(r["reusable_tokens"] for r in rs)
        ideal = [r["ideal_s"] for r in rs if r["ideal_s"] is not None]
        summary[n] = {
            "requests": len(rs),
            "ttft_mean_s": round(statistics.mean(ttft), 3),
            "ttft_median_s": round(statistics.median(ttft), 3),
            "ttft_p95_s": round(pct(ttft, 0.95), 3),
            "ttft_min_s": round(min(ttft), 3),
            "ttft_max_s": round(max(ttft), 3),
            "ttft_mean_turn1_s": round(statistics.mean(r["ttft_s"] for r in rs if r["turn"] == 1), 3),
            "ttft_mean_later_turns_s": (round(statistics.mean(r["ttft_s"] for r in rs if r["turn"] > 1), 3)
                                        if T > 1 else None),
            "total_request_time_s": round(sum(r["total_s"] for r in rs), 1),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rs),
            "cached_tokens": cached,
            "reusable_tokens": reuse,
            "cache_efficiency": round(cached / reuse, 4) if reuse else None,
            "mean_ttft_over_ideal": round(statistics.mean(ttft) / statistics.mean(ideal), 3) if ideal else None,
            "prompt_token_mismatches": sum(1 for r in rs if r["server_prompt_tokens"] not in (None, r["prompt_tokens"])),
        }
        after = [r["ttft_s"] for r in rs if r.get("after_restart")]
        if after:
            summary[n]["ttft_mean_after_restart_s"] = round(statistics.mean(after), 3)
            summary[n]["ttft_p95_after_restart_s"] = round(pct(after, 0.95), 3)
    ratios = {}
    if "ours" in names:
        ours_r = {(r["conv"], r["turn"]): r for r in records if r["server"] == "ours"}
        for peer in (n for n in names if n != "ours"):
            peer_r = {(r["conv"], r["turn"]): r for r in records if r["server"] == peer}
            keys = [key for key in ours_r if key in peer_r]
            per_step = [ours_r[key]["ttft_s"] / peer_r[key]["ttft_s"] for key in keys]
            later = [ours_r[key]["ttft_s"] / peer_r[key]["ttft_s"] for key in keys if key[1] > 1]
            so, sp = summary["ours"], summary[peer]
            ratios[peer] = {
                "mean_ttft_ours_over_peer": round(so["ttft_mean_s"] / sp["ttft_mean_s"], 3),
                "p95_ttft_ours_over_peer": round(so["ttft_p95_s"] / sp["ttft_p95_s"], 3),
                "per_request_ratio_median": round(statistics.median(per_step), 3),
                "per_request_ratio_min": round(min(per_step), 3),
                "per_request_ratio_max": round(max(per_step), 3),
                "per_request_ratio_later_turns_median": round(statistics.median(later), 3) if later else None,
                "total_time_ours_over_peer": round(so["total_request_time_s"] / sp["total_request_time_s"], 3),
            }
            if so.get("ttft_mean_after_restart_s") and sp.get("ttft_mean_after_restart_s"):
                ratios[peer]["after_restart_mean_ttft_ours_over_peer"] = round(
                    so["ttft_mean_after_restart_s"] / sp["ttft_mean_after_restart_s"], 3)
    return summary, ratios


def plot(records, names, K, path: Path, restart_after: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"ours": "tab:blue", "mlx_lm": "tab:orange", "llama_cpp": "tab:green"}
    labels = {"ours": "mlx-lane", "mlx_lm": "mlx_lm.server", "llama_cpp": "llama.cpp server (Q4_1 GGUF)"}
    for n in names:
        rs = sorted((r for r in records if r["server"] == n), key=lambda r: (r["turn"], r["conv"]))
        a1.plot(range(len(rs)), [r["ttft_s"] for r in rs], ".-", lw=0.6, color=colors[n], label=labels[n])
        turns = sorted({r["turn"] for r in rs})
        means = [statistics.mean(r["ttft_s"] for r in rs if r["turn"] == t) for t in turns]
        a2.plot(turns, means, "o-", color=colors[n], label=labels[n])
    ideal = sorted((r for r in records if r["server"] == names[0] and r["ideal_s"] is not None),
                   key=lambda r: (r["turn"], r["conv"]))
    if ideal and "ours" in names:
        turns = sorted({r["turn"] for r in ideal})
        a2.plot(turns, [statistics.mean(r["ideal_s"] for r in ideal if r["turn"] == t) for t in turns],
                "k--", label="ideal (new tokens / raw prefill rate)")
    for t in range(1, max(r["turn"] for r in records)):
        a1.axvline(t * K - 0.5, color="grey", lw=0.4)
    if restart_after:
        a1.axvline(restart_after * K - 0.5, color="red", lw=1.2, ls="--", label="restart of every server")
        a2.axvline(restart_after + 0.5, color="red", lw=1.2, ls="--", label="restart")
    a1.set_xlabel(f"request (turn-major, {K} conversations per turn)")
    a1.set_ylabel("TTFT (s)")
    a1.set_title("TTFT per request")
    a2.set_xlabel("turn")
    a2.set_ylabel("mean TTFT (s)")
    a2.set_title("mean TTFT per turn")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle("agent replay, SmolLM2-135M-Instruct (fp32 for MLX servers), 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
