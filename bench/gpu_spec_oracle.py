"""Throughput of speculation in the batch with an oracle draft (issue 24), in-process on the bench model shape.

Random weights cannot echo their prompt, so n-gram lookup finds nothing to draft on them. This measures what the
speculating batch (``server.engine.batch.speculating.SpeculatingBatch``, the server's own code: its adaptive per-row
draft length, its measured break-even, its ragged KV) makes of drafts whose acceptance is known:

  plain        the server's ragged plain batch (``server.engine.batch.ragged.RaggedBatch``, pipelined on a GPU: the
               CPU's default), and ``plain_mlx``: mlx-lm's GenerationBatch (``server.engine.batch.mlx.MlxBatch``: the
               GPU's default)
  spec_none    SpeculatingBatch whose rows never find a draft (the layout's own cost)
  oracle_100   SpeculatingBatch whose rows draft the continuation a first greedy run of the same layout produced
  oracle_50    the same drafts with the second half of each replaced by a wrong token (half of each draft
               accepted; the row's policy sees that and adapts its length, as it would for real lookups)

N rows of --context random tokens (lengths differ per row, as agents' do), --gen greedy tokens per row. Reported:
aggregate generated tok/s per system (median of --rounds), each over plain, and whether every row's tokens equal the
plain run's (greedy text promise; bf16 logits of a W-token forward and a 1-token forward can differ in the last bit,
so a mismatch is counted, not hidden).

``--weights echo`` (the default): random weights whose every layer writes almost nothing into the residual stream
(attention and MLP output projections scaled by 1e-3) and whose lm_head is the embedding, so the greedy next token
is the current one by a wide margin. Every kernel runs at its real shape (speed does not depend on the values), but
the greedy continuation no longer flips with the last bit of bf16 as it does on plain random weights (nearly flat
logits: the run of 2026-12-01 accepted 28 of 190 "oracle" tokens), so the oracle's acceptance is what it says.
``--weights random``: plain random weights.

    python bench/gpu_spec_oracle.py --rows 8,32 --gen 128 --k 4 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402


class OracleSource:
    """A draft source that knows the row's greedy continuation (``reference``: prompt + output). ``wrong_from``:
    the index in each draft from which its tokens are made wrong (None: never)."""

    def __init__(self, reference: list[int], wrong_from: int | None):
        self.reference = reference
        self.wrong_from = wrong_from
        self.seen = 0  # tokens of the reference the row has fed
        self._open: list[int] | None = None

    caches = None
    drafts_in_batch = False  # it drafts on its own (spec.source.DraftSource), never in a batched draft model

    def prefill(self, ids) -> None:
        self.seen = len(ids)
        self._open = None

    def draft(self, feed, n: int) -> list[int]:
        self.seen += len(feed)
        out = list(self.reference[self.seen:self.seen + n])
        if self.wrong_from is not None:
            out = [t if j < self.wrong_from else (t + 1) % 1000 for j, t in enumerate(out)]
        self._open = out or None
        return out

    def commit(self, drafted, accepted: int) -> None:
        self._open = None
        self.seen += accepted


def row_views(cache, lengths):
    """Each row's own KVCache views over a prefilled batch cache, cut to its length (no copy; consumers copy)."""
    from mlx_lm.models.cache import KVCache

    rows = []
    for r, n in enumerate(lengths):
        own = []
        for c in cache:
            k = KVCache()
            k.keys, k.values, k.offset = c.keys[r:r + 1, :, :n], c.values[r:r + 1, :, :n], n
            own.append(k)
        rows.append(own)
    return rows


def echo(model) -> None:
    """Make a random llama's greedy next token its current token, by a wide margin (see the module's docstring)."""
    from mlx.utils import tree_flatten, tree_unflatten

    small = [(n, p * 1e-3) for n, p in tree_flatten(model.parameters()) if n.endswith(("o_proj.weight",
                                                                                      "down_proj.weight"))]
    model.update(tree_unflatten(small))
    model.lm_head.weight = model.model.embed_tokens.weight
    mx.eval(model.parameters())


def run(batch, seqs, gen: int) -> tuple[float, list[list[int]]]:
    """Step until every row has `gen` tokens; (seconds, tokens per row)."""
    out = {id(s): [] for s in seqs}
    t = time.perf_counter()
    while any(len(v) < gen for v in out.values()):
        for e in batch.step():
            got = out[id(e.seq)]
            if len(got) < gen:
                got.append(int(e.token))
                e.seq.generated.append(int(e.token))
    dt = time.perf_counter() - t
    return dt, [out[id(s)] for s in seqs]


