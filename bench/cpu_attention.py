"""Attention on the CPU: mlx-lm's path (``mx.fast.scaled_dot_product_attention``, which has no fused CPU kernel) vs
``models.attention.cpu`` (a KV head's query heads folded into the query axis), in-process on the default model.

For --context tokens of KV (one prefill, then copied into --rows rows), per path: one batched decode step of all
rows (median of --reps) and one --chunk-token prefill chunk on top of one row's KV; then the largest logit
difference between the paths and whether their argmax agrees.

    python bench/cpu_attention.py --rows 8 --context 3000 --chunk 512

Prints one line per path and writes --out/cpu_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_MODEL = Path.home() / ".cache" / "mlx-lane" / "models" / "SmolLM2-135M-Instruct"


def main() -> int:
    from common import ensure_blas_here

    ensure_blas_here()  # as the server does (mlx-cpu's bundled reference BLAS is ~48x slower)
    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from models import load_model
    from models.attention import cpu as cpu_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench")))
    args = ap.parse_args()
    model = load_model(args.model).model
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    grouped = module.scaled_dot_product_attention
    paths = {"mlx": base.scaled_dot_product_attention,
             "grouped": grouped if grouped is not base.scaled_dot_product_attention
             else cpu_attention._wrap(base.scaled_dot_product_attention)}

    mx.random.seed(0)
    ids = mx.random.randint(3, 1000, (1, args.context))
    prefilled = make_prompt_cache(model)
    for i in range(0, args.context, 512):
        model(ids[:, i:i + 512], cache=prefilled)
        mx.eval([c.state for c in prefilled])
        print(f"prefill {min(i + 512, args.context)}/{args.context}", file=sys.stderr, flush=True)

    def rows(n):
        out = []
        for c in prefilled:
            k = KVCache()
            k.keys = mx.repeat(c.keys[..., :args.context, :], n, axis=0)
            k.values = mx.repeat(c.values[..., :args.context, :], n, axis=0)
            k.offset = args.context
            out.append(k)
        mx.eval([x.state for x in out])
        return out

    rec = {"script": "bench/cpu_attention.py", "argv": sys.argv[1:], "mlx": mx.__version__, "paths": {}}
    logits = {}
    for name, fn in paths.items():
        module.scaled_dot_product_attention = fn
        caches, tok = rows(args.rows), mx.array([[5]] * args.rows)
        mx.eval(model(tok, cache=caches))
        steps = []
        for _ in range(args.reps):
            t = time.perf_counter()
            mx.eval(model(tok, cache=caches))
            steps.append(time.perf_counter() - t)
        caches = rows(1)
        chunk = mx.random.randint(3, 1000, (1, args.chunk))
        t = time.perf_counter()
        model(chunk, cache=caches)
        mx.eval([c.state for c in caches])
        prefill = time.perf_counter() - t
        logits[name] = model(mx.array([[7]]), cache=rows(1))[0, -1]
        rec["paths"][name] = {"decode_step_ms": round(statistics.median(steps) * 1e3, 1),
                              "prefill_chunk_ms": round(prefill * 1e3, 1)}
        print(json.dumps({"path": name, **rec["paths"][name]}), flush=True)
    module.scaled_dot_product_attention = grouped
    rec["max_logit_diff"] = float(mx.max(mx.abs(logits["mlx"] - logits["grouped"])).item())
    rec["same_argmax"] = bool(mx.argmax(logits["mlx"]).item() == mx.argmax(logits["grouped"]).item())
    rec["grouped_over_mlx"] = {k: round(rec["paths"]["grouped"][k] / rec["paths"]["mlx"][k], 3)
                               for k in rec["paths"]["mlx"]}
    print(json.dumps({k: rec[k] for k in ("max_logit_diff", "same_argmax", "grouped_over_mlx")}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cpu_attention.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
