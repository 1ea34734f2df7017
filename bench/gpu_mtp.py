"""MTP drafting served, side by side with plain decoding (issue 44 item 5): the speed figures of ``--draft-kind mtp``.

Our server on one checkpoint that ships MTP heads, started fresh per configuration (RAM cache only, cleared before
every pass), alternated round by round:
  plain      no speculation (the lane's plain batching)
  mtp        --draft-kind mtp: alone a request speculates solo; together, plain-KV models verify every row's drafts
             in one forward and draft for all rows in batched forwards of the heads (hybrids decode plainly beside
             others)
  mtp_solo   --draft-kind mtp --no-spec-batch: each speculating request on its own
  ngram      --draft-kind ngram (with --configs): the draft that needs no heads, for comparison
Each pass: K agents send a turn at once (bench/agent_workload.py's tool-output turns, bench/spec_batch.py's pass:
the reply quotes the tool output), greedy, --max-tokens. Per configuration: median wall and mean decode time (first
token to last) over the rounds, their ratios to plain, how many replies equal plain's, and the server's
/stats speculative block at the end (acceptance, in-batch steps, rows handed to the plain batch).

    python bench/gpu_mtp.py --model /models/Qwen3.5-9B --agents 1,16 --rounds 3 --out bench/results/gpu_mtp_h200.json
    bash bench/gpu.sh bench/gpu_mtp.py --shape qwen3.5-9b --agents 1,16 --rounds 1    # random 9B + untrained heads
    python bench/gpu_mtp.py --zoo glm4_moe_lite --agents 1,2 --rounds 1 --max-tokens 8     # a CPU logic check

On a GPU the servers run one at a time (each configuration's passes, then the next: two 9B servers with their caches
do not fit one 80 GB card); on the CPU they run side by side and alternate round by round (``--together``).
With ``--shape`` (bench/gpu.py's random weights with an untrained head, bench/mtp_train.py) the heads never agree
with the model, so the figure is the policy's: MTP must turn itself off and stay within 3% of plain (issue 44's
N = 16 target); a fitted head (``bench/mtp_fit.py --fit-steps N --save DIR``, then ``--model DIR``) gives the rest.

NOT MEASURED YET on the H200 (the session that wrote it had no device time left): BENCHMARKS.md has no row.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import httpx

import peers as peer_servers
from agent_workload import workload
from common import ROOT, preflight, run_record, write_result
from spec_batch import one_pass

CONFIGS = {"plain": (), "mtp": ("--draft-kind", "mtp"), "mtp_solo": ("--draft-kind", "mtp", "--no-spec-batch"),
           "ngram": ("--draft-kind", "ngram")}


def model_dir(args) -> Path:
    if args.shape:
        from mtp_train import build_target_with_heads

        out = Path(args.model_dir)
        if not (args.reuse_model and (out / "config.json").is_file()):
            build_target_with_heads(args.shape, out, args.dtype, Path(args.tokenizer_dir), args.vocab)
        return out
    if not args.zoo:
        return Path(args.model)
    from models import ensure_default_model
    from tests.fixtures import zoo_mtp

    return zoo_mtp.write(args.zoo, Path(tempfile.mkdtemp(prefix="gpu-mtp-")) / args.zoo,
                         Path(ensure_default_model(progress=False)))


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def summary(rows: list[dict], plain_texts, k: int, turns: int) -> dict:
    walls = [r["wall_s"] for r in rows]
    dec = [r["decode_s_mean"] for r in rows]
    block = {"wall_s": walls, "wall_median_s": round(statistics.median(walls), 3), "decode_s_mean": dec,
             "decode_median_s": round(statistics.median(dec), 3)}
    if plain_texts is not None:
        same = compared = 0
        for r in rows:
            for i in range(k):
                for t in range(turns):
                    compared += 1
                    if r["texts"][i][t] != plain_texts[i][t]:
                        compared += turns - t - 1  # later turns have other prompts
                        break
                    same += 1
        block.update(replies_equal_to_plain=same, replies_compared=compared)
    return block


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint that ships MTP heads (what --model accepts)")
    src.add_argument("--zoo", choices=["qwen3_5", "glm4_moe_lite", "nemotron_h"],
                     help="tests.fixtures.zoo_mtp's tiny model")
    src.add_argument("--shape", help="bench/gpu.py's random-weight shape with an untrained head, built in --model-dir")
    ap.add_argument("--model-dir", default="/dev/shm/mlx-lane-gpu-mtp-model", help="where --shape builds")
    ap.add_argument("--reuse-model", action="store_true", help="--shape: use the model in --model-dir if it is there")
    ap.add_argument("--vocab", type=int, default=49152, help="--shape: cut the vocabulary to this size (default "
                    "%(default)s, the tokenizer's: bench/gpu_agents.py does the same)")
    ap.add_argument("--dtype", default="bfloat16", help="--shape: the weights' dtype")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".whl" / "tok"), help="--shape: the tokenizer it gets")
    ap.add_argument("--server-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="the servers' --dtype (default theirs: bfloat16 on a GPU). float32 serves a head fitted in "
                         "float32 (bench/mtp_fit.py --dtype float32) on the numbers it was fitted on; with "
                         "MLX_ENABLE_TF32=0 in the environment, which the servers inherit, its matmuls stay float32")
    ap.add_argument("--together", action=argparse.BooleanOptionalAction, default=None,
                    help="run every configuration's server at once, alternating round by round (default: on the "
                         "CPU; on a GPU one server at a time)")
    ap.add_argument("--agents", default="1,16", help="concurrent agents per level (default 1,16)")
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", default="plain,mtp,mtp_solo")
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_mtp.json"))
    args = ap.parse_args()
    pf = preflight()
    configs = [c for c in args.configs.split(",") if c]
    levels = [int(x) for x in args.agents.split(",") if x]
    from mlx_lm.utils import load_tokenizer

    path = model_dir(args)
    tokenizer = load_tokenizer(path)
    together = args.together if args.together is not None else not on_gpu()
    result = {**run_record(), "args": vars(args), "preflight": pf, "together": together, "levels": {}}
    passes = {k: workload(tokenizer, k, args.turns, args.seed + k) for k in levels}
    rows: dict = {k: {c: [] for c in configs} for k in levels}
    with tempfile.TemporaryDirectory(prefix="gpu-mtp-") as tmp:
        def run(name: str, server, k: int, rnd: int) -> None:
            tasks, chunks = passes[k]
            httpx.post(server.url + "/admin/cache/clear", timeout=60)
            r = one_pass(server.url, tasks, chunks, args.turns, args.max_tokens)
            rows[k][name].append(r)
            print(f"K={k} round {rnd + 1} {name:9s} wall {r['wall_s']:7.2f} s  decode (mean) "
                  f"{r['decode_s_mean']:6.2f} s", flush=True)

        def started(name: str):
            dtype = ("--dtype", args.server_dtype) if args.server_dtype else ()
            server = peer_servers.Ours(Path(tmp) / name, path, extra=(*CONFIGS[name], *dtype))
            server.start()
            return server

        def speculative(name: str, server) -> None:
            result.setdefault("speculative_end", {})[name] = \
                httpx.get(server.url + "/stats", timeout=60).json().get("speculative")

        if together:  # every server up at once, the configurations alternated round by round (noise shared)
            servers: dict = {}
            try:
                for name in configs:
                    servers[name] = started(name)
                for k in levels:
                    for rnd in range(args.rounds):
                        for name in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:
                            run(name, servers[name], k, rnd)
                for name, server in servers.items():
                    speculative(name, server)
            finally:
                for server in servers.values():
                    server.stop()
        else:  # one server at a time: each configuration's passes, then the next
            for name in configs:
                server = started(name)
                try:
                    for k in levels:
                        for rnd in range(args.rounds):
                            run(name, server, k, rnd)
                    speculative(name, server)
                finally:
                    server.stop()
    for k in levels:
        plain_texts = rows[k]["plain"][0]["texts"] if "plain" in rows[k] else None
        level = {"configs": {n: summary(rows[k][n], plain_texts, k, args.turns) for n in configs}}
        if "plain" in rows[k]:
            for key in ("wall", "decode"):
                base = level["configs"]["plain"][f"{key}_median_s"]
                level[f"{key}_over_plain"] = {n: round(level["configs"][n][f"{key}_median_s"] / base, 3)
                                              for n in configs}
        result["levels"][str(k)] = level
        print(f"K={k}: wall over plain {level.get('wall_over_plain')}, decode over plain "
              f"{level.get('decode_over_plain')}, replies equal to plain "
              f"{ {n: level['configs'][n].get('replies_equal_to_plain') for n in configs} }", flush=True)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