def main() -> int:
    from mlx_lm.models.cache import make_prompt_cache

    from gpu_write_cost import build
    from server.engine.batch.mlx import MlxBatch
    from server.engine.batch.protocol import Row, RowDraft
    from server.engine.batch.ragged import RaggedBatch
    from server.engine.batch.speculating import SpeculatingBatch
    from spec.ngram import NgramProvider

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="the rows' longest draft (the server's --num-draft-tokens)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--weights", choices=("echo", "random"), default="echo")
    args = ap.parse_args()
    model, _ = build(args.shape, args.dtype)
    if args.weights == "echo":
        echo(model)
    provider = NgramProvider()
    gpu = mx.default_device() != mx.cpu
    default_plain = lambda m: RaggedBatch(m, pipelined=gpu)  # noqa: E731 (--batch-layout ragged)
    mlx_plain = lambda m: MlxBatch(m, clear_cache=False)  # noqa: E731
    rec = {"script": "bench/gpu_spec_oracle.py", "argv": sys.argv[1:], "mlx": mx.__version__,
           "device": str(mx.default_device()), "rows": {}}
    for n in [int(x) for x in args.rows.split(",")]:
        mx.random.seed(1)
        prompt = mx.random.randint(3, 1000, (n, args.context)).tolist()
        lengths = [args.context - 1 - (37 * r) % 256 for r in range(n)]  # caches cover history[:-1]
        cache = make_prompt_cache(model)
        ids = mx.array(prompt)
        for i in range(0, args.context, 512):
            model(ids[:, i:i + 512], cache=cache)
            mx.eval([c.state for c in cache])
        histories = [prompt[r][:lengths[r] + 1] for r in range(n)]

        def seqs():
            return [SimpleNamespace(params=SimpleNamespace(max_tokens=args.gen + args.k + 2), prompt=h, generated=[])
                    for h in histories]

        def plain(layout=None):
            b, ss = (layout or default_plain)(model), seqs()
            b.add([Row(s, c, h) for s, c, h in zip(ss, row_views(cache, lengths), histories)])
            return run(b, ss, args.gen)

        def spec(sources):
            b, ss = SpeculatingBatch(model), seqs()
            b.add([Row(s, c, h, draft=RowDraft(src, provider.policy(args.k), args.k, None),
                       max_tokens=s.params.max_tokens)
                   for s, c, h, src in zip(ss, row_views(cache, lengths), histories, sources)])
            dt, toks = run(b, ss, args.gen)
            return dt, toks, b

        plain()  # warm-up: kernels compiled, buffers allocated
        plain(mlx_plain)
        times, times_mlx, ref = [], [], None
        for _ in range(args.rounds):
            dt, toks = plain()
            times.append(dt)
            ref = ref or toks
            times_mlx.append(plain(mlx_plain)[0])
        row = {"plain_tok_s": round(n * args.gen / statistics.median(times), 1),
               "plain_mlx_tok_s": round(n * args.gen / statistics.median(times_mlx), 1)}
        # the oracle is the speculating layout's own greedy run: on random weights the logits are nearly flat, so
        # the two layouts' last-bit differences flip many argmaxes (spec_none_rows_same_as_plain says how many)
        own = spec([OracleSource([], None) for _ in range(n)])[1]
        for name, make in (("spec_none", lambda: [OracleSource([], None) for _ in range(n)]),
                           ("oracle_100", lambda: [OracleSource(h + r, None) for h, r in zip(histories, own)]),
                           ("oracle_50", lambda: [OracleSource(h + r, args.k // 2) for h, r in zip(histories, own)])):
            times, same, same_own, acc = [], 0, 0, None
            spec(make())  # warm-up of this width
            for _ in range(args.rounds):
                dt, toks, b = spec(make())
                times.append(dt)
                same = sum(a == b_ for a, b_ in zip(toks, ref))
                same_own = sum(a == b_ for a, b_ in zip(toks, own))
                acc = (b.drafted, b.accepted, b.steps)
            tok_s = n * args.gen / statistics.median(times)
            row[f"{name}_tok_s"] = round(tok_s, 1)
            row[f"{name}_over_plain"] = round(tok_s / row["plain_tok_s"], 3)
            row[f"{name}_rows_same_as_plain"] = f"{same}/{n}"
            row[f"{name}_rows_same_as_spec_none"] = f"{same_own}/{n}"
            row[f"{name}_drafted_accepted_steps"] = acc
        rec["rows"][str(n)] = row
        print(json.dumps({"rows": n, **row}), flush=True)
        del cache
        mx.clear_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_spec_oracle.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
