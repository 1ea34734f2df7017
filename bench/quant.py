"""Weight-quantization quality: KL / top-1 / perplexity against the float model, with and without rotation.

    python bench/quant.py [--model default] [--bits 4 3] [--rotation auto] [--eval-tokens 1024]

For each bit width: a plain quantization and a rotated one (auto = a pure Hadamard when the hidden size is a power
of two, else the block rotation kron(H_p, random orthogonal)), all scored on the same held-out Python stdlib text
against the same float32 reference. Also checks, on the float model, that the rotation alone leaves the logits
unchanged (max |difference|). Table on stdout; JSON in bench/results/quant.json, with the command, date, git rev,
machine facts and a preflight of the machine before and after (quality is what this measures, not speed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import preflight, run_record  # noqa: E402


def rotation_check(src: str, kind: str) -> dict:
    import mlx.core as mx

    from models.quant.quantize import load_float, resolve_source
    from models.quant.rotation import rotate_model

    model_dir, _ = resolve_source(src)
    model, tokenizer, config = load_float(model_dir, "float32")
    ids = mx.array(tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"))[None]
    before = model(ids)
    mx.eval(before)
    rotate_model(model, config, kind=kind)
    after = model(ids)
    return {"kind": kind, "tokens": ids.shape[1], "max_abs_diff": mx.abs(before - after).max().item(),
            "max_abs_logit": mx.abs(before).max().item(),
            "same_argmax": bool(mx.all(before.argmax(-1) == after.argmax(-1)).item())}


def tiny_outlier_rows(bits_list) -> list:
    """Hadamard on a power-of-two model: a 4-layer random llama (hidden 256) with three outlier residual channels
    (norm gains 20x, which folding turns into outlier weight columns, the case rotation is for). Random weights:
    KL is the signal; top-1 and perplexity of a random model mean little."""
    import contextlib
    import copy
    import io

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_map
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model

    from models.quant.evaluate import compare, reference_logprobs
    from models.quant.rotation import rotate_model

    cfg = dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5,
               tie_word_embeddings=True)
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs.from_dict(cfg))
    m.update(tree_map(lambda x: mx.random.normal(x.shape) * (0.06 if x.ndim == 2 else 0.1) + (x.ndim == 1),
                      m.parameters()))
    g = np.ones(256, dtype=np.float32)
    g[[3, 77, 190]] = 20.0
    for layer in m.model.layers:
        layer.input_layernorm.weight = mx.array(g)
        layer.post_attention_layernorm.weight = mx.array(g)
    mx.eval(m.parameters())
    data = mx.array(np.random.default_rng(0).integers(0, 512, (4, 128)), dtype=mx.int32)
    ref = reference_logprobs(m, data)
    rows = []
    for bits in bits_list:
        for rot in (None, "hadamard"):
            q, c = copy.deepcopy(m), dict(cfg)
            if rot:
                c = rotate_model(q, c, kind=rot)
            with contextlib.redirect_stdout(io.StringIO()):
                quantize_model(q, c, 64, bits)
            rows.append(compare(ref, q, data, config=f"tiny q{bits}g64" + (f"+{rot}" if rot else "")))
    return rows


def main() -> int:
    from models.quant.cli import evaluate_dirs
    from models.quant.evaluate import format_table, write_json
    from models.quant.quantize import QuantSpec, quantize_dir, resolve_source

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rotation", choices=["auto", "hadamard", "block", "none"], default="auto")
    p.add_argument("--eval-tokens", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant.json"))
    p.add_argument("--tiny", action="store_true",
                   help="only the power-of-two tiny-model Hadamard experiment (seconds; JSON in quant_tiny.json)")
    args = p.parse_args()
    pf = preflight()
    if args.tiny:
        rows = tiny_outlier_rows(args.bits)
        print(format_table(rows))
        write_json(rows, Path(args.out).with_name("quant_tiny.json"), **run_record(), preflight=pf,
                   model="tiny random llama, hidden 256", preflight_end=preflight())
        return 0

    model_dir, _ = resolve_source(args.model)
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    kind = args.rotation
    if kind == "auto":
        kind = "hadamard" if hidden & (hidden - 1) == 0 else "block"
    t0 = time.monotonic()
    check = rotation_check(args.model, kind) if kind != "none" else None
    if check:
        print(f"rotation ({kind}) on the float model: max |logit diff| {check['max_abs_diff']:.2e} "
              f"(max |logit| {check['max_abs_logit']:.1f}), same argmax {check['same_argmax']}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mlx-lane-quant-") as tmp:
        outs = []
        for bits in args.bits:
            for rot in ([None] if kind == "none" else [None, kind]):
                out = Path(tmp) / f"q{bits}{'-' + rot if rot else ''}"
                quantize_dir(args.model, out, QuantSpec(bits=bits, group_size=args.group_size, rotate=rot))
                outs.append(out)
        rows = evaluate_dirs(args.model, outs, eval_tokens=args.eval_tokens, seq_len=args.seq_len)
    table = format_table(rows)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(rows, Path(args.out), **run_record(), preflight=pf, model=args.model, hidden_size=hidden,
               group_size=args.group_size, rotation=kind, rotation_float_check=check,
               seconds=round(time.monotonic() - t0, 1), preflight_end=preflight())
    return 0


if __name__ == "__main__":
    sys.exit(main())
