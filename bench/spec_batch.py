"""Speculation in the batch (issue 24): K agents at once whose turns quote their tool output, on this CPU.

Three configurations of our server, each started fresh (RAM cache only, cleared before every pass), alternated
round by round:
  plain       no speculation: the lane's plain batching (server.engine.batch.choose: the ragged batch on this CPU)
  spec_batch  --draft-kind ngram: the agents' drafts verified together, one forward per step (server.engine.batch.speculating)
  spec_solo   --draft-kind ngram --no-spec-batch: each speculating agent decoded on its own (before this change)
  two_model_batch / two_model_solo   --draft-model default (the default model drafting for itself), in the batch or
              each on its own: the two-model mechanism's cost on this CPU (only with --configs);
              two_model_rowwise: in the batch, each row's drafts from its own draft caches (--debug-no-draft-batch)
Each pass: K agents send their turn at once (threads released together); a turn is the benchmark agent's system
prompt, a task and 150-400 tokens of tool output (bench/agent_workload.py: code read from a file, test logs, grep
hits), ending in an instruction that makes the reply quote that output ("Show the function you will change,
exactly as it is now, then the fixed version."). --turns T: later turns append the agent's own reply and a new tool
output. Greedy, --max-tokens (64). Per pass: wall (first send to last reply), the mean of each reply's decode time
(first token to last: prefill, which speculation cannot shorten, is outside it), each turn's text; per
configuration: medians over the rounds, ratios to plain, and how many replies equal plain's reply to the same prompt (a turn
after a differing reply has a different prompt and is not compared).

    python bench/spec_batch.py --agents 4,8 --rounds 3
    python bench/spec_batch.py --agents 2 --rounds 1 --max-tokens 16    # smoke
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

import peers as peer_servers
from agent_workload import SYSTEM_PROMPT, stream_chat, workload
from common import ROOT, preflight, run_record, write_result

CONFIGS = {"plain": (), "spec_batch": ("--draft-kind", "ngram"),
           "spec_solo": ("--draft-kind", "ngram", "--no-spec-batch"),
           # the default model drafting for itself: every draft holds, but a drafted token costs a whole forward of
           # a model as big as the target (the mechanism's cost, not a pair anyone would serve)
           "two_model_batch": ("--draft-model", "default", "--num-draft-tokens", "4"),
           "two_model_solo": ("--draft-model", "default", "--num-draft-tokens", "4", "--no-spec-batch"),
           # in the batch, but each row drafting on its own draft caches (before server.engine.batch.drafts)
           "two_model_rowwise": ("--draft-model", "default", "--num-draft-tokens", "4", "--debug-no-draft-batch")}
ASK = "\n\nShow the function you will change, exactly as it is now, then the fixed version."


def conversation(task: str, chunks: list[str], replies: list[str], turn: int) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    for t in range(turn + 1):
        body = (f"Task: {task}\n\n{chunks[t]}" if t == 0 else chunks[t]) + ASK
        msgs.append({"role": "user", "content": body})
        if t < turn:
            msgs.append({"role": "assistant", "content": replies[t]})
    return msgs


def one_pass(url: str, tasks: list[str], chunks: list[list[str]], turns: int, max_tokens: int) -> dict:
    """All agents, turn by turn: each turn sent by every agent at once. Returns wall and texts[agent][turn]."""
    k = len(tasks)
    texts: list[list[str]] = [[] for _ in range(k)]
    walls, decode = [], []  # decode: each reply's first token to its last (the part speculation can shorten)
    for turn in range(turns):
        start = threading.Barrier(k)
        out: list = [None] * k

        def agent(i: int) -> None:
            with httpx.Client(timeout=1200) as client:
                msgs = conversation(tasks[i], chunks[i], texts[i], turn)
                start.wait()
                out[i] = stream_chat(client, url, msgs, max_tokens)

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(k)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        walls.append(time.perf_counter() - t0)
        for i in range(k):
            texts[i].append(out[i]["text"])
            decode.append(out[i]["total"] - out[i]["ttft"])
    return {"wall_s": round(sum(walls), 3), "turn_walls_s": [round(w, 3) for w in walls],
            "decode_s_mean": round(statistics.mean(decode), 3), "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="4,8", help="concurrent agents per level (default 4,8)")
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default="plain,spec_batch,spec_solo")
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_batch.json"))
    args = ap.parse_args()
    pf = preflight()
    configs = [c for c in args.configs.split(",") if c]
    levels = [int(x) for x in args.agents.split(",") if x]
    from mlx_lm.utils import load_tokenizer

    model_dir, _ = peer_servers.default_paths()
    tokenizer = load_tokenizer(model_dir)
    result = {**run_record(), "args": vars(args), "preflight": pf, "levels": {}}
    with tempfile.TemporaryDirectory(prefix="spec-batch-") as tmp:
        servers = {}
        for name in configs:
            s = peer_servers.Ours(Path(tmp) / name, model_dir, extra=CONFIGS[name])
            s.start()
            servers[name] = s
        try:
            for k in levels:
                tasks, chunks = workload(tokenizer, k, args.turns, args.seed + k)
                rows: dict = {c: [] for c in configs}
                for rnd in range(args.rounds):
                    order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
                    for name in order:
                        httpx.post(servers[name].url + "/admin/cache/clear", timeout=60)
                        r = one_pass(servers[name].url, tasks, chunks, args.turns, args.max_tokens)
                        r["round"] = rnd + 1
                        rows[name].append(r)
                        print(f"K={k} round {rnd + 1} {name:10s} wall {r['wall_s']:7.2f} s  decode (first to last "
                              f"token, mean) {r['decode_s_mean']:6.2f} s", flush=True)
                level = {"configs": {}}
                plain_texts = rows["plain"][0]["texts"] if "plain" in rows else None
                for name in configs:
                    walls = [r["wall_s"] for r in rows[name]]
                    dec = [r["decode_s_mean"] for r in rows[name]]
                    block = {"wall_s": walls, "wall_median_s": round(statistics.median(walls), 3),
                             "decode_s_mean": dec, "decode_median_s": round(statistics.median(dec), 3)}
                    if plain_texts is not None:
                        same = compared = 0
                        for r in rows[name]:
                            for i in range(k):
                                for t in range(args.turns):
                                    compared += 1
                                    if r["texts"][i][t] != plain_texts[i][t]:
                                        compared += args.turns - t - 1  # later turns have other prompts
                                        break
                                    same += 1
                        block.update(replies_equal_to_plain=same, replies_compared=compared)
                    level["configs"][name] = block
                if "plain" in rows:
                    base = level["configs"]["plain"]["wall_median_s"]
                    level["wall_over_plain"] = {n: round(level["configs"][n]["wall_median_s"] / base, 3)
                                                for n in configs}
                    dbase = level["configs"]["plain"]["decode_median_s"]
                    level["decode_over_plain"] = {n: round(level["configs"][n]["decode_median_s"] / dbase, 3)
                                                  for n in configs}
                level["texts_first_round"] = {n: rows[n][0]["texts"] for n in configs}
                result["levels"][str(k)] = level
                print(f"K={k}: " + ", ".join(f"{n} {level['configs'][n]['wall_median_s']:.2f} s" for n in configs)
                      + (f"; wall over plain {level.get('wall_over_plain')}, decode over plain "
                         f"{level.get('decode_over_plain')}" if "plain" in rows else ""), flush=True)
            for name, s in servers.items():
                spec = httpx.get(s.url + "/stats", timeout=60).json().get("speculative") or {}
                result.setdefault("speculative_end", {})[name] = spec
        finally:
            for s in servers.values():
                s.stop()
    path = write_result(result, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
