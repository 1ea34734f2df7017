"""Replicas behind HAProxy (issue 15, part 1): session affinity vs round-robin, then kill -9 of a replica mid-run.

The workload is concurrent_agents.py's (agent_workload.py: shared system prompt, a task, tool-output chunks; K agents
x T turns all at once, each agent's next turn as soon as its reply finished, greedy, streamed with include_usage),
sent through deploy/cluster.py's proxy to 2 replicas of the default model sharing one fresh SSD cache folder per run.
Every agent sends its session key (X-Session-Id: agent-k). The proxy's X-Lane-Replica header says who answered.

  affinity   one run per --balance policy, each on a fresh cluster and folder, order rotated by round:
             session          consistent hash on the key (deploy/haproxy.cfg.in as shipped)
             session-bounded  the same with --hash-balance-factor 150 (bounded-load consistent hashing)
             roundrobin       the plain balancer (same config, `balance roundrobin`)
             Measured: cache hit rate (sum cached_tokens / sum prompt_tokens, from usage), mean TTFT (all turns; and
             turns >= 2, where affinity matters), wall, replica switches between consecutive turns of a conversation,
             each replica's SSD restores (round-robin can restore what the other replica wrote: shared folder).
  failover   session policy; once --kill-after of all turns have finished, the replica with the most requests in
             flight gets kill -9. An agent whose request fails retries it (up to 3 attempts, 0.5 s apart).
             Measured: every agent finished, the failed requests and what they saw (HTTP status / cut stream), the
             moved conversations' first turn on the survivor (TTFT, cached tokens: restored from the folder the
             victim wrote, or not).
  replay     quiet, after the runs: each moved turn's exact prompt sent (1 token) to a fresh replica on the failover
             folder (restores from SSD) and to a fresh replica without an SSD tier (cold prefill), alternating:
             restore TTFT / cold TTFT side by side.

    python bench/cluster_affinity.py --k 5 --turns 3 --max-tokens 16  # what BENCHMARKS.md shows
    python bench/cluster_affinity.py --k 2 --turns 2 --max-tokens 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_workload import SYSTEM_PROMPT, user_message, workload  # noqa: E402
from common import ROOT, ensure_blas_here, preflight, run_record, write_result  # noqa: E402

from deploy.cluster import Cluster  # noqa: E402


def stream_turn(client, url: str, messages: list[dict], max_tokens: int, key: str) -> dict:
    """One streamed greedy turn with the agent's session key: ttft, total, text, usage, replica. Raises on an
    HTTP error status or a stream that ends without [DONE] (a replica killed under it)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, done = None, [], None, False
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Session-Id": key},
                       timeout=1200) as r:
        replica = r.headers.get("x-lane-replica")
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} from {replica}: {r.read().decode(errors='replace')[:200]}")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(piece)
    if not done:
        raise RuntimeError(f"stream from {replica} ended without [DONE]")
    total = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else total, "total": total, "text": "".join(text), "usage": usage or {},
            "replica": replica}


