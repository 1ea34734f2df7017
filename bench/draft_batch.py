"""The draft model's forwards in a speculating batch: batched over the rows (server.engine.batch.drafts) vs row by row
(spec.two_model.TwoModelSource, each row on its own caches), in-process on the default model drafting for itself.

--rows rows of --context tokens each (different prompts); every round each row drafts --k tokens and accepts a
number of them drawn per row (the same draw for both ways), then hears one new token; rounds alternate between the
two ways (order flipped every round). Reported: ms per round for each way (median over --rounds), their ratio, and
whether both ways drafted the same tokens every round (they must: the batched forwards compute each row's own
logits).

    python bench/draft_batch.py --rows 4,8 --context 300 --k 4 --rounds 8

Writes --out (a JSON in bench/results/ by default).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_MODEL = Path.home() / ".cache" / "mlx-lane" / "models" / "SmolLM2-135M-Instruct"


def main() -> int:
    from common import ensure_blas_here, preflight, run_record, write_result

    ensure_blas_here()  # as the server does
    from models import load_model
    from server.engine.batch.drafts import DraftBatch
    from spec.two_model import TwoModelSource

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--rows", default="4,8")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_batch.json"))
    args = ap.parse_args()
    pf = preflight()
    model = load_model(args.model).model
    rng = random.Random(0)
    result = {**run_record(), "args": vars(args), "preflight": pf, "levels": {}}
    for R in [int(x) for x in args.rows.split(",")]:
        prompts = [[rng.randrange(3, 40000) for _ in range(args.context)] for _ in range(R)]
        alone = [TwoModelSource(model) for _ in range(R)]
        together = [TwoModelSource(model) for _ in range(R)]
        for a, t, p in zip(alone, together, prompts):
            a.prefill(p[:-1])
            t.prefill(p[:-1])
        batch = DraftBatch(model)
        batch.join(together)
        feeds = [[p[-1]] for p in prompts]
        times = {"batched": [], "row_by_row": []}
        same = True
        for r in range(args.rounds + 1):  # round 0 warms both ways up
            accepts = [rng.randint(0, args.k) for _ in range(R)]
            order = ["batched", "row_by_row"] if r % 2 else ["row_by_row", "batched"]
            got = {}
            for way in order:
                t0 = time.perf_counter()
                if way == "batched":
                    d = batch.draft([(s, f, args.k) for s, f in zip(together, feeds)])
                    batch.commit([(s, x, a) for s, x, a in zip(together, d, accepts)])
                else:
                    d = [s.draft(f, args.k) for s, f in zip(alone, feeds)]
                    for s, x, a in zip(alone, d, accepts):
                        s.commit(x, a)
                dt = time.perf_counter() - t0
                got[way] = d
                if r:
                    times[way].append(dt)
            same = same and got["batched"] == got["row_by_row"]
            feeds = [[rng.randrange(3, 40000)] for _ in range(R)]
        med = {w: statistics.median(v) * 1000 for w, v in times.items()}
        level = {"round_ms": {w: round(m, 1) for w, m in med.items()},
                 "round_ms_all": {w: [round(x * 1000, 1) for x in v] for w, v in times.items()},
                 "batched_over_row_by_row": round(med["batched"] / med["row_by_row"], 3),
                 "same_drafts_every_round": same, "draft_forwards_batched": batch.forwards}
        result["levels"][str(R)] = level
        print(f"rows {R}: batched {med['batched']:.1f} ms / round, row by row {med['row_by_row']:.1f} ms "
              f"-> {level['batched_over_row_by_row']}x; same drafts: {same}", flush=True)
    result["preflight_end"] = preflight()
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
