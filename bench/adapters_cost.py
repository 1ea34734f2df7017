"""Cost of serving two LoRA adapters at once vs one: decode throughput of the lane's adapter groups, in process.

The default model, two random rank-8 adapters over its last 16 layers (tests/fixtures/adapters.py; weights do not
change speed), the lane's own decode batch (server.engine.batch.mlx.MlxBatch, what each adapter group steps per tick).
Per round and in rotated order, --steps decode steps of 2 rows after a short prefill each:
  base_2rows      the base model, one batch of two rows (what two base requests cost)
  one_adapter     adapter A, one batch of two rows (two requests of the same adapter)
  two_adapters    adapter A and adapter B, one row each: two batches, both stepped every tick (the lane's groups)
Reported: aggregate tok/s (2 tokens per tick) and the tick time ratio two_adapters / one_adapter.

    python bench/adapters_cost.py [--rounds 3] [--steps 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, ensure_blas_here, preflight, run_record, spread, write_result  # noqa: E402


def run(batches_rows, steps: int) -> float:
    """batches_rows: [(model, [prompt, ...]), ...]; returns aggregate tok/s over `steps` ticks."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from server.engine.batch.mlx import MlxBatch
    from server.engine.batch.protocol import Row

    batches = []
    for model, prompts in batches_rows:
        b = MlxBatch(model, clear_cache=False)
        rows = []
        for p in prompts:
            c = make_prompt_cache(model)
            mx.eval(model(mx.array([p[:-1]]), cache=c))
            rows.append(Row(object(), c, list(p)))
        b.add(rows)
        batches.append(b)
    for b in batches:
        b.step()  # the pipelined first step
    t0 = time.perf_counter()
    for _ in range(steps):
        for b in batches:
            b.step()
    dt = time.perf_counter() - t0
    rows = sum(len(p) for _, p in batches_rows)
    return rows * steps / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench/results/adapters_cost.json"))
    args = ap.parse_args()
    ensure_blas_here()
    import mlx.core as mx

    from models import load_model
    from models.loading.adapters import load_adapter
    from tests.fixtures.adapters import write_random_adapter

    pf = preflight()
    loaded = load_model("default", progress=False)
    tmp = Path(tempfile.mkdtemp(prefix="mlx-lane-bench-adapters-"))
    a = load_adapter(loaded, "a", write_random_adapter(loaded.path, tmp / "a", 1, rank=8, num_layers=16))
    b = load_adapter(loaded, "b", write_random_adapter(loaded.path, tmp / "b", 2, rank=8, num_layers=16))
    p1 = loaded.tokenizer.encode("Explain what a prefix cache does for a coding agent, in detail.")
    p2 = loaded.tokenizer.encode("Write a short poem about batching requests on a small CPU.")
    kinds = {
        "base_2rows": [(loaded.model, [p1, p2])],
        "one_adapter": [(a.model, [p1, p2])],
        "two_adapters": [(a.model, [p1]), (b.model, [p2])],
    }
    s = mx.new_stream(mx.default_device())
    res = {k: [] for k in kinds}
    with mx.stream(s):
        run(kinds["one_adapter"], 4)  # warm-up
        names = list(kinds)
        for r in range(args.rounds):
            for k in names[r % 3:] + names[: r % 3]:
                res[k].append(run(kinds[k], args.steps))
                print(f"round {r} {k}: {res[k][-1]:.2f} tok/s", file=sys.stderr)
    ratio = [o / t for o, t in zip(res["one_adapter"], res["two_adapters"])]
    write_result({**run_record(), "preflight": pf, "preflight_after": preflight(),
                  "config": {"rounds": args.rounds, "steps": args.steps, "rank": 8, "lora_layers": 16,
                             "model": loaded.model_id},
                  "tok_s": {k: spread(v) for k, v in res.items()},
                  "tick_time_two_over_one": spread(ratio),
                  "adapter_over_base": spread([o / b_ for o, b_ in zip(res["one_adapter"], res["base_2rows"])])},
                 args.out)


if __name__ == "__main__":
    main()
