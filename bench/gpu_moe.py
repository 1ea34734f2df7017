"""A mixture-of-experts block on the device, sorted or not (issue 43): what mlx-lm's ``SwitchGLU`` costs at the row
counts a decode batch and a prompt chunk give it.

mlx-lm's ``SwitchGLU`` gathers each (token, expert) pair's weights with ``mx.gather_mm``. From 64 pairs on
(``indices.size >= 64``: 16 decode rows of gpt-oss's 4 experts a token) it first sorts the pairs by expert, so that a
grouped GEMM reads each expert's weights once for all the tokens routed to it; below that each pair is its own
matrix-vector product, and two pairs routed to one expert read its weights twice. A served gpt-oss decode step of
15.3 rows (61 pairs, unsorted) took 26.8 ms on the H200 where its bytes allow ~7.7 (BENCHMARKS.md, 2026-12-05).

This builds one gpt-oss-20b MoE block (``mlx_lm.models.gpt_oss.MLPBlock``: router, top-4 of 32 experts, SwiGLU with
biases; random bf16 weights) with the server's MoE call (``models.kernels.moe``) and times its forward, median of
--reps, for decode batches of M rows (x of shape (M, 1, hidden)) and prompt chunks (1 or 8 rows of L tokens), with
the knobs set four ways:

  mlx_lm     as mlx-lm runs it (sorted from 64 pairs: the server's default)
  sorted     always sorted (`--debug-moe-sort-min 1`: a grouped GEMM per projection)
  unsorted   never sorted (a gathered product per pair)
  dense      `--debug-moe-dense-max` (up to --dense-max tokens, default all): every expert for every token as
             batched matrix products (all experts' weights read once, 8x the arithmetic of top-4 of 32), then each
             token's top-4 outputs taken: no gather at all

and states the block's bandwidth limit: the bytes of the distinct experts the batch's pairs touch (gate, up and down
projections with their biases) at --bandwidth GB/s. Every mode's output is compared with mlx_lm's (max |diff|).

    OUT=$OUT bash bench/gpu.sh bench/gpu_moe.py                          # the device
    python bench/gpu_moe.py --hidden 256 --experts 8 --reps 3 --dtype float32   # the CPU: logic only
                                                                          # (the CPU's gather_mm: float32 only)

Writes OUT/gpu_moe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.gpt_oss import MLPBlock, ModelArgs

from models.kernels import moe

MODES = ("mlx_lm", "sorted", "unsorted", "dense")


# each mode as (moe.SORT_MIN, moe.DENSE_MAX): the server's own MoE call (models.kernels.moe) set as the knobs would
RULES = {"mlx_lm": (moe.MLX_LM_SORT_MIN, 0), "sorted": (1, 0), "unsorted": (1 << 30, 0), "dense": (1, 1 << 30)}


def time_block(block, x, reps: int) -> float:
    """Median ms of one forward, evaluated (two unmeasured first: kernels compiled, buffers allocated)."""
    for _ in range(2):
        mx.eval(block(x))
    times = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(block(x))
        mx.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def touched_bytes(block, x) -> int:
    """Bytes of the distinct experts ``x``'s tokens are routed to: gate, up, down weights and biases."""
    g = block.router(x)
    k = block.num_experts_per_tok
    idx = mx.argpartition(g, kth=-k, axis=-1)[..., -k:]  # as mlx_lm.models.gpt_oss.mlx_topk picks them
    routed: list = idx.flatten().tolist()  # type: ignore[assignment]
    distinct = len(set(routed))
    per_expert = sum(p.weight[0].nbytes + p.bias[0].nbytes
                     for p in (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj))
    return distinct * per_expert


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".bench/gpu-out")
    p.add_argument("--hidden", type=int, default=2880, help="gpt-oss-20b: 2880 (hidden and expert size)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top", type=int, default=4)
    p.add_argument("--decode-rows", default="1,4,8,12,15,16,24,32")
    p.add_argument("--chunks", default="1x330,8x330,1x2048", help="ROWSxLENGTH prompt chunks")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dense-max", type=int, default=4096, help="tokens up to which the dense mode is timed")
    p.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s (H200: 4800, H100 SXM: 3350)")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()

    dtype = getattr(mx, args.dtype)
    cfg = ModelArgs(model_type="gpt_oss", hidden_size=args.hidden, intermediate_size=args.hidden,
                    num_local_experts=args.experts, num_experts_per_tok=args.top, num_hidden_layers=1,
                    num_attention_heads=8, num_key_value_heads=8, head_dim=64, vocab_size=32)
    mx.random.seed(0)
    block = MLPBlock(cfg)
    block.update(tree_map(lambda a: (mx.random.normal(a.shape) * 0.02).astype(dtype), block.parameters()))
    mx.eval(block.parameters())

    shapes = [(int(m), 1) for m in args.decode_rows.split(",")]
    shapes += [(int(c.split("x")[0]), int(c.split("x")[1])) for c in args.chunks.split(",") if c]
    assert moe.switch(block) == 1  # block.experts: models.kernels.moe's class, its rule set per mode below
    rows = []
    for b, n in shapes:
        x = (mx.random.normal((b, n, args.hidden)) * 0.5).astype(dtype)
        row = {"rows": b, "length": n, "pairs": b * n * args.top}
        ref = None
        for mode in MODES:
            if mode == "dense" and b * n > args.dense_max:
                continue
            moe.SORT_MIN, moe.DENSE_MAX = RULES[mode]
            out = block(x)
            mx.eval(out)
            ref = out if ref is None else ref
            row[f"{mode}_ms"] = round(time_block(block, x, args.reps), 3)
            row[f"{mode}_max_diff"] = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))))
        nbytes = touched_bytes(block, x)
        row["touched_mb"] = round(nbytes / 1e6, 1)
        row["limit_ms"] = round(nbytes / (args.bandwidth * 1e9) * 1e3, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"script": "bench/gpu_moe.py", "argv": vars(args), "device": str(mx.default_device()),
              "mlx": getattr(mx, "__version__", "?"), "rows": rows}
    (out_dir / "gpu_moe.json").write_text(json.dumps(result, indent=1))
    print(f"{'rows x len':>11} {'pairs':>6} " + " ".join(f"{m + ' ms':>12}" for m in MODES) + f" {'limit ms':>9}")
    for r in rows:
        cells = " ".join(f"{r[m + '_ms']:>12.3f}" if m + "_ms" in r else f"{'-':>12}" for m in MODES)
        print(f"{r['rows']:>5} x {r['length']:<4} {r['pairs']:>6} {cells} {r['limit_ms']:>9.3f}")


if __name__ == "__main__":
    main()
