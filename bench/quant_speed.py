"""CPU speed of quantized weights: decode and prefill tok/s of float32 vs 8-bit vs 4-bit, raw mlx-lm, alternated.

Each configuration is made with `mlx-lane quantize`'s code path (models.quant.quantize.quantize_dir, group 64) into a
temporary directory; every round runs every configuration (order rotated): a --prompt-tokens prefill timed to the
first token, then --tokens greedy decode steps (EOS banned). MLX's quantized matmuls on this CPU are expected to be
slower than float32 with OpenBLAS: this measures by how much.

    python bench/quant_speed.py [--model default] [--rounds 3] [--tokens 64] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, ensure_blas_here, preflight, run_record, spread, write_result  # noqa: E402


def run_once(model, prompt: list[int], tokens: int, eos: list[int]) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation on a fresh cache."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors

    procs = make_logits_processors(logit_bias={e: -100.0 for e in eos})
    stamps = []
    t0 = time.perf_counter()
    for _tok, _lp in generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, -1),
                                   logits_processors=procs, prompt_cache=make_prompt_cache(model),
                                   prefill_step_size=512):
        stamps.append(time.perf_counter())
    return len(prompt) / (stamps[0] - t0), (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_speed.json"))
    args = ap.parse_args()
    ensure_blas_here()

    from mlx_lm import load

    from models.quant.quantize import QuantSpec, quantize_dir, resolve_source

    src_dir, model_id = resolve_source(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="quant-speed-"))
    dirs = {"float32": src_dir}
    for b in args.bits:
        dirs[f"q{b}g64"] = quantize_dir(args.model, tmp / f"q{b}", QuantSpec(bits=b, group_size=64)).path
    models = {}
    for name, d in dirs.items():
        m, tok = load(str(d))
        models[name] = m
    eos = sorted(int(e) for e in (tok.eos_token_ids or []))
    text = Path(argparse.__file__).read_text()  # held-out Python source as the prompt
    prompt = tok.encode(text)[: args.prompt_tokens]
    for m in models.values():
        run_once(m, prompt[:64], 4, eos)  # warm-up
    pf = preflight()
    names = list(models)
    pre: dict[str, list[float]] = {n: [] for n in names}
    dec: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.rounds):
        for n in names[i % len(names):] + names[:i % len(names)]:
            p, d = run_once(models[n], prompt, args.tokens, eos)
            pre[n].append(round(p, 2))
            dec[n].append(round(d, 2))
            print(f"round {i} {n:8s} prefill {p:7.1f} tok/s  decode {d:6.2f} tok/s", flush=True)

    summary = {n: {"prefill_tok_s": spread(pre[n]), "decode_tok_s": spread(dec[n]),
                   "size_mb": round(sum(f.stat().st_size for f in Path(dirs[n]).glob("*.safetensors")) / 1e6, 1)}
               for n in names}
    for n in names:
        summary[n]["decode_vs_float32"] = round(summary[n]["decode_tok_s"]["median"]
                                                / summary["float32"]["decode_tok_s"]["median"], 3)
        summary[n]["prefill_vs_float32"] = round(summary[n]["prefill_tok_s"]["median"]
                                                 / summary["float32"]["prefill_tok_s"]["median"], 3)
    result = {**run_record(), "model": model_id, "preflight": pf, "preflight_end": preflight(),
              "config": {"rounds": args.rounds, "tokens": args.tokens, "prompt_tokens": len(prompt),
                         "group_size": 64, "alternation": "every round runs every configuration, order rotated"},
              "summary": summary}
    write_result(result, args.out)
    for n in names:
        s = summary[n]
        print(f"{n:8s} {s['size_mb']:7.1f} MB  prefill {s['prefill_tok_s']['median']:7.1f} tok/s "
              f"({s['prefill_vs_float32']:.2f}x)  decode {s['decode_tok_s']['median']:6.2f} tok/s "
              f"({s['decode_vs_float32']:.2f}x)")


if __name__ == "__main__":
    main()
