"""A hybrid's prompts prefilled one at a time vs in one batched forward, on a GPU (issue 35).

mlx-lm's gated delta-net (Qwen3.5, Qwen3-Next) has a Metal kernel; elsewhere (CUDA, the CPU) it steps through the
prompt token by token in Python (``gated_delta_ops``), so a prompt's prefill costs per token far more than its
matrix work, and one forward over B prompts pays that loop once instead of B times. This measures prompt tokens per
second for --rows prompts of --prompt-tokens tokens, computed one prompt per forward (what a hybrid got before) and
in one ``PromptProcessingBatch`` forward (what ``--prefill-batch`` gives it now), alternated, in one process.

    bash bench/gpu.sh bench/gpu_hybrid_prefill.py --shape qwen3.5-9b          # the H200 (~1 min after the wheels)
    python bench/gpu_hybrid_prefill.py --shape qwen3.5-tiny --dtype float32 --prompt-tokens 64   # a CPU check

Writes OUT/gpu_hybrid_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu  # noqa: E402
from gpu_window_solo import build  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    model, _ = build(args.shape, args.dtype)
    print(f"built {args.shape} in {time.perf_counter() - t0:.1f}s", flush=True)
    prompts = [[(7 * i + 13 * r + 3) % 40000 + 100 for i in range(args.prompt_tokens)] for r in range(args.rows)]
    total = args.rows * args.prompt_tokens

    def one_at_a_time() -> float:
        t = time.perf_counter()
        for p in prompts:
            caches = make_prompt_cache(model)
            model(mx.array(p)[None], cache=caches)
            mx.eval([c.state for c in caches])
        return total / (time.perf_counter() - t)

    def together() -> float:
        t = time.perf_counter()
        batch = PromptProcessingBatch(model, list(range(args.rows)), [make_prompt_cache(model) for _ in prompts],
                                      tokens=[[] for _ in prompts], prefill_step_size=args.prompt_tokens)
        batch.prompt([list(p) for p in prompts])
        caches = [batch.extract_cache(i) for i in range(args.rows)]
        mx.eval([c.state for row in caches for c in row])
        return total / (time.perf_counter() - t)

    runs = {"one_at_a_time": one_at_a_time, "together": together}
    for f in runs.values():
        f()  # warm-up
    rates: dict = {k: [] for k in runs}
    for r in range(args.rounds):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            rates[k].append(round(runs[k](), 1))
        print(f"round {r + 1}: " + "  ".join(f"{k} {rates[k][-1]:.1f} tok/s" for k in runs), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"shape": args.shape, "dtype": args.dtype, "rows": args.rows, "prompt_tokens": args.prompt_tokens,
              "device": str(mx.default_device()), "prompt_tok_s": rates, "median": med,
              "together_over_one_at_a_time": round(med["together"] / med["one_at_a_time"], 2)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_hybrid_prefill.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"median": med, "ratio": result["together_over_one_at_a_time"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
