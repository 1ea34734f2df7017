"""Embeddings per second on this machine: mlx-lane's embedding model (MLX, in process) vs the same model through
transformers + torch on the CPU (what sentence-transformers runs: BertModel, mean pooling, normalize), alternated.

The same --n sentences (synthetic, 8-40 words, fixed seed), batches of --batch, both sides tokenized inside the
timed region; each round runs both, order rotated. The served path adds HTTP and the lane's task hand-over on top
(not measured here). Needs torch + transformers (`make test-deps`).

    python bench/embeddings.py [--rounds 3] [--n 256] [--batch 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, ensure_blas_here, preflight, run_record, spread, write_result  # noqa: E402

WORDS = ("the a server cache model request token prefix agent code function returns value list map file "
         "test build lane batch adapter vector search index query answer fast slow memory disk write read").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "." for _ in range(n)]


def ours(model, texts, batch):
    out = []
    for i in range(0, len(texts), batch):
        out.append(model.embed(model.tokenize(texts[i: i + batch])))
    return out


def peer(tok, hf, texts, batch, torch):
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tok(texts[i: i + batch], padding=True, truncation=True, max_length=256, return_tensors="pt")
            h = hf(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench/results/embeddings.json"))
    args = ap.parse_args()
    ensure_blas_here()
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    from models.embedding import load_embedding_model

    pf = preflight()
    model = load_embedding_model("default", progress=False)
    tok, hf = AutoTokenizer.from_pretrained(str(model.path)), AutoModel.from_pretrained(str(model.path)).eval()
    texts = sentences(args.n)
    a, b = np.concatenate(ours(model, texts[:64], args.batch)), np.concatenate(peer(tok, hf, texts[:64], args.batch, torch))
    max_diff = float(np.abs(a - b).max())  # warm-up of both, and the check that they compute the same thing
    rates = {"ours": [], "peer": []}
    for r in range(args.rounds):
        for kind in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
            t0 = time.perf_counter()
            ours(model, texts, args.batch) if kind == "ours" else peer(tok, hf, texts, args.batch, torch)
            rates[kind].append(args.n / (time.perf_counter() - t0))
            print(f"round {r} {kind}: {rates[kind][-1]:.1f} embeddings/s", file=sys.stderr)
    ratios = [o / p for o, p in zip(rates["ours"], rates["peer"])]
    write_result({**run_record(), "preflight": pf, "preflight_after": preflight(),
                  "config": {"n": args.n, "batch": args.batch, "rounds": args.rounds, "model": model.model_id,
                             "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
                  "max_abs_diff": max_diff,
                  "ours_per_s": spread(rates["ours"]), "peer_per_s": spread(rates["peer"]),
                  "ratio": spread(ratios)}, args.out)


if __name__ == "__main__":
    main()
