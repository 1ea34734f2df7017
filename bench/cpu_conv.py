"""A hybrid's short depthwise convolution on this CPU: mlx's ``conv1d`` vs ``models.kernels.conv.shifted`` (issue 43).

Every gated-delta (and Mamba) layer convolves its projected inputs over 4 taps with one channel a group before the
recurrence. mlx's CPU ``conv1d`` runs that as a loop; the same float32 sums as K shifted products are bit-identical
(tests/unit/test_kernels.py). This measures, alternating the two forms within one process:

  conv      one call at decode and prompt shapes of --channels channels (ms, median of --reps)
  prefill   a Qwen3.5-shaped model of --layers layers (a multiple of 4: every 4th is full attention) with
            Qwen3.5-0.8B's linear-attention widths (16 key and 16 value heads of 128: 6,144 channels) and a 1,024
            hidden size, random float32 weights: one --prompt-tokens prompt prefilled in 512-token chunks
            (tokens/s), and the greedy tokens of --decode-tokens steps after
            it, which must be the same both ways

    python bench/cpu_conv.py                  # quiet machine (no tests or builds beside it): ~2 min

Prints one JSON line per part and writes --out/cpu_conv.json.
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


def median_ms(fn, reps: int) -> float:
    from common import median_seconds

    return round(median_seconds(fn, reps) * 1e3, 3)


def main() -> int:
    from common import ensure_blas_here

    ensure_blas_here()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import _get_classes

    from gpu import SHAPES, random_weights
    from models import kernels
    from models.kernels import conv

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--channels", type=int, default=6144)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench")))
    args = ap.parse_args()
    rec: dict = {"script": "bench/cpu_conv.py", "argv": sys.argv[1:], "mlx": mx.__version__,
                 "device": str(mx.default_device()), "conv_ms": {}}

    C, K = args.channels, 4
    mx.random.seed(0)
    w = mx.random.normal((C, K, 1))
    for B, L in ((1, K), (16, K), (1, 512 + K - 1), (8, 330 + K - 1)):
        x = mx.random.normal((B, L, C))
        mx.eval(x, w)
        row = {"conv1d": median_ms(lambda: mx.eval(mx.conv1d(x, w, groups=C)), args.reps),
               "shifted": median_ms(lambda: mx.eval(conv.shifted(x, w)), args.reps)}
        row["shifted_over_conv1d"] = round(row["shifted"] / row["conv1d"], 3)
        rec["conv_ms"][f"{B}x{L}"] = row
        print(json.dumps({"conv": f"{B}x{L}x{C}", **row}), flush=True)

    cfg = {**SHAPES["qwen3.5-9b"], "hidden_size": 1024, "num_hidden_layers": args.layers, "intermediate_size": 3584,
           "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_value_heads": 16,
           "linear_num_key_heads": 16, "vocab_size": 32768, "max_position_embeddings": 131072,
           "tie_word_embeddings": False}
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    random_weights(model, "float32")
    kernels.install(model)  # on this CPU: the chunked gated delta rule and the shifted convolution
    prompt = [(7 * i + 3) % 30000 + 10 for i in range(args.prompt_tokens)]

    def run(shifted: bool) -> tuple[float, list[int]]:
        conv.OPS = shifted
        caches = make_prompt_cache(model)
        t = time.perf_counter()
        for i in range(0, len(prompt) - 1, 512):
            model(mx.array(prompt[i: min(i + 512, len(prompt) - 1)])[None], cache=caches)
            mx.eval([c.state for c in caches])
        rate = (len(prompt) - 1) / (time.perf_counter() - t)
        tok, out = mx.array([[prompt[-1]]]), []
        for _ in range(args.decode_tokens):
            tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
            out.append(int(tok.item()))
        return rate, out

    rates: dict = {"conv1d": [], "shifted": []}
    texts = {}
    run(True), run(False)  # warm-up
    for r in range(args.rounds):
        for name in (("shifted", "conv1d") if r % 2 == 0 else ("conv1d", "shifted")):
            rate, texts[name] = run(name == "shifted")
            rates[name].append(round(rate, 1))
    conv.OPS = True
    med = {k: statistics.median(v) for k, v in rates.items()}
    rec["prefill"] = {"layers": args.layers, "channels": 2 * 16 * 128 + 16 * 128, "prompt_tokens": args.prompt_tokens,
                      "tok_s": rates, "median_tok_s": med,
                      "shifted_over_conv1d_rate": round(med["shifted"] / med["conv1d"], 3),
                      "same_greedy_tokens": texts["shifted"] == texts["conv1d"]}
    print(json.dumps({"prefill": rec["prefill"]}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cpu_conv.json").write_text(json.dumps(rec, indent=1))
    return 0 if rec["prefill"]["same_greedy_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
