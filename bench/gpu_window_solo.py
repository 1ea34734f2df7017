"""One sliding-window request decoding alone on a GPU: which decoder (issue 35).

A window row whose solo decoder runs a forward ahead (mlx-lm's ``generate_step``) cannot hand its caches to a batch
once the window wrapped, so the lane starts such a row in its group's batch even alone (``Sequence.strands_solo``);
the other way to keep it joinable is a solo decoder that runs nothing ahead (``PlainDecode(pipelined=False)``, what
the CPU does). This measures the three on one prompt, in one process, alternated:

  ahead     PlainDecode pipelined (mlx-lm's generate_step): what a lone row got before
  one       PlainDecode not pipelined: each token fed when the next is asked for
  batch1    mlx-lm's GenerationBatch with one row (server.engine.batch.mlx.MlxBatch)

    bash bench/gpu.sh bench/gpu_window_solo.py --shape gpt-oss-20b      # the H200 (~1 min after the wheels)
    python bench/gpu_window_solo.py --shape gpt-oss-tiny --dtype float32 --tokens 32   # logic check on a CPU

Writes OUT/gpu_window_solo.json.
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


def build(shape: str, dtype: str):
    from mlx_lm.utils import _get_classes

    cfg = gpu.shape_config(shape, dtype)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    gpu.random_weights(model, dtype)
    return model, cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="gpt-oss-20b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    from server.engine.batch.mlx import MlxBatch
    from server.engine.batch.protocol import Row
    from server.engine.batch.rules import LogitsRules
    from server.engine.batch.solo import PlainDecode
    from server.lane.events import SamplingParams

    t0 = time.perf_counter()
    model, cfg = build(args.shape, args.dtype)
    print(f"built {args.shape} in {time.perf_counter() - t0:.1f}s", flush=True)
    stream = mx.new_stream(mx.default_device())
    prompt = [(7 * i + 3) % 40000 + 100 for i in range(args.prompt_tokens)]

    def prefilled():
        caches = make_prompt_cache(model)
        with mx.stream(stream):
            model(mx.array(prompt[:-1])[None], cache=caches)
            mx.eval([c.state for c in caches])
        return caches

    def solo(pipelined: bool) -> float:
        caches = prefilled()
        dec = PlainDecode(model, caches, prompt, max_tokens=args.tokens, sampler=greedy_sampler,
                          processors_for=lambda h: [], stream=stream, pipelined=pipelined)
        t = time.perf_counter()
        with mx.stream(stream):
            n = sum(1 for _ in dec)
        return n / (time.perf_counter() - t)

    def batch1() -> float:
        from types import SimpleNamespace

        caches = prefilled()
        seq = SimpleNamespace(params=SamplingParams(max_tokens=args.tokens))
        batch = MlxBatch(model, clear_cache=True)
        with mx.stream(stream):
            batch.add([Row(seq=seq, caches=caches, history=tuple(prompt), rules=LogitsRules.of(seq.params, None),
                           sampler=None)])
            t = time.perf_counter()
            for _ in range(args.tokens):
                batch.step()
            rate = args.tokens / (time.perf_counter() - t)
            batch.remove([seq])
        return rate

    runs = {"ahead": lambda: solo(True), "one": lambda: solo(False), "batch1": batch1}
    for f in runs.values():  # warm-up: every shape compiled once
        f()
    rates: dict = {k: [] for k in runs}
    for r in range(args.rounds):
        order = list(runs)[r % 3:] + list(runs)[: r % 3]
        for k in order:
            rates[k].append(round(runs[k](), 1))
        print(f"round {r + 1}: " + "  ".join(f"{k} {rates[k][-1]:.1f} tok/s" for k in runs), flush=True)
    result = {"shape": args.shape, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "device": str(mx.default_device()), "tok_s": rates,
              "median": {k: statistics.median(v) for k, v in rates.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_window_solo.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["median"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
