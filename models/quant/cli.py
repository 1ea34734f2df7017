"""`mlx-lane quantize SRC OUT [...]`: the argparse wiring and the run (quantize, then optionally --eval).

Imported by server/cli.py when the parser is built, so nothing heavy (mlx) is imported at module level.
Progress is on stderr; stdout gets the output directory and, with --eval, the quality table.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["add_quantize_parser", "run_quantize", "evaluate_dirs"]


def add_quantize_parser(sub) -> None:
    q = sub.add_parser(
        "quantize", help="quantize a model's weights into an mlx-lm directory (uniform, mixed, rotated)",
        description="Quantize SRC (an mlx-lm directory, a .gguf file, 'default', or a packaged model name) into "
                    "the mlx-lm directory OUT, loadable by mlx_lm.load. On this CPU quantized kernels are slower "
                    "than float32; quantized weights pay on GPU / Apple silicon.")
    q.add_argument("src", help="model to quantize: 'default', an mlx-lm directory, a .gguf file, a packaged name")
    q.add_argument("out", help="directory to write")
    q.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8],
                   help="bits per weight (the low width with --target-bpw; default 4)")
    q.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                   help="weights sharing one scale and bias (default 64)")
    q.add_argument("--target-bpw", type=float, default=None,
                   help="mixed precision: raise the most sensitive layers (measured on calibration text with "
                        "mlx-lm's dynamic-quant sensitivity) to --high-bits until this bits-per-weight budget")
    q.add_argument("--high-bits", type=int, default=None, choices=[3, 4, 5, 6, 8],
                   help="width of the sensitive layers with --target-bpw (default: 2->4, 3->4, 4->6, 6->8)")
    q.add_argument("--rotate", action="store_true",
                   help="fold RMSNorm gains and a Hadamard rotation of the residual stream into the weights "
                        "before quantizing (llama, qwen2; outputs unchanged in float; ties are untied)")
    q.add_argument("--rotation", choices=["hadamard", "block"], default="hadamard",
                   help="with --rotate: 'hadamard' (power-of-two hidden sizes only) or 'block' (kron of a Hadamard "
                        "and a seeded random orthogonal block, any size, e.g. 576 = 64 x 9)")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of what stays float (norms, scales, biases); default: the source's")
    q.add_argument("--calib-tokens", type=int, default=1024, help="calibration tokens for --target-bpw (1024)")
    q.add_argument("--eval", action="store_true",
                   help="after quantizing: KL divergence, top-1 agreement and perplexity against the float model "
                        "on held-out Python stdlib sources; table on stdout, JSON in OUT/mlx_lane_eval.json")
    q.add_argument("--eval-tokens", type=int, default=1024, help="held-out tokens for --eval (1024)")
    q.add_argument("--seq-len", type=int, default=256, help="window length for calibration and eval (256)")


def evaluate_dirs(src: str, outs: list[Path], *, eval_tokens: int, seq_len: int) -> list:
    """Quality rows of each quantized directory in `outs` against the float model `src` (float32 on this host)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from models.quant.data import EVAL_FILES, stdlib_batches
    from models.quant.evaluate import QualityRow, compare, dir_size_mb, perplexity, reference_logprobs
    from models.quant.quantize import describe, load_float, resolve_source, say

    model_dir, model_id = resolve_source(src)
    ref_model, tokenizer, _ = load_float(model_dir, "float32")
    data = stdlib_batches(tokenizer, EVAL_FILES, eval_tokens, seq_len)
    say(f"float reference: {model_id}, {data.size} held-out tokens")
    ref = reference_logprobs(ref_model, data)
    del ref_model
    ppl = perplexity(ref, data)
    n = data.shape[0] * (data.shape[1] - 1)
    rows = [QualityRow("float32", 32.0, round(dir_size_mb(model_dir), 1), 0.0, 1.0, ppl, ppl, n)]
    for out in outs:
        model, _, config = load(str(out), return_config=True)
        model.set_dtype(mx.float32)
        recipe = config.get("mlx_lane_quantize") or {}
        rows.append(compare(ref, model, data, config=describe(config),
                            bits_per_weight=recipe.get("bits_per_weight"), size_mb=dir_size_mb(out)))
        del model
    return rows


def run_quantize(args) -> int:
    from models.errors import ModelLoadError
    from models.quant.evaluate import format_table, write_json
    from models.quant.quantize import QuantSpec, quantize_dir
    from models.quant.rotation import RotationError

    spec = QuantSpec(bits=args.bits, group_size=args.group_size, target_bpw=args.target_bpw,
                     high_bits=args.high_bits, rotate=args.rotation if args.rotate else None, dtype=args.dtype,
                     calib_tokens=args.calib_tokens, seq_len=args.seq_len)
    try:
        res = quantize_dir(args.src, args.out, spec)
    except (ModelLoadError, RotationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(res.path)
    if args.eval:
        rows = evaluate_dirs(args.src, [res.path], eval_tokens=args.eval_tokens, seq_len=args.seq_len)
        print(format_table(rows))
        write_json(rows, res.path / "mlx_lane_eval.json", source=args.src)
    return 0
