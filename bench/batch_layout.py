"""The decode batch's two layouts side by side (issue 22, item 2), in-process: mlx-lm's GenerationBatch
(``server.engine.batch.mlx.MlxBatch``: a join runs a forward of its own and copies the batch's KV; a leave copies every
row that stays) against the ragged layout (``server.engine.batch.ragged.RaggedBatch``: a join writes the row into a
free slot and rides the next forward; a leave moves the last row into the hole).

For N rows of mixed lengths around --context (one batched prefill, each row a view of it), per layout, alternating
layouts over --rounds so that both see the same machine:

  step_ms     median of one decode step of the N-row batch (greedy rows)
  join_ms     one row of --context tokens joining (join + the next step, minus a step)
  leave_ms    one row leaving (its caches handed back)
  churn       --churn-steps steps in which a row leaves and a new one joins every --churn-every steps (agents' turns
              ending and starting): wall seconds and tokens per second, and whether both layouts returned the same
              greedy tokens

    python bench/batch_layout.py --rows 8 --context 512                      # this CPU, the default model
    python bench/batch_layout.py --model DIR --rows 8,32 --context 1024      # another model or machine
    OUT=$OUT bash bench/gpu.sh bench/batch_layout.py --shape llama3-8b --rows 8,32 --context 1024   # the H200

Prints one JSON line per (rows, layout, round) as it goes and writes --out/batch_layout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "mlx-lane" / "models" / "SmolLM2-135M-Instruct"


def measure(cls, model, views, histories, n: int, reps: int, churn_steps: int, churn_every: int) -> dict:
    """One layout's figures; `views()` gives fresh per-row caches (views of one prefill) for every batch built."""
    from server.engine.batch.protocol import Row

    batch = cls(model)
    seqs = [SimpleNamespace(id=r) for r in range(n)]
    batch.add([Row(s, c, h) for s, c, h in zip(seqs, views()[:n], histories[:n])])
    for _ in range(2):
        batch.step()
    steps = []
    for _ in range(reps):
        t = time.perf_counter()
        batch.step()
        mx.synchronize()
        steps.append(time.perf_counter() - t)
    step = statistics.median(steps)
    t = time.perf_counter()  # back to back, as the lane runs them (a pipelined batch overlaps its Python)
    for _ in range(reps):
        batch.step()
    mx.synchronize()
    run = (time.perf_counter() - t) / reps
    joins, leaves = [], []
    for k in range(reps):
        newcomer = SimpleNamespace(id=f"new{k}")
        t = time.perf_counter()
        batch.add([Row(newcomer, views()[n], histories[n])])
        batch.step()
        mx.synchronize()
        joins.append(time.perf_counter() - t - step)
        t = time.perf_counter()
        batch.remove([newcomer])
        mx.synchronize()
        leaves.append(time.perf_counter() - t)
    del batch
    mx.clear_cache()

    batch = cls(model)  # the churn: turns end and start while the others decode
    live = [SimpleNamespace(id=r) for r in range(n)]
    batch.add([Row(s, c, h) for s, c, h in zip(live, views()[:n], histories[:n])])
    out: dict = {s.id: [] for s in live}
    made, nxt = 0, n
    t = time.perf_counter()
    for i in range(churn_steps):
        if i and i % churn_every == 0:
            batch.remove([live.pop(0)])
            seq = SimpleNamespace(id=nxt)
            out[nxt] = []
            batch.add([Row(seq, views()[nxt % (n + 1)], histories[nxt % (n + 1)])])
            live.append(seq)
            nxt += 1
        for e in batch.step():
            out[e.seq.id].append(e.token)
            made += 1
    mx.synchronize()
    wall = time.perf_counter() - t
    del batch
    mx.clear_cache()
    return {"step_ms": round(step * 1e3, 2), "run_step_ms": round(run * 1e3, 2), "join_ms": round(statistics.median(joins) * 1e3, 2),
            "leave_ms": round(statistics.median(leaves) * 1e3, 2), "churn_s": round(wall, 3),
            "churn_tok_s": round(made / wall, 2), "_tokens": out}


def main() -> int:
    from common import ensure_blas_here

    ensure_blas_here()  # on Linux, OpenBLAS (mlx-cpu's bundled reference BLAS is ~48x slower), as the server does
    from mlx_lm.models.cache import make_prompt_cache

    from gpu_spec_oracle import row_views  # each row's own KVCache views over one batched prefill
    from gpu_write_cost import build  # random weights of a real shape (speed does not depend on the values)
    from models import load_model
    from server.engine.batch.mlx import MlxBatch
    from server.engine.batch.ragged import RaggedBatch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--shape", help="random weights of this bench/gpu.py shape (e.g. llama3-8b) instead of --model")
    ap.add_argument("--dtype", default="bfloat16", help="with --shape")
    ap.add_argument("--rows", default="8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--churn-steps", type=int, default=64)
    ap.add_argument("--churn-every", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench")))
    args = ap.parse_args()
    model = build(args.shape, args.dtype)[0] if args.shape else load_model(args.model).model
    layouts = {"mlx": MlxBatch, "ragged": RaggedBatch,
               "ragged_pipelined": lambda m: RaggedBatch(m, pipelined=True)}
    rec = {"script": "bench/batch_layout.py", "argv": sys.argv[1:], "mlx": mx.__version__,
           "device": str(mx.default_device()), "model": args.shape or args.model, "rows": {}}
    for n in [int(x) for x in args.rows.split(",")]:
        mx.random.seed(1)
        ids = mx.random.randint(3, 1000, (n + 1, args.context))
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        for i in range(0, args.context, 256):
            model(ids[:, i:i + 256], cache=cache)
            mx.eval([c.state for c in cache])
            print(f"prefill of {n + 1} rows: {min(i + 256, args.context)}/{args.context} tokens "
                  f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
        lengths = [args.context - 1 - (37 * r) % min(256, args.context // 2) for r in range(n + 1)]
        histories = [ids[r, :lengths[r] + 1].tolist() for r in range(n + 1)]
        runs: dict = {name: [] for name in layouts}
        for rnd in range(args.rounds):
            names = list(layouts)
            for name in (names if rnd % 2 == 0 else names[::-1]):
                cls = layouts[name]
                r = measure(cls, model, lambda: row_views(cache, lengths), histories, n, args.reps, args.churn_steps,
                            args.churn_every)
                runs[name].append(r)
                print(json.dumps({"rows": n, "layout": name, "round": rnd,
                                  **{k: v for k, v in r.items() if not k.startswith("_")}}), flush=True)
        a = runs["mlx"][0]["_tokens"]
        same = {}
        for name in names[1:]:  # a pipelined batch may end a token short: compare what both returned
            b = runs[name][0]["_tokens"]
            same[name] = f"{sum(1 for k in a if a[k][:len(b.get(k, []))] == b.get(k, [])[:len(a[k])])}/{len(a)}"
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("step_ms", "run_step_ms", "join_ms",
                                                                       "leave_ms", "churn_s", "churn_tok_s")}
               for name, rs in runs.items()}
        row = {"median": med, "rows_with_same_greedy_tokens_as_mlx": same,
               **{f"{name}_over_mlx": {k: round(med[name][k] / med["mlx"][k], 3) if med["mlx"][k] else None
                                       for k in med["mlx"]} for name in names[1:]}}
        rec["rows"][str(n)] = row
        print(json.dumps({"rows": n, **row}), flush=True)
        del cache
        mx.clear_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "batch_layout.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
