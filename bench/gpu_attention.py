"""A decode batch's attention on the H200 (issue 22): models.attention.gpu's fused kernel over rows of different
lengths vs the masked path mlx-lm's batch takes today (MLX's CUDA backend has no fused kernel for an array mask at
decode time, so it runs the unfused fallback).

Three parts, in-process, random data / a random Llama-3-8B-shaped bf16 model (bench/gpu_write_cost.build):

  check    the kernel against a float32 masked reference (``models.attention.gpu.reference_attention``) for several
           shapes: grouped heads (32 over 8, 9 over 3, 64 over 8), head sizes 128 and 64, widths 1 and 5 (a verify
           step), rows of very different lengths, left-padded rows, gpt-oss's 128-token windows and attention sinks;
           and prompt chunks of 5-330 tokens through the kernel with its width read at run time
           (``runtime_width``, `--debug-gpu-attention-prefill-max`), head sizes 64, 128 and 256, alone and
           together; max |difference| per shape (bf16 output: <= 0.02)
  attention  one layer's attention alone, median ms: the kernel vs ``mx.fast.scaled_dot_product_attention`` with
           the batch's bool mask (what every layer runs now) vs the same without a mask over rows of one length
           (MLX's own fused vector kernel: what a batch could cost if MLX had a ragged kernel)
  accuracy one decode step of the whole model from the same KV: bf16 with the kernel and bf16 masked, each against
           float32 weights and KV (masked): which is nearer, and how often its argmax agrees
  step     one batched forward of 1 token per row + argmax over the whole model, rows of ~--context tokens, in
           mlx-lm's left-padded BatchKVCache and in our RaggedKV, with the kernel and without (mlx-lm's path)
  sweep    the kernel's knobs (``UNROLL`` key groups a warp loads per round x ``SPLIT`` keys per block, set through
           ``models.attention.gpu.configure``) over the attention shapes that matter (16 / 32 rows x 5.5k, 32 x 1k,
           8 x 32k, a width-5 verify step), each configuration checked against the reference first: which one the
           defaults should be

--split / --unroll set the knobs of the other parts (the server's `--debug-gpu-attention-split` /
`--debug-gpu-attention-unroll`; default: the kernel's defaults).

    OUT=$OUT bash bench/gpu.sh bench/gpu_attention.py                   # H200 (gpu.sh installs the carried wheels)
    python bench/gpu_attention.py --parts check                         # anywhere else: says it needs CUDA

Writes OUT/gpu_attention.json.
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

import mlx.core as mx  # noqa: E402

from models.attention import gpu as ga  # noqa: E402

R: dict = {"script": "bench/gpu_attention.py", "argv": sys.argv[1:], "started_unix": int(time.time())}


def median_ms(fn, reps: int) -> float:
    out = []
    for i in range(reps + 3):
        mx.synchronize()
        t = time.perf_counter()
        fn()
        mx.synchronize()
        if i >= 3:
            out.append(time.perf_counter() - t)
    return round(statistics.median(out) * 1e3, 4)


def qkv(B, H, KV, S, D, W, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, W, H, D)).astype(mx.bfloat16).transpose(0, 2, 1, 3)  # strided, as after RoPE
    k = mx.random.normal((B, KV, S + 64, D)).astype(mx.bfloat16)[:, :, :S, :]  # a view into a larger buffer
    v = mx.random.normal((B, KV, S + 64, D)).astype(mx.bfloat16)[:, :, :S, :]
    mx.eval(q, k, v)
    return q, k, v


def part_check() -> dict:
    cases = [  # (B, H, KV, D, W, starts, lasts-or-None (None: S - W for every row), window, sinks)
        (4, 32, 8, 128, 1, [0, 0, 0, 0], [4999, 17, 2047, 300], 0, False),
        (3, 32, 8, 128, 5, [0, 0, 0], [1000, 1995, 5], 0, False),
        (5, 9, 3, 64, 1, [0, 3, 100, 255, 0], None, 0, False),
        (2, 8, 8, 128, 3, [10, 0], None, 0, False),
        (16, 32, 8, 128, 1, [0] * 16, [5400 - 37 * r for r in range(16)], 0, False),
        # gpt-oss: 64 heads over 8 of size 64, 128-token windows, sinks; a verify step; rows shorter than the window
        (16, 64, 8, 64, 1, [0] * 16, [5400 - 37 * r for r in range(16)], 128, True),
        (4, 64, 8, 64, 5, [0, 0, 0, 0], [4000, 100, 17, 129], 128, True),
        (4, 64, 8, 64, 1, [0, 0, 0, 0], [4000, 100, 17, 129], 0, True),  # full layers with sinks
        # Qwen3.5's full-attention layers: 16 heads over 4 of size 256 (a whole warp per key); a verify step
        (16, 16, 4, 256, 1, [0] * 16, [5400 - 37 * r for r in range(16)], 0, False),
        (4, 16, 4, 256, 5, [0, 3, 0, 0], [4000, 100, 17, 129], 0, False),
    ]
    # prompt chunks through the kernel with its width read at run time (--debug-gpu-attention-prefill-max): a lone
    # row after a hit, rows prefilled together (left-padded starts), each head size, windows and sinks
    prefill = [
        (1, 32, 8, 128, 330, [0], [5000], 0, False),
        (1, 32, 8, 128, 16, [0], [0], 0, False),  # a cold chunk: no cached keys
        (3, 32, 8, 128, 100, [37, 0, 900], [1500, 1500, 1500], 0, False),
        (1, 64, 8, 64, 257, [0], [5200], 0, True),  # gpt-oss full layers with sinks
        (1, 64, 8, 64, 257, [0], [127], 128, True),  # its window layers: the window's last 127 keys, then the chunk
        (4, 64, 8, 64, 120, [0, 5, 60, 0], [127] * 4, 128, True),
        (1, 16, 4, 256, 200, [0], [4000], 0, False),  # Qwen3.5's full-attention layers
        (2, 32, 8, 128, 5, [0, 0], [300, 300], 0, False),  # a width the compiled-width kernel also takes
    ]
    out = []
    for (B, H, KV, D, W, starts, lasts, window, with_sinks), runtime in [*((c, False) for c in cases),
                                                                          *((c, True) for c in prefill)]:
        S = (max(lasts) if lasts else 2048 - W) + W
        if lasts is None:
            lasts = [S - W] * B
        q, k, v = qkv(B, H, KV, S, D, W)
        sinks = mx.random.normal((H,)).astype(mx.bfloat16) if with_sinks else None
        start, last = mx.array(starts, dtype=mx.int32), mx.array(lasts, dtype=mx.int32)
        got = ga.ranged_attention(q, k, v, D ** -0.5, start, last, window=window, sinks=sinks,
                                  runtime_width=runtime).astype(mx.float32)
        ref = ga.reference_attention(q, k, v, D ** -0.5, start, last, window=window, sinks=sinks).astype(mx.float32)
        err = float(mx.max(mx.abs(got - ref)).item())
        out.append({"B": B, "H": H, "KV": KV, "D": D, "W": W, "S": S, "window": window, "sinks": with_sinks,
                    "runtime_width": runtime, "max_abs_diff": err, "ok": err <= 0.02})
        print("check", out[-1], flush=True)
    return {"cases": out, "ok": all(c["ok"] for c in out)}


def part_attention(reps: int) -> list:
    rows = []
    for B, ctx, (H, KV, D) in ((8, 1024, (32, 8, 128)), (16, 1024, (32, 8, 128)), (32, 1024, (32, 8, 128)),
                               (64, 1024, (32, 8, 128)), (16, 5500, (32, 8, 128)), (32, 5500, (32, 8, 128)),
                               (8, 32000, (32, 8, 128)), (16, 5500, (16, 4, 256))):  # the last: Qwen3.5's heads
        W = 1
        lasts = [ctx - 1 - (37 * r) % 256 for r in range(B)]
        S = max(lasts) + W
        q, k, v = qkv(B, H, KV, S, D, W)
        start, last = mx.zeros((B,), dtype=mx.int32), mx.array(lasts, dtype=mx.int32)
        mask = (mx.arange(S)[None, :] <= last[:, None])[:, None, None, :]  # (B, 1, 1, S), as RaggedKV's
        mx.eval(mask)
        scale = D ** -0.5
        r = {"B": B, "context": ctx, "heads": [H, KV, D],
             "kernel_ms": median_ms(lambda: mx.eval(ga.ranged_attention(q, k, v, scale, start, last)), reps),
             "masked_sdpa_ms": median_ms(
                 lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)), reps),
             "unmasked_sdpa_ms": median_ms(
                 lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)), reps)}
        kv_bytes = sum(lasts) * KV * D * 2 * 2
        r["kernel_GBps"] = round(kv_bytes / (r["kernel_ms"] / 1e3) / 1e9, 1)
        r["kernel_over_masked"] = round(r["kernel_ms"] / r["masked_sdpa_ms"], 3)
        rows.append(r)
        print("attention", r, flush=True)
    return rows


def part_step(rows_list: list[int], context: int, reps: int) -> list:
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from gpu_spec_oracle import row_views
    from gpu_write_cost import build
    from server.engine.batch.ragged_kv import RaggedKV

    model, _ = build("llama3-8b", "bfloat16")
    switched = ga.install(model)
    wrapped = llama.scaled_dot_product_attention
    original = getattr(wrapped, "mlx_lane_original", wrapped)
    out = []
    for n in rows_list:
        mx.random.seed(1)
        ids = mx.random.randint(3, 1000, (n, context))
        cache = make_prompt_cache(model)
        llama.scaled_dot_product_attention = original
        for i in range(0, context, 2048):
            model(ids[:, i:i + 2048], cache=cache)
            mx.eval([c.state for c in cache])
        lengths = [context - 1 - (37 * r) % 256 for r in range(n)]
        rows = row_views(cache, lengths)
        tok = mx.zeros((n, 1), dtype=mx.int32)
        res = {"rows": n, "context": context, "switched_modules": switched}
        batch = [KVCache.merge([row[layer] for row in rows]) for layer in range(len(cache))]
        ragged = RaggedKV.from_rows(rows)
        mx.eval([c.state for c in batch])
        del cache

        def fwd_batch():
            mx.eval(mx.argmax(model(tok, cache=batch)[:, -1], axis=-1))
            for c in batch:
                c.trim(1)

        def fwd_ragged():
            ragged.reserve(1)
            mx.eval(mx.argmax(model(tok, cache=ragged.layers)[:, -1], axis=-1))
            ragged.commit([0] * n)  # keep nothing: the next forward writes the same columns

        for name, fn in (("mlx_layout", fwd_batch), ("ragged", fwd_ragged)):
            for attn, f in (("masked", original), ("kernel", wrapped)):
                llama.scaled_dot_product_attention = f
                res[f"{name}_{attn}_ms"] = median_ms(fn, reps)
            res[f"{name}_kernel_over_masked"] = round(res[f"{name}_kernel_ms"] / res[f"{name}_masked_ms"], 3)
        # the same tokens both ways (greedy argmax of one step from the same caches)
        a = []
        for f in (original, wrapped):
            llama.scaled_dot_product_attention = f
            logits = model(tok, cache=batch)[:, -1]
            for c in batch:
                c.trim(1)
            a.append(logits.astype(mx.float32))
        res["same_argmax"] = bool(mx.all(mx.argmax(a[0], -1) == mx.argmax(a[1], -1)).item())
        res["max_logit_diff"] = float(mx.max(mx.abs(a[0] - a[1])).item())
        llama.scaled_dot_product_attention = wrapped
        out.append(res)
        print("step", res, flush=True)
        del batch, ragged, rows
        mx.clear_cache()
    return out


def part_sweep(reps: int) -> list:
    shapes = ((16, 5500, 1), (32, 5500, 1), (32, 1024, 1), (8, 32000, 1), (32, 1024, 5))
    data = {}
    for B, ctx, W in shapes:
        H, KV, D = 32, 8, 128
        lasts = [ctx - W - (37 * r) % 256 for r in range(B)]
        q, k, v = qkv(B, H, KV, max(lasts) + W, D, W)
        data[(B, ctx, W)] = (q, k, v, mx.zeros((B,), dtype=mx.int32), mx.array(lasts, dtype=mx.int32),
                             sum(lasts) * KV * D * 2 * 2)
    rows = []
    defaults = (ga.UNROLL, ga.SPLIT)
    try:
        for unroll in (1, 2, 4, 8):
            for split in (128, 256, 512):
                ga.configure(True, split=split, unroll=unroll)
                r = {"unroll": unroll, "split": split}
                for (B, ctx, W), (q, k, v, start, last, kv_bytes) in data.items():
                    scale = 128 ** -0.5
                    got = ga.ranged_attention(q, k, v, scale, start, last)
                    diff = mx.max(mx.abs(got.astype(mx.float32) - ga.reference_attention(
                        q, k, v, scale, start, last).astype(mx.float32))).item()
                    ms = median_ms(lambda: mx.eval(ga.ranged_attention(q, k, v, scale, start, last)), reps)
                    r[f"{B}x{ctx}w{W}"] = {"ms": ms, "GBps": round(kv_bytes / (ms / 1e3) / 1e9, 1),
                                           "max_abs_diff": diff, "ok": diff <= 0.02}
                rows.append(r)
                print("sweep", r, flush=True)
    finally:
        ga.configure(True, split=defaults[1], unroll=defaults[0])
    return rows


def part_accuracy(n: int, context: int) -> dict:
    """One decode step of the whole random model from the same KV, three ways: bf16 with the kernel, bf16 with the
    masked path (MLX's fallback), and float32 weights + float32 KV with the masked path (the reference). Which of the
    two bf16 ways is nearer the float32 logits, and how often its argmax agrees."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    from gpu_write_cost import build
    from server.engine.batch.ragged_kv import RaggedKV

    model, _ = build("llama3-8b", "bfloat16")
    ga.install(model)
    wrapped = llama.scaled_dot_product_attention
    original = getattr(wrapped, "mlx_lane_original", wrapped)
    model32, _ = build("llama3-8b", "bfloat16")
    model32.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())]))
    mx.eval(model32.parameters())
    mx.random.seed(2)
    lengths = [context - 1 - (97 * r) % (context // 2) for r in range(n)]
    rows = []
    llama.scaled_dot_product_attention = original
    for m in lengths:  # each row prefilled alone in bf16 (cuDNN), as the server's rows are
        own = [KVCache() for _ in model.layers]
        model(mx.random.randint(3, 1000, (1, m)), cache=own)
        mx.eval([c.state for c in own])
        rows.append(own)
    tok = mx.random.randint(3, 1000, (n, 1))

    def step(mdl, dtype, attn):
        kv = RaggedKV.from_rows([[_cast(c, dtype) for c in row] for row in rows])
        kv.reserve(1)
        llama.scaled_dot_product_attention = attn
        out = mdl(tok, cache=kv.layers)[:, -1].astype(mx.float32)
        mx.eval(out)
        return out

    ref = step(model32, mx.float32, original)
    got = {"kernel": step(model, mx.bfloat16, wrapped), "masked": step(model, mx.bfloat16, original)}
    llama.scaled_dot_product_attention = wrapped
    top = mx.argmax(ref, axis=-1)
    res = {"rows": n, "lengths": [min(lengths), max(lengths)]}
    for name, lg in got.items():
        res[f"{name}_max_abs_vs_fp32"] = round(float(mx.max(mx.abs(lg - ref)).item()), 4)
        res[f"{name}_mean_abs_vs_fp32"] = round(float(mx.mean(mx.abs(lg - ref)).item()), 5)
        res[f"{name}_argmax_agrees_with_fp32"] = int(mx.sum(mx.argmax(lg, axis=-1) == top).item())
    print("accuracy", res, flush=True)
    del model32
    mx.clear_cache()
    return res


def _cast(c, dtype):
    from mlx_lm.models.cache import KVCache

    out = KVCache()
    n = c.offset
    out.keys, out.values, out.offset = c.keys[..., :n, :].astype(dtype), c.values[..., :n, :].astype(dtype), n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--parts", default="check,attention,step", help="any of check, attention, accuracy, sweep, step")
    ap.add_argument("--rows", default="16,32")
    ap.add_argument("--context", type=int, default=5500)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--split", type=int, default=ga.SPLIT, help="the kernel's key positions per block of its first "
                    "pass (the server's --debug-gpu-attention-split)")
    ap.add_argument("--unroll", type=int, default=ga.UNROLL, help="key groups a warp loads per round (the server's "
                    "--debug-gpu-attention-unroll)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    ga.configure(True, split=args.split, unroll=args.unroll)
    if not ga.enabled():
        print("bench/gpu_attention.py needs MLX's CUDA backend", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    R["mlx"] = mx.__version__
    t0 = time.perf_counter()

    def save():
        R["wall_s"] = round(time.perf_counter() - t0, 1)
        (out / "gpu_attention.json").write_text(json.dumps(R, indent=1))

    if "check" in parts:
        R["check"] = part_check()
        save()
    if "attention" in parts:
        R["attention"] = part_attention(args.reps)
        save()
    if "accuracy" in parts:
        R["accuracy"] = part_accuracy(16, 3000)
        save()
    if "sweep" in parts:
        R["sweep"] = part_sweep(args.reps)
        save()
    if "step" in parts:
        R["step"] = part_step([int(x) for x in args.rows.split(",")], args.context, max(5, args.reps // 2))
        save()
    return 0 if R.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
