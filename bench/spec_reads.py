"""A speculating batch's step with its batched drafts read first or read with the verdict (spec.verify
.READ_DRAFTS_WITH_VERDICT), in-process: the server's SpeculatingBatch, rows drafting with a draft model that is the
target itself (every draft holds: the case where the order matters most), --k drafts a row a step.

Per --rows level and round, each order decodes --tokens tokens a row from the same prompts (the order flipped
every round); reported: ms per step for each order (median over rounds), their ratio, and whether both orders gave
the same tokens (they must).

    python bench/spec_reads.py --rows 1,4 --tokens 32 --rounds 5                          # this CPU, the default model
    bash bench/gpu.sh bench/spec_reads.py --shape llama3-8b --rows 1,4,16 --rounds 3    # a random GPU shape

Writes --out (a JSON; a folder gets spec_reads.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_MODEL = Path.home() / ".cache" / "mlx-lane" / "models" / "SmolLM2-135M-Instruct"


def decode(model, prompts: list[list[int]], tokens: int, k: int) -> tuple[list[list[int]], float, int]:
    """Every prompt a row of one SpeculatingBatch, drafting k tokens a step with the target as its draft model, until
    each has ``tokens`` tokens: (each row's tokens, seconds, steps)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from server.engine.batch import Row, RowDraft
    from server.engine.batch.speculating import SpeculatingBatch
    from spec import FixedDraftLength
    from spec.two_model import TwoModelSource

    batch = SpeculatingBatch(model)
    batch.cost.probe = lambda: False  # draft every step: the order of the reads is measured, not when drafts pay
    batch._worth_drafting = lambda wanted, pays: True
    seqs = []
    for p in prompts:
        caches = make_prompt_cache(model)
        model(mx.array(p[:-1])[None], cache=caches)
        mx.eval([c.state for c in caches])
        s = SimpleNamespace(prompt=list(p), generated=[], params=SimpleNamespace(max_tokens=tokens))
        batch.add([Row(s, caches, list(p), draft=RowDraft(TwoModelSource(model, None, ()), FixedDraftLength(k), k,
                                                            None))])
        seqs.append(s)
    mx.synchronize()
    t, steps = time.perf_counter(), 0
    while any(len(s.generated) < tokens for s in seqs):
        for e in batch.step():
            e.seq.generated.append(e.token)
        steps += 1
        for s in [s for s in seqs if len(s.generated) >= tokens and s in batch]:
            batch.remove([s])
    mx.synchronize()
    return [s.generated[:tokens] for s in seqs], time.perf_counter() - t, steps


def main() -> int:
    from common import ensure_blas_here, run_record, write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--shape", default=None, help="bench/gpu.py's random-weight shape instead of --model")
    ap.add_argument("--dtype", default="bfloat16", help="--shape: the weights' dtype")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens a row")
    ap.add_argument("--tokens", type=int, default=32, help="tokens a row decodes")
    ap.add_argument("--k", type=int, default=4, help="drafts a row a step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_reads.json"))
    args = ap.parse_args()
    ensure_blas_here()
    import spec.verify

    if args.shape:
        from gpu_window_solo import build

        model, _ = build(args.shape, args.dtype)
    else:
        from models import load_model

        model = load_model(args.model).model
    result: dict = {**run_record(), "args": vars(args), "levels": {}}
    for rows in [int(x) for x in args.rows.split(",") if x]:
        prompts = [[(17 * i + 31 * r) % 4000 + 100 for i in range(args.context)] for r in range(rows)]
        times: dict = {"with_verdict": [], "first": []}
        texts: dict = {}
        decode(model, prompts, 4, args.k)  # compiled, planned
        for rnd in range(args.rounds):
            for order in (("with_verdict", "first") if rnd % 2 == 0 else ("first", "with_verdict")):
                spec.verify.READ_DRAFTS_WITH_VERDICT = order == "with_verdict"
                got, seconds, steps = decode(model, prompts, args.tokens, args.k)
                times[order].append(1e3 * seconds / steps)
                texts.setdefault(order, got)
        spec.verify.READ_DRAFTS_WITH_VERDICT = True
        med = {o: round(statistics.median(v), 3) for o, v in times.items()}
        level = {"ms_per_step": times, "median_ms_per_step": med,
                 "with_verdict_over_first": round(med["with_verdict"] / med["first"], 3),
                 "same_tokens": texts["with_verdict"] == texts["first"]}
        result["levels"][str(rows)] = level
        print(f"rows {rows}: ms a step, drafts read with the verdict {med['with_verdict']} vs first {med['first']} "
              f"(ratio {level['with_verdict_over_first']}); same tokens {level['same_tokens']}", flush=True)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
