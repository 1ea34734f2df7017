"""Where a tick of the lane's plain decode batch goes (issue 22, items 1 and 9), in-process: on the GPU over the
bench model shape (random weights), on this CPU over a real model (--model, e.g. the default SmolLM2 in float32).

For N rows of mixed lengths around --context (left-padded in one BatchKVCache, as the server's batch holds them),
the median time of each part the lane does per tick or per request, each measured alone with a synchronisation
after it (so the parts do not overlap as they do in a pipelined step: their sum is an upper bound of a tick):

  forward            one batch forward of 1 token per row + argmax, evaluated (the model's work)
  forward_ctx16      the same over 16-token rows: weights only, almost no attention. forward - forward_ctx16 is
                     what attending over --context costs (attention share = that / forward)
  step               MlxBatch.step: mlx-lm's GenerationBatch.next (pipelined: sampling, logprobs, the next
                     forward started), greedy rows; step - forward is the wrapper and sampling overhead
  step_penalty       the same with a repetition penalty on every row (each row's LogitsRules.processors, mlx-lm's
                     per-row logits processors: a Python loop per row per step)
  logsumexp          the logprobs of every row over the vocabulary (what each step returns per token)
  join               one new row of --context tokens joining the N-row batch (GenerationBatch over it + extend:
                     the batch's KV is copied into the merged one)
  leave              one row leaving (extract_cache + filter: the others' KV copied again)
  snapshot           kvfile.encode of one finished row's caches (what the write-behind takes on the lane)

    bench/gpu.sh bench/tick_profile.py --rows 8,32 --context 1024                 # H200 (OUT=... as gpu.sh says)
    python bench/tick_profile.py --model ~/.cache/mlx-lane/models/SmolLM2-135M-Instruct --rows 1,8 --context 512
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


def median_ms(fn, reps: int, setup=None) -> float:
    """Median wall time of `fn()` in ms (each call ends synchronised); `setup()` runs untimed before each call."""
    out = []
    for i in range(reps + 2):
        if setup is not None:
            setup()
        mx.synchronize()
        t = time.perf_counter()
        fn()
        mx.synchronize()
        if i >= 2:  # two warm-ups
            out.append(time.perf_counter() - t)
    return round(statistics.median(out) * 1e3, 3)


def main() -> int:
    from common import ensure_blas_here

    ensure_blas_here()  # on Linux, OpenBLAS (mlx-cpu's bundled reference BLAS is ~48x slower), as the server does
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from cache import kvfile
    from gpu_spec_oracle import row_views
    from gpu_write_cost import build
    from server.engine.batch.mlx import MlxBatch
    from server.engine.batch.protocol import Row
    from server.engine.batch.rules import LogitsRules, Penalties

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--model", default=None, help="an mlx-lm model directory instead of --shape's random weights")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    if args.model:
        from models import load_model

        model = load_model(args.model).model
    else:
        model, _ = build(args.shape, args.dtype)
    rec = {"script": "bench/tick_profile.py", "argv": sys.argv[1:], "mlx": mx.__version__,
           "device": str(mx.default_device()), "rows": {}}
    for n in [int(x) for x in args.rows.split(",")]:
        row: dict = {}
        for ctx, name in ((16, "forward_ctx16_ms"), (args.context, "forward_ms")):
            mx.random.seed(1)
            ids = mx.random.randint(3, 1000, (n + 1, ctx))
            cache = make_prompt_cache(model)
            for i in range(0, ctx, 512):
                model(ids[:, i:i + 512], cache=cache)
                mx.eval([c.state for c in cache])
            lengths = [ctx - 1 - (37 * r) % min(256, ctx // 2) for r in range(n + 1)]
            histories = [ids[r, :lengths[r] + 1].tolist() for r in range(n + 1)]

            def batch(penalty=False, rows=n):
                b = MlxBatch(model, clear_cache=False)
                rules = LogitsRules(Penalties(repetition=1.1)) if penalty else LogitsRules()
                seqs = [SimpleNamespace(id=r) for r in range(rows)]
                b.add([Row(s, c, h, rules) for s, c, h in
                       zip(seqs, row_views(cache, lengths[:rows]), histories[:rows])])
                b.step()
                return b, seqs

            b, seqs = batch()
            tok = mx.zeros((n, 1), dtype=mx.int32)
            layers = b._gen.prompt_cache

            def forward():
                mx.eval(mx.argmax(model(tok, cache=layers)[:, -1], axis=-1))
                for c in layers:
                    c.trim(1)

            row[name] = median_ms(forward, args.reps)
            if ctx != args.context:
                continue
            row["step_ms"] = median_ms(lambda: b.step(), args.reps)
            logits = model(tok, cache=layers)[:, -1]
            for c in layers:
                c.trim(1)
            mx.eval(logits)
            row["logsumexp_ms"] = median_ms(lambda: mx.eval(logits - mx.logsumexp(logits, axis=-1, keepdims=True)),
                                            args.reps)
            newcomer = SimpleNamespace(id="new")

            def join():
                b.add([Row(newcomer, row_views(cache, lengths)[n], histories[n])])

            def leave():
                b.remove([newcomer])

            joins, leaves = [], []
            for _ in range(args.reps):
                mx.synchronize()
                t = time.perf_counter()
                join()
                b.step()  # the join's merge is lazy: the next step pays it; measured as join + step - step
                mx.synchronize()
                joins.append(time.perf_counter() - t)
                t = time.perf_counter()
                leave()
                mx.synchronize()
                leaves.append(time.perf_counter() - t)
            row["join_plus_step_ms"] = round(statistics.median(joins) * 1e3, 3)
            row["join_ms"] = round(row["join_plus_step_ms"] - row["step_ms"], 3)
            row["leave_ms"] = round(statistics.median(leaves) * 1e3, 3)
            one = [KVCache() for _ in cache]
            for c, src in zip(one, row_views(cache, lengths)[0]):
                c.keys, c.values, c.offset = mx.contiguous(src.keys), mx.contiguous(src.values), src.offset
            mx.eval([c.state for c in one])
            row["snapshot_ms"] = median_ms(lambda: mx.eval(list(kvfile.encode(one).arrays.values())), args.reps)
            del b
            b, seqs = batch(penalty=True)
            row["step_penalty_ms"] = median_ms(lambda: b.step(), args.reps)
            del b, cache
            mx.clear_cache()
        f, f16 = row["forward_ms"], row["forward_ctx16_ms"]
        row["attention_share_of_forward"] = round((f - f16) / f, 3) if f else None
        row["step_over_forward"] = round(row["step_ms"] / f, 3) if f else None
        row["penalty_cost_ms_per_row"] = round((row["step_penalty_ms"] - row["step_ms"]) / n, 3)
        rec["rows"][str(n)] = row
        print(json.dumps({"rows": n, **row}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tick_profile.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
