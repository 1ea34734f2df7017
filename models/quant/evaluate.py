"""Quality of a quantized model against its float source, on held-out text (models.quant.data.EVAL_FILES).

Per configuration: the mean KL divergence KL(P_float || P_quant) of the next-token distributions, top-1
agreement (the argmax tokens match), and the perplexity of both models on the same tokens. Everything is
computed in float32 from full logits, one window of `seq_len` tokens at a time.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["QualityRow", "reference_logprobs", "compare", "perplexity", "dir_size_mb", "format_table", "write_json"]


@dataclass(frozen=True)
class QualityRow:
    config: str
    bits_per_weight: float | None
    size_mb: float | None
    kl: float
    top1: float
    ppl: float
    ppl_float: float
    tokens: int


def _logprobs(model, batch):
    import mlx.core as mx

    logits = model(batch[None, :-1]).astype(mx.float32)[0]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def reference_logprobs(model, data) -> list:
    """The float model's log-probabilities per window (kept, so many configurations share one float pass)."""
    import mlx.core as mx

    out = []
    for row in data:
        lp = _logprobs(model, row)
        mx.eval(lp)
        out.append(lp)
    return out


def perplexity(lps, data) -> float:
    import mlx.core as mx

    nll, n = 0.0, 0
    for lp, row in zip(lps, data):
        tgt = row[1:]
        nll -= mx.take_along_axis(lp, tgt[:, None], axis=-1).sum().item()
        n += tgt.size
    return math.exp(nll / n)


def compare(ref_lps: list, model, data, *, config: str, bits_per_weight=None, size_mb=None) -> QualityRow:
    import mlx.core as mx

    kl_sum, agree, n, lps = 0.0, 0, 0, []
    for ref, row in zip(ref_lps, data):
        lp = _logprobs(model, row)
        kl = (mx.exp(ref) * (ref - lp)).sum(axis=-1)
        same = (ref.argmax(axis=-1) == lp.argmax(axis=-1)).sum()
        mx.eval(kl, same)
        kl_sum += kl.sum().item()
        agree += same.item()
        n += kl.size
        lps.append(lp)
        print(f"[eval] {config}: {n} tokens", file=sys.stderr, flush=True)
    return QualityRow(config, None if bits_per_weight is None else round(bits_per_weight, 3),
                      None if size_mb is None else round(size_mb, 1), kl_sum / n, agree / n,
                      perplexity(lps, data), perplexity(ref_lps, data), n)


def format_table(rows: list[QualityRow]) -> str:
    head = "| config | bpw | size MB | KL (nats) | top-1 | ppl | ppl float | tokens |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.config} | {r.bits_per_weight if r.bits_per_weight is not None else '-'} | "
                     f"{r.size_mb if r.size_mb is not None else '-'} | {r.kl:.4f} | {r.top1:.3f} | "
                     f"{r.ppl:.3f} | {r.ppl_float:.3f} | {r.tokens} |")
    return "\n".join(lines)


def write_json(rows: list[QualityRow], path: Path, **extra) -> None:
    Path(path).write_text(json.dumps({**extra, "rows": [asdict(r) for r in rows]}, indent=2))


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e6
