"""What a verify step costs in the batch (issue 24), in-process on the bench model shape (random weights cannot
echo, so this measures the mechanism, not acceptance).

For N rows of --context tokens: the median time of
  plain      one decode step of mlx-lm's plain batch KV (every row the same length: the cheapest layout)
  batch_mixed  one decode step of mlx-lm's BatchKVCache over rows of mixed lengths (the server's plain batch:
             left-padded rows, RoPE offsets per row, attention through a mask), lengths --context - (37 r mod 256)
  ragged_mixed_0  the ragged layout over the same mixed lengths, no drafts (what batch_mixed compares to)
  ragged_k   one forward of 1 + k tokens per row over server.engine.batch.ragged_kv (the speculating batch's layout),
             k = 0..--max-k, each row then keeping one position (as if every draft were rejected)
and ragged_k / plain. With acceptance r, a step of k drafts yields 1 + r*k tokens per row for ragged_k / plain of a
plain step's time.

    python bench/gpu_spec_verify.py --rows 8,32 --max-k 4 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` (two warm-up calls first): bench/common.py's ``median_seconds``."""
    from common import median_seconds

    return median_seconds(fn, reps, warm=2)


def main() -> int:
    from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

    from gpu_write_cost import build
    from server.engine.batch.ragged_kv import RaggedKV

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    model, _ = build(args.shape, args.dtype)
    rec = {"script": "bench/gpu_spec_verify.py", "argv": sys.argv[1:], "mlx": mx.__version__,
           "device": str(mx.default_device()), "rows": {}}
    for n in [int(x) for x in args.rows.split(",")]:
        prompt = mx.random.randint(0, 1000, (n, args.context))
        cache = make_prompt_cache(model)
        for i in range(0, args.context, 512):
            model(prompt[:, i:i + 512], cache=cache)
            mx.eval([c.state for c in cache])
        tok = mx.zeros((n, 1), dtype=mx.int32)

        def plain():
            mx.eval(mx.argmax(model(tok, cache=cache)[:, -1], axis=-1))
            for c in cache:
                c.trim(1)

        row = {"plain_ms": round(timed(plain, args.reps) * 1e3, 3)}
        rows = []
        for r in range(n):
            own = []
            for c in cache:
                k = KVCache()
                k.keys, k.values, k.offset = c.keys[r:r + 1, :, :c.offset], c.values[r:r + 1, :, :c.offset], c.offset
                own.append(k)
            rows.append(own)
        mixed = [args.context - (37 * r) % 256 for r in range(n)]  # agents' rows differ in length

        def cut(own, length):
            out = []
            for c in own:
                k = KVCache()
                k.keys, k.values, k.offset = c.keys[..., :length, :], c.values[..., :length, :], length
                out.append(k)
            return out

        batch = [BatchKVCache.merge([cut(own, m)[layer] for own, m in zip(rows, mixed)])
                 for layer in range(len(rows[0]))]

        def batch_step():
            mx.eval(mx.argmax(model(tok, cache=batch)[:, -1], axis=-1))
            for c in batch:
                c.trim(1)

        row["batch_mixed_ms"] = round(timed(batch_step, args.reps) * 1e3, 3)
        row["batch_mixed_over_plain"] = round(row["batch_mixed_ms"] / row["plain_ms"], 3)
        del batch
        ragged_mixed = RaggedKV.from_rows([cut(own, m) for own, m in zip(rows, mixed)])
        one = mx.zeros((n, 1), dtype=mx.int32)

        def ragged_step():
            ragged_mixed.reserve(1)
            mx.eval(mx.argmax(model(one, cache=ragged_mixed.layers), axis=-1))
            ragged_mixed.commit([0] * n)

        row["ragged_mixed_0_ms"] = round(timed(ragged_step, args.reps) * 1e3, 3)
        row["ragged_mixed_0_over_batch_mixed"] = round(row["ragged_mixed_0_ms"] / row["batch_mixed_ms"], 3)
        del ragged_mixed
        kv = RaggedKV.from_rows(rows)
        del cache, rows
        for k in range(args.max_k + 1):
            inp = mx.zeros((n, 1 + k), dtype=mx.int32)

            def verify():
                kv.reserve(1 + k)
                mx.eval(mx.argmax(model(inp, cache=kv.layers), axis=-1))
                kv.commit([0] * n)  # keep nothing: the context stays the same

            ms = timed(verify, args.reps) * 1e3
            row[f"ragged_{k}_ms"] = round(ms, 3)
            row[f"ragged_{k}_over_plain"] = round(ms / row["plain_ms"], 3)
        rec["rows"][str(n)] = row
        print(json.dumps({"rows": n, **row}), flush=True)
        del kv
        mx.clear_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_spec_verify.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
