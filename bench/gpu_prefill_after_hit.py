"""What a prompt's chunk costs after a cache hit, in-process, no server (issue 43): the model's own rate.

The agent workload's later turns each prefill a few hundred new tokens over a cached conversation of ~5k. On the
H200 the lane computed those at ~2k tok/s for gpt-oss-20b (bench/gpu_agents.py, lane prefill seconds over uncached
tokens) and ~1.7k for the Qwen3.5-9B hybrid, against 22.5k for one long cold prompt. This measures what the model
itself does for such chunks, so the lane's share can be told from the model's:

  solo L+N       one row: a cache of L tokens (computed untimed), then an N-token chunk over it (median of --reps;
                 the first rep of a shape is left out: it pays that shape's one-time costs)
  new shapes     the same, each rep a length (L + r, N + r) this process has not seen, as agents' turns are: what a
                 shape's first forward costs (MLX's CUDA backend builds a cuDNN attention graph per (query, key)
                 shape, mlx 0.32 ``scaled_dot_product_attention.cpp``; MLX_CUDA_USE_CUDNN_SDPA=0 turns that off)
  together B     B rows at once over their own caches of L + 37*i tokens (ragged, as agents are), the same N-token
                 chunk each, in one mlx-lm ``PromptProcessingBatch`` forward (left-padded, an array mask), vs the
                 same B chunks one row at a time
Rates are new tokens per second of that chunk. ``--lane-attention N`` installs the server's CUDA attention
(models.attention.gpu: the fused decode kernel, and steps of 2..N queries past cached keys composed of plain ops
instead of cuDNN, models.attention.composed); without it the model runs mlx-lm's (cuDNN for every chunk).
``--lane-prefill-max N`` installs it too, with a lone row's chunks of 9..N tokens through the fused kernel (its width
read at run time: `--debug-gpu-attention-prefill-max`), times the same chunks again with cuDNN in the same process
(``solo_cudnn``), and checks the kernel's logits against cuDNN's.

    bash bench/gpu.sh bench/gpu_prefill_after_hit.py --model-dir DIR --chunks 128,330,1024 --lane-prefill-max 2048

    bash bench/gpu.sh bench/gpu_prefill_after_hit.py --model-dir /dev/shm/mlx-lane-agents-model   # after gpu_agents
    python bench/gpu_prefill_after_hit.py --shape gpt-oss-tiny --dtype float32 --context 300 --chunks 16,64 --rows 3

Writes OUT/gpu_prefill_after_hit.json.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--model-dir", default=None, help="a model directory (e.g. the one bench/gpu_agents.py built)")
    ap.add_argument("--shape", default="gpt-oss-20b", choices=sorted(gpu.SHAPES), help="built when no --model-dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=5000, help="L: the cached tokens before the chunk")
    ap.add_argument("--chunks", default="128,330,1024", help="N: comma list of chunk lengths after the hit")
    ap.add_argument("--rows", type=int, default=8, help="B for the together case")
    ap.add_argument("--together-chunk", type=int, default=330)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lane-attention", type=int, default=None, metavar="N",
                    help="install models.attention.gpu with --debug-gpu-attention-composed-max N (0: cuDNN always)")
    ap.add_argument("--lane-prefill-max", type=int, default=None, metavar="N",
                    help="install models.attention.gpu with --debug-gpu-attention-prefill-max N: a lone row's "
                         "chunks of 9..N tokens through the fused kernel; its logits checked against cuDNN's")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    if args.model_dir:
        from mlx_lm import load

        model = load(args.model_dir)[0]
        what = args.model_dir
    else:
        from gpu_window_solo import build

        model, _ = build(args.shape, args.dtype)
        what = args.shape
    from models import kernels

    kernels.install(model)  # as the server does: models.kernels' gated delta rule / Mamba-2 step on CUDA and the CPU
    composed_max = 8 if args.lane_attention is None else args.lane_attention  # the server's default: 8
    if args.lane_attention is not None or args.lane_prefill_max is not None:
        from models.attention import gpu as lane_attention

        lane_attention.configure(True, composed_max=composed_max, prefill_max=args.lane_prefill_max or 0)
        print(f"lane attention: {lane_attention.install(model)} modules switched, composed up to "
              f"{composed_max} queries, prompt chunks of 9..{args.lane_prefill_max or 0} in the kernel", flush=True)
    mx.eval(model.parameters())
    print(f"model {what} ready in {time.perf_counter() - t0:.1f}s on {mx.default_device()}", flush=True)

    def tokens(n: int, seed: int) -> list[int]:
        return [(7 * i + 13 * seed + 3) % 40000 + 100 for i in range(n)]

    def cache_of(length: int, seed: int) -> list:
        caches = make_prompt_cache(model)
        for s in range(0, length, 2048):  # as the lane prefills: 2048-token chunks
            model(mx.array(tokens(length, seed)[s: s + 2048])[None], cache=caches)
            mx.eval([c.state for c in caches])
        return caches

    def solo(length: int, n: int, seed: int) -> float:  # seconds of the N-token chunk alone
        caches = cache_of(length, seed)
        mx.synchronize()
        t = time.perf_counter()
        model(mx.array(tokens(n, seed + 1))[None], cache=caches)
        mx.eval([c.state for c in caches])
        return time.perf_counter() - t

    import os

    R: dict = {"cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1"), "lane_attention": args.lane_attention,
               "lane_prefill_max": args.lane_prefill_max, "model": what, "device": str(mx.default_device()), "context": args.context, "solo": {}, "together": {}}
    solo(args.context, 64, 99)  # warm-up: the kernels of a chunk over a cache

    def solo_table(key: str, label: str) -> None:
        R[key] = {}
        for n in [int(x) for x in args.chunks.split(",")]:
            first = solo(args.context, n, 0)  # this shape's first forward
            times = [solo(args.context, n, r) for r in range(1, args.reps + 1)]
            cold_first = solo(0, n, 0)
            cold = [solo(0, n, r) for r in range(1, args.reps + 1)]
            new = [solo(args.context + 3 + r, n + 1 + r, r) for r in range(args.reps)]  # shapes never seen
            R[key][str(n)] = {"after_hit_first_s": first, "after_hit_s": times,
                              "after_hit_tok_s": round(n / statistics.median(times), 1),
                              "cold_first_s": cold_first, "cold_s": cold,
                              "cold_tok_s": round(n / statistics.median(cold), 1),
                              "new_shape_s": new, "new_shape_tok_s": round(n / statistics.median(new), 1)}
            print(f"{label} N={n}: after {args.context} cached {R[key][str(n)]['after_hit_tok_s']} tok/s "
                  f"(first {first * 1e3:.0f} ms, later {statistics.median(times) * 1e3:.0f} ms, each a new shape "
                  f"{statistics.median(new) * 1e3:.0f} ms), cold {R[key][str(n)]['cold_tok_s']} tok/s", flush=True)

    solo_table("solo", "solo")
    if args.lane_prefill_max:  # the same chunks with cuDNN's plans, in the same process (its shapes are new to cuDNN)
        from models.attention import gpu as lane_attention

        lane_attention.configure(True, composed_max=composed_max,
                                 prefill_max=0)
        solo_table("solo_cudnn", "solo, cuDNN")
        lane_attention.configure(True, composed_max=composed_max,
                                 prefill_max=args.lane_prefill_max)

    if args.lane_attention:  # the composed path's logits against cuDNN's for the same chunk over the same cache
        from models.attention import composed

        def logits(composed_max: int) -> mx.array:
            composed.configure(composed_max)
            caches = cache_of(args.context, 7)
            out = model(mx.array(tokens(330, 8))[None], cache=caches)[0].astype(mx.float32)
            mx.eval(out)
            return out

        ours, theirs = logits(args.lane_attention), logits(0)
        composed.configure(args.lane_attention)
        R["composed_vs_cudnn"] = {"max_abs_logit_diff": mx.abs(ours - theirs).max().item(),
                                  "argmax_agree": mx.mean(ours.argmax(-1) == theirs.argmax(-1)).item()}
        print(f"composed vs cuDNN, 330 tokens after {args.context}: {R['composed_vs_cudnn']}", flush=True)

    if args.lane_prefill_max:  # the fused kernel's logits against cuDNN's for the same chunks over the same cache
        from models.attention import gpu as lane_attention

        def chunk_logits(n: int, prefill_max: int) -> mx.array:
            lane_attention.configure(True, composed_max=composed_max,
                                     prefill_max=prefill_max)
            caches = cache_of(args.context, 7)
            out = model(mx.array(tokens(n, 8))[None], cache=caches)[0].astype(mx.float32)
            mx.eval(out)
            return out

        R["kernel_vs_cudnn"] = {}
        for n in [int(x) for x in args.chunks.split(",") if 8 < int(x) <= args.lane_prefill_max]:
            ours, theirs = chunk_logits(n, args.lane_prefill_max), chunk_logits(n, 0)
            R["kernel_vs_cudnn"][str(n)] = {"max_abs_logit_diff": mx.abs(ours - theirs).max().item(),
                                            "argmax_agree": mx.mean(ours.argmax(-1) == theirs.argmax(-1)).item()}
        lane_attention.configure(True, composed_max=composed_max,
                                 prefill_max=args.lane_prefill_max)
        print(f"fused kernel vs cuDNN after {args.context} cached: {R['kernel_vs_cudnn']}", flush=True)

    B, n = args.rows, args.together_chunk
    lengths = [args.context + 37 * i for i in range(B)]

    def together(shift: int = 0) -> float:  # shift > 0: lengths and chunk this process has not seen
        rows = [cache_of(L + shift, i) for i, L in enumerate(lengths)]
        m = n + shift
        mx.synchronize()
        t = time.perf_counter()
        batch = PromptProcessingBatch(model, list(range(B)), rows, tokens=[[] for _ in rows], prefill_step_size=m)
        batch.prompt([tokens(m, 50 + i) for i in range(B)])
        caches = [batch.extract_cache(i) for i in range(B)]
        mx.eval([c.state for row in caches for c in row])
        return time.perf_counter() - t

    def one_by_one(shift: int = 0) -> float:
        rows = [cache_of(L + shift, i) for i, L in enumerate(lengths)]
        m = n + shift
        mx.synchronize()
        t = time.perf_counter()
        for i, caches in enumerate(rows):
            model(mx.array(tokens(m, 50 + i))[None], cache=caches)
            mx.eval([c.state for c in caches])
        return time.perf_counter() - t

    together()  # warm-up: these shapes' one-time costs
    one_by_one()
    runs: dict = {"together": [], "one_by_one": [], "together_new": [], "one_by_one_new": []}
    for r in range(args.reps):
        for name in (["together", "one_by_one"] if r % 2 == 0 else ["one_by_one", "together"]):
            fn = together if name == "together" else one_by_one
            runs[name].append(fn())
            runs[name + "_new"].append(fn(2 * r + 1 + (name == "together")))  # never the same shapes twice
    med = {k: statistics.median(v) for k, v in runs.items()}
    R["together"] = {"rows": B, "chunk": n, "lengths": lengths, "seconds": runs,
                     "together_tok_s": round(B * n / med["together"], 1),
                     "one_by_one_tok_s": round(B * n / med["one_by_one"], 1),
                     "together_over_one_by_one_time": round(med["together"] / med["one_by_one"], 3),
                     "new_shapes_together_over_one_by_one_time": round(med["together_new"] / med["one_by_one_new"], 3)}
    print(f"together B={B} N={n}: same shapes {med['together'] * 1e3:.0f} ms vs one by one "
          f"{med['one_by_one'] * 1e3:.0f} ms; new shapes {med['together_new'] * 1e3:.0f} vs "
          f"{med['one_by_one_new'] * 1e3:.0f} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_prefill_after_hit{args.tag}.json").write_text(json.dumps(R, indent=1))
    print(json.dumps({"solo": {k: (v["after_hit_tok_s"], v["new_shape_tok_s"], v["cold_tok_s"]) for k, v in R["solo"].items()},
                      "together": R["together"]["together_over_one_by_one_time"],
                      "together_new_shapes": R["together"]["new_shapes_together_over_one_by_one_time"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