def run_agents(url: str, tasks, chunks, K: int, T: int, max_tokens: int, *, on_reply=None,
               attempts: int = 3) -> tuple[list[dict], float]:
    """K agent threads x T turns (concurrent_agents.py's loop, with session keys and retries)."""
    import httpx

    records: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(K)

    def agent(k: int) -> None:
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
        with httpx.Client() as client:
            start.wait()
            time.sleep(k * 0.005)
            for t in range(T):
                msgs.append(user_message(tasks[k], chunks[k][t], t))
                for attempt in range(1, attempts + 1):
                    sent = time.perf_counter()
                    rec = {"agent": k, "turn": t + 1, "attempt": attempt, "sent": sent, "messages_len": len(msgs)}
                    try:
                        r = stream_turn(client, url, msgs, max_tokens, f"agent-{k}")
                    except Exception as exc:  # a failed request is a record, and the agent retries it
                        rec.update(ok=False, end=time.perf_counter(), error=f"{type(exc).__name__}: {exc}"[:300])
                        with lock:
                            records.append(rec)
                        time.sleep(0.5)
                        continue
                    u = r["usage"]
                    rec.update(ok=True, end=sent + r["total"], ttft_s=round(r["ttft"], 4), replica=r["replica"],
                               prompt_tokens=u.get("prompt_tokens"), completion_tokens=u.get("completion_tokens"),
                               cached_tokens=(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                               messages=list(msgs) if on_reply else None)
                    with lock:
                        records.append(rec)
                    if on_reply:
                        on_reply(rec)
                    msgs.append({"role": "assistant", "content": r["text"]})
                    break
                else:
                    return

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(K)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t0 = min(r["sent"] for r in records)
    wall = max(r["end"] for r in records) - t0
    for r in records:
        r["sent"], r["end"] = round(r["sent"] - t0, 4), round(r["end"] - t0, 4)
    records.sort(key=lambda r: (r["agent"], r["turn"], r["attempt"]))
    return records, wall


def metrics(records: list[dict], wall: float, K: int, T: int) -> dict:
    ok = [r for r in records if r["ok"]]
    later = [r for r in ok if r["turn"] >= 2]
    switches = sum(1 for a in ok for b in ok if a["agent"] == b["agent"] and b["turn"] == a["turn"] + 1
                   and a["replica"] != b["replica"])
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    return {"wall_s": round(wall, 2), "requests_ok": len(ok), "requests_failed": len(records) - len(ok),
            "turns_done": len({(r["agent"], r["turn"]) for r in ok}), "turns_total": K * T,
            "hit_rate": round(cached / prompt, 4) if prompt else None, "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_mean_s": round(statistics.mean(r["ttft_s"] for r in ok), 3) if ok else None,
            "ttft_mean_turn2plus_s": round(statistics.mean(r["ttft_s"] for r in later), 3) if later else None,
            "replica_switches": switches, "per_replica": {n: sum(r["replica"] == n for r in ok)
                                                          for n in sorted({r["replica"] for r in ok})}}


def ssd_block(url: str) -> dict | None:
    import httpx

    try:
        s = httpx.get(url + "/stats", timeout=30).json()["ssd_cache"]
        return {k: s.get(k) for k in ("ssd_hits", "ssd_tokens_hit", "restores", "writes", "entries", "shared")}
    except Exception:
        return None


POLICIES = {"session": ("session", 0), "session-bounded": ("session", 150), "roundrobin": ("roundrobin", 0)}


def new_cluster(policy: str, folder: str, args) -> Cluster:
    balance, factor = POLICIES[policy]
    c = Cluster(2, balance=balance, hash_balance_factor=factor, ssd_cache=folder,
                serve_args=tuple(shlex.split(args.serve_args)))
    c.start()
    import httpx

    for i in range(2):  # warm-up, unrelated to the workload, straight to each replica
        httpx.post(c.replica_url(i) + "/v1/chat/completions", timeout=300,
                   json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
    return c


def affinity_run(balance: str, tasks, chunks, args, workdir: Path, rnd: int) -> dict:
    c = new_cluster(balance, str(workdir / f"kv-{balance}-{rnd}"), args)
    try:
        records, wall = run_agents(c.url, tasks, chunks, args.k, args.turns, args.max_tokens)
        ssd = {n: ssd_block(c.replica_url(i)) for i, n in enumerate(c.names)}
    finally:
        codes = c.stop()
    return {"balance": balance, "round": rnd, "metrics": metrics(records, wall, args.k, args.turns), "ssd": ssd,
            "exit_codes": codes, "records": records}


def failover_run(tasks, chunks, args, workdir: Path) -> dict:
    import httpx

    folder = str(workdir / "kv-failover")
    c = new_cluster("session", folder, args)
    total = args.k * args.turns
    done = []
    killed = threading.Event()
    kill_info: dict = {"happened": False}

    def on_reply(rec):
        done.append(rec)

    def killer():
        while len(done) < args.kill_after * total:
            time.sleep(0.05)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the replica with the most requests in flight (an event, not a sleep)
            running = []
            for i in range(2):
                try:
                    running.append(len(httpx.get(c.replica_url(i) + "/stats", timeout=10).json()["lane"]
                                       ["running_requests"]))
                except Exception:
                    running.append(0)
            if max(running):
                break
            time.sleep(0.02)
        victim = running.index(max(running))
        kill_info.update(happened=True, victim=c.names[victim], at_done=len(done), of_turns=total,
                         in_flight_on_victim=running[victim])
        c.kill(victim)
        killed.set()

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    try:
        records, wall = run_agents(c.url, tasks, chunks, args.k, args.turns, args.max_tokens, on_reply=on_reply)
        th.join(5)
        victim = kill_info.get("victim")
        survivor_name = next((n for n in c.names if n != victim), None)
        survivor = ssd_block(c.replica_url(c.index_of(survivor_name))) if victim else None
    finally:
        codes = c.stop()
    ok = [r for r in records if r["ok"]]
    moved = []
    for k in range(args.k):
        mine = sorted((r for r in ok if r["agent"] == k), key=lambda r: r["turn"])
        for a, b in zip(mine, mine[1:]):
            if victim and a["replica"] == victim and b["replica"] != victim:
                moved.append({"agent": k, "turn": b["turn"], "ttft_s": b["ttft_s"], "prompt_tokens": b["prompt_tokens"],
                              "cached_tokens": b["cached_tokens"], "prev_prompt_tokens": a["prompt_tokens"],
                              "restored": b["cached_tokens"] >= a["prompt_tokens"] - 1, "messages": b["messages"]})
    failed = [{k: r[k] for k in ("agent", "turn", "attempt", "error")} for r in records if not r["ok"]]
    finished = {k: len({r["turn"] for r in ok if r["agent"] == k}) == args.turns for k in range(args.k)}
    for r in records:
        r.pop("messages", None)
    return {"metrics": metrics(records, wall, args.k, args.turns), "kill": kill_info, "failed": failed,
            "every_agent_finished": all(finished.values()), "moved": moved, "survivor_ssd": survivor,
            "exit_codes": codes, "folder": folder, "records": records}


def replay(moved: list[dict], folder: str, args) -> list[dict]:
    """Each moved turn's prompt, 1 token, on a fresh replica over the folder (restore) and on one without an SSD
    tier (cold), alternating, one request at a time."""
    import httpx

    from tests.serverproc import ServerProc

    extra = shlex.split(args.serve_args)
    restore = ServerProc("--model", "default", "--ssd-cache", folder, *extra)
    cold = ServerProc("--model", "default", "--no-ssd-cache", *extra)
    out = []
    try:
        for srv in (restore, cold):
            httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                       json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
        for m in moved:
            row = {"agent": m["agent"], "turn": m["turn"], "prompt_tokens": m["prompt_tokens"]}
            for name, srv in (("cold", cold), ("restore", restore)):
                if name == "cold":  # RAM only: the shared system prompt must not be a hit either
                    httpx.post(srv.url + "/admin/cache/clear", timeout=60).raise_for_status()
                t0 = time.perf_counter()
                r = httpx.post(srv.url + "/v1/chat/completions", timeout=600,
                               json={"messages": m["messages"], "max_tokens": 1, "temperature": 0})
                row[f"{name}_s"] = round(time.perf_counter() - t0, 3)
                row[f"{name}_cached"] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            row["restore_over_cold"] = round(row["restore_s"] / row["cold_s"], 3)
            out.append(row)
    finally:
        restore.stop()
        cold.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=5,
                    help="agents (default 5; an even K lets round-robin keep lock-step agents on one replica)")
    ap.add_argument("--turns", type=int, default=3, help="turns per agent (default 3)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="affinity rounds (order rotated)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-min", type=int, default=150)
    ap.add_argument("--chunk-max", type=int, default=300)
    ap.add_argument("--kill-after", type=float, default=0.5, help="fraction of turns done before the kill")
    ap.add_argument("--serve-args", default="--model default", help="each replica's serve flags")
    ap.add_argument("--policies", default="session,session-bounded,roundrobin",
                    help=f"affinity runs, from {', '.join(POLICIES)}")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: affinity,failover,replay")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster_affinity.json"))
    args = ap.parse_args()
    ensure_blas_here()  # the replicas preload OpenBLAS themselves; this makes the recorded machine facts say so too
    skip = set(filter(None, args.skip.split(",")))

    from mlx_lm.utils import load_tokenizer

    import peers as peer_servers

    tokenizer = load_tokenizer(Path(peer_servers.default_paths()[0]))
    tasks, chunks = workload(tokenizer, args.k, args.turns, args.seed, args.chunk_min, args.chunk_max)
    workdir = Path(tempfile.mkdtemp(prefix="cluster-affinity-"))
    pf = preflight()
    t0 = time.perf_counter()
    result = {**run_record(), "preflight": pf,
              "config": {"replicas": 2, "k": args.k, "turns": args.turns, "max_tokens": args.max_tokens,
                         "rounds": args.rounds, "seed": args.seed, "chunk_tokens": [args.chunk_min, args.chunk_max],
                         "kill_after": args.kill_after, "serve_args": args.serve_args,
                         "proxy": "HAProxy (deploy/haproxy.cfg.in via deploy/cluster.py)"}}
    runs = []
    if "affinity" not in skip:
        for rnd in range(args.rounds):
            policies = [p.strip() for p in args.policies.split(",") if p.strip()]
            shift = rnd % len(policies)
            for balance in policies[shift:] + policies[:shift]:
                run = affinity_run(balance, tasks, chunks, args, workdir, rnd + 1)
                runs.append(run)
                m = run["metrics"]
                print(f"round {rnd + 1} {balance:16s} hit rate {m['hit_rate']:.3f}  mean TTFT {m['ttft_mean_s']:.3f}s "
                      f"(turns>=2 {m['ttft_mean_turn2plus_s']}s)  wall {m['wall_s']}s  switches "
                      f"{m['replica_switches']}  ssd {run['ssd']}", flush=True)
        result["affinity"] = runs
        summ = {}
        for b in dict.fromkeys(r["balance"] for r in runs):
            ms = [r["metrics"] for r in runs if r["balance"] == b]
            summ[b] = {k: statistics.median(m[k] for m in ms) for k in
                       ("hit_rate", "ttft_mean_s", "ttft_mean_turn2plus_s", "wall_s", "replica_switches")}
        if "roundrobin" in summ:
            summ["ratio_over_roundrobin"] = {
                b: {k: round(summ[b][k] / summ["roundrobin"][k], 3)
                    for k in ("ttft_mean_s", "ttft_mean_turn2plus_s", "wall_s") if summ["roundrobin"][k]}
                for b in summ if b != "roundrobin"}
        result["affinity_summary"] = summ
        print(json.dumps(summ, indent=1), flush=True)
    if "failover" not in skip:
        fo = failover_run(tasks, chunks, args, workdir)
        print(f"failover: every agent finished {fo['every_agent_finished']}; failed requests {fo['failed']}; "
              f"kill {fo['kill']}; moved {[{k: v for k, v in m.items() if k != 'messages'} for m in fo['moved']]}",
              flush=True)
        if "replay" not in skip and fo["moved"]:
            fo["replay"] = replay(fo["moved"], fo["folder"], args)
            print(f"replay (restore vs cold): {fo['replay']}", flush=True)
        for m in fo["moved"]:
            m.pop("messages", None)
        result["failover"] = fo
    result["preflight_end"] = preflight()
    result["script_wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
