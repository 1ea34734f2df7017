"""Does MTP drafting pay for this checkpoint on this device, and at which draft length (issue 44)? In-process, with
the server's own parts (models.load_model, spec.mtp, server.engine.batch.ragged_kv / mtp_drafts).

Measured, then fitted:
  verify     one target forward over w = 1..N+1 tokens after --context tokens: t(w) ~ a + m (w - 1) (least
             squares): ``a`` a plain step, ``m / a`` what a drafted position adds to it (the verify overhead)
  draft      the heads drafting n = 1..N tokens (their entry for the last token, then one forward per further
             draft, one sync): d(n) ~ d0 + d1 n; (d0 + d1) / a is the cost ratio of a drafted token
  accept     greedy speculative decoding of --prompts with n = N drafts every round: P(the first k drafts hold),
             k = 1..N, over the rounds
  rows       with --rows B,...: the same for B rows at once (the speculating batch: the ragged layout's verify
             forward, the heads' batched drafts), per row
and, for each n, the tokens a step yields, E(n) = 1 + sum_k P(k), its cost a + m n + d(n), and the speedup over plain
decoding E(n) a / cost(n); the best n and the acceptance a drafted token must beat (break-even). The heads are run as
the server runs them; acceptance depends on the text (code and tool output echo more than prose).

    python bench/mtp_fit.py --model /path/to/Qwen3.5-9B --rows 1,16 --out bench/results/mtp_fit_qwen35_9b_h200.json
    python bench/mtp_fit.py --zoo glm4_moe_lite --context 64 --reps 3     # a logic check with a tiny random model

With --zoo the checkpoint is tests.fixtures.zoo_mtp's tiny random one (untrained heads: acceptance near 0, which is
the point of nothing but checking the script).

Fitting (--fit-steps N, bench/mtp_train.py): random weights give a head that never agrees with its model, so the head
is first trained (alone) on the target's own greedy continuations of Python standard-library windows, acceptance
measured before and after on the prompts above (which it never saw), and the fitted head written as the family's
checkpoint tensors (--save DIR; in place for --shape) for bench/gpu_mtp.py to serve. --shape builds bench/gpu.py's
random target of that shape with untrained heads first:

    python bench/mtp_fit.py --shape qwen3.5-9b --model-dir /dev/shm/mtp-qwen --fit-steps 300 --rows 1
    python bench/mtp_fit.py --shape qwen3.5-tiny --vocab 49152 --model-dir /tmp/mtp-tiny --fit-steps 200 --reps 3

"speed_by_acceptance" maps an acceptance rate p (each draft holding with p, given the ones before it) to the speedup
the measured step costs give, so a reader can place a real checkpoint's acceptance (a model, from measured costs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# float32 matmuls on a CUDA GPU run as TF32 unless MLX_ENABLE_TF32=0 (MLX's default is 1): ~1e-3 relative error, which
# flips a random model's greedy near-ties between a verify forward and a one-token step, so a fitted head's text left
# the continuations it was fitted on (12-05, H100: 0 of 3 texts equal to plain greedy in float32). bfloat16 is not
# affected; set before MLX reads it
os.environ.setdefault("MLX_ENABLE_TF32", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402

PROMPTS = [
    "Rewrite this function so it returns early, keeping the names:\n\ndef find(items, key):\n    found = None\n"
    "    for item in items:\n        if item.key == key:\n            found = item\n    return found\n",
    "List the files this command touched and what each one does:\n$ git status --short\n M server/lane/lane.py\n"
    " M server/engine/prefill.py\n?? tests/unit/test_prefill.py\n",
    "Explain in two sentences why a prefix cache makes an agent's next turn cheap.",
]


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` (two warm-up calls first): bench/common.py's ``median_seconds``."""
    from common import median_seconds

    return median_seconds(fn, reps, warm=2)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares."""
    n, mx_, my = len(xs), statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx_) ** 2 for x in xs)
    slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx and n > 1 else 0.0
    return my - slope * mx_, slope


def load(args):
    from models import load_model
    from spec.mtp import MtpProvider

    path = args.model
    if args.shape:
        from mtp_train import build_target_with_heads

        path = str(Path(args.model_dir))
        if not (args.reuse_model and (Path(path) / "config.json").is_file()):
            build_target_with_heads(args.shape, Path(path), args.dtype or "bfloat16", Path(args.tokenizer_dir),
                                    args.vocab)
    if args.zoo:
        from models import ensure_default_model
        from tests.fixtures import zoo_mtp

        path = str(zoo_mtp.write(args.zoo, Path(tempfile.mkdtemp(prefix="mtp-fit-")) / args.zoo,
                                 Path(ensure_default_model(progress=False))))
    loaded = load_model(path, args.dtype, progress=True)
    return loaded, MtpProvider.from_loaded(loaded)


def context(tokenizer, n: int) -> list[int]:
    """n tokens of code-like text (the prompts, repeated)."""
    ids = tokenizer.encode("\n\n".join(PROMPTS) * (1 + n // 64))
    return (ids * (1 + n // max(1, len(ids))))[:n]


def row_state(loaded, provider, ids: list[int]):
    """Target caches over ids[:-1] and a source that heard them (what a request has after its prefill)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(loaded.model)
    source = provider.open()
    for s in range(0, len(ids) - 1, 512):
        chunk = ids[s: min(len(ids) - 1, s + 512)]
        loaded.model(mx.array(chunk)[None], cache=caches)
        source.heard(s, chunk)
    source.prefill(ids[:-1])
    mx.eval([c.state for c in caches])
    return caches, source


def measure_rows(loaded, provider, ids: list[int], rows: int, top: int, reps: int) -> dict:
    """Per-step seconds for ``rows`` rows at once: verify widths 1..top+1 (the ragged layout, every row keeping one
    position) and the heads' drafts of n = 1..top (batched for several rows)."""
    from server.engine.batch.mtp_drafts import MtpDraftBatch
    from server.engine.batch.ragged_kv import RaggedKV

    states = [row_state(loaded, provider, ids) for _ in range(rows)]
    verify = {}
    if rows == 1:  # the solo verifier: the row's own caches, put back after each forward (recurrent state too)
        from mlx_lm.models.cache import ArraysCache

        caches = states[0][0]
        for w in range(1, top + 2):
            x = mx.array([[ids[-1]] * w])
            times = []
            for rep in range(reps + 2):
                kept = {i: list(c.cache) for i, c in enumerate(caches) if isinstance(c, ArraysCache)}
                t = time.perf_counter()
                mx.eval(loaded.model(x, cache=caches))
                times.append(time.perf_counter() - t)
                for i, c in enumerate(caches):
                    if i in kept:
                        c.cache = kept[i]
                    else:
                        c.trim(w)
            verify[w] = statistics.median(times[2:])
    else:  # the speculating batch's ragged layout (plain KV models only: a hybrid speculates solo)
        kv = RaggedKV.from_rows([c for c, _ in states])
        for w in range(1, top + 2):
            x = mx.array([[ids[-1]] * w] * rows)

            def step():
                kv.reserve(w)
                mx.eval(loaded.model(x, cache=kv.layers))
                kv.commit([0] * rows)

            verify[w] = timed(step, reps)
    sources = [s for _, s in states]
    batch = MtpDraftBatch(provider.head) if rows > 1 else None
    if batch is not None:
        batch.join(sources)
    if batch is not None:  # every row's pending token, heard once
        batch.draft([(s, [ids[-1]], 0) for s in sources])
    else:
        sources[0].draft([ids[-1]], 0)
    draft = {}
    for n in range(1, top + 1):
        def one():
            if batch is not None:
                got = batch.draft([(s, [], n) for s in sources])
                batch.commit([(s, d, 0) for s, d in zip(sources, got)])
            else:
                d = sources[0].draft([], n)
                sources[0].commit(d, 0)

        draft[n] = timed(one, reps)
    return {"verify_s": verify, "draft_s": draft}


def acceptance(loaded, provider, prompts: list[list[int]], top: int, max_tokens: int) -> dict:
    """P(the first k drafts hold), k = 1..top, over greedy speculative rounds of ``top`` drafts; the text is checked
    against plain greedy decoding on the way."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from spec import SpecStats, speculative_decode
    from spec.adaptive import FixedDraftLength

    class Recording(FixedDraftLength):
        def __init__(self, n: int):
            super().__init__(n)
            self.rounds: list[tuple[int, int]] = []

        def update(self, drafted: int, accepted: int) -> None:
            self.rounds.append((drafted, accepted))

    policy = Recording(top)
    same = 0
    spec_s = plain_s = 0.0
    replayed = 0
    margins = []  # where a text first differs from plain greedy: plain's top-1 minus top-2 logprob there
    for i, ids in enumerate(prompts):
        for timed_pass in (False, True):  # the first pass compiles; the second is timed (its rounds recorded)
            caches, source = row_state(loaded, provider, ids)
            rounds = len(policy.rounds)
            stats = SpecStats()
            t = time.perf_counter()
            got = [t_ for t_, _, _ in speculative_decode(loaded.model, caches, ids[-1], source, max_tokens=max_tokens,
                                                         num_draft_tokens=top, policy=policy, stats=stats)]
            t_spec = time.perf_counter() - t
            if not timed_pass:
                del policy.rounds[rounds:]
            caches = make_prompt_cache(loaded.model)
            for s in range(0, len(ids) - 1, 512):  # the same prefill as row_state's, then plain greedy steps
                loaded.model(mx.array(ids[s: min(len(ids) - 1, s + 512)])[None], cache=caches)
            mx.eval([c.state for c in caches])
            t = time.perf_counter()
            steps = [(int(t_), lp) for t_, lp in generate_step(mx.array(ids[-1:]), loaded.model,
                                                                max_tokens=max_tokens, prompt_cache=caches)]
            t_plain = time.perf_counter() - t
            want = [t_ for t_, _ in steps]
        spec_s, plain_s = spec_s + t_spec, plain_s + t_plain
        replayed += stats.replayed
        same += got == want
        if got != want:
            at = next(j for j, (x, y) in enumerate(zip(got + [-1], want)) if x != y)
            top2 = mx.sort(steps[at][1].reshape(-1).astype(mx.float32))[-2:].tolist()
            margins.append({"prompt": i, "position": at, "plain_top1_minus_top2": round(top2[1] - top2[0], 5)})
    full = [(d, a) for d, a in policy.rounds if d == top]
    p = {k: (sum(1 for _, a in full if a >= k) / len(full) if full else 0.0) for k in range(1, top + 1)}
    return {"rounds": len(full), "p_first_k_hold": p, "texts_equal_plain": same, "prompts": len(prompts),
            "first_difference": margins, "rounds_replayed": replayed,
            "decode_s": {"mtp": round(spec_s, 4), "plain": round(plain_s, 4)},
            "measured_speedup_over_plain": round(plain_s / spec_s, 3) if spec_s else None}


def echo_weights(model) -> None:
    """Make the random target's greedy next token its current one by a wide margin (bench/gpu_spec_oracle.py's
    ``echo``, for any family): every layer's output projections scaled by 1e-3, the output head the embedding. The
    kernels run at their real shapes (speed does not depend on values), and the greedy text no longer flips with the
    last bit, so a forced draft's acceptance is what it says."""
    from mlx.utils import tree_flatten, tree_unflatten

    params = dict(tree_flatten(model.parameters()))
    small = [(n, p * 1e-3) for n, p in params.items()
             if n.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")) and ".mtp." not in f".{n}"]
    embed = next(p for n, p in params.items() if n.endswith("embed_tokens.weight") and "mtp" not in n)
    head = [(n, embed) for n, p in params.items() if n.endswith("lm_head.weight") and p.shape == embed.shape]
    model.update(tree_unflatten(small + head))
    mx.eval(model.parameters())


def forced_speed(loaded, provider, prompts: list[list[int]], rates: list[float], top: int, max_tokens: int,
                 seed: int = 0, own_policy: bool = False) -> dict:
    """Greedy speculative decoding whose drafts are forced to hold with probability p each (given the ones before),
    the heads still drafting (their cost paid) and the tokens then replaced: the plain greedy continuation, or a wrong
    token. Call after ``echo_weights``. ``own_policy``: the length the server's policy picks (the source's adaptive
    ``policy``, which pauses where drafts do not pay), else always ``top``. {p: measured acceptance, texts equal
    plain, decode s mtp / plain, speedup}."""
    import random

    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from spec import SpecStats, speculative_decode
    from spec.adaptive import FixedDraftLength

    class Forced:
        hears_hidden = True

        def __init__(self, inner, want: list[int], p: float, rng):
            self.inner, self.want, self.p, self.rng, self.fed = inner, want, p, rng, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def draft(self, feed, n):
            self.fed += len(feed)
            return self._force(len(self.inner.draft(feed, n)))

        def draft_lazy(self, feed, n):  # the head's drafts are asked for (their cost paid), then replaced
            self.fed += len(feed)
            proposed = self.inner.draft_lazy(feed, n)
            return None if proposed is None else mx.array(self._force(proposed.shape[0]), mx.uint32)

        def _force(self, drafted: int) -> list[int]:
            out, holding = [], True
            for j in range(drafted):
                i = self.fed - 1 + j  # the draft guesses the plain text's token i
                holding = holding and self.rng.random() < self.p and i < len(self.want)
                right = self.want[i] if i < len(self.want) else 0
                out.append(right if holding else right ^ 1)  # another id of the vocabulary (its size is even)
            if drafted:
                self.inner._open = list(out)  # what it commits (the accepted ones join its sequence) are these
            return out

    rng = random.Random(seed)
    out = {}
    wants = []
    plain_s = 0.0
    for ids in prompts:
        for _ in range(2):  # the first compiles
            caches = make_prompt_cache(loaded.model)
            for s in range(0, len(ids) - 1, 512):
                loaded.model(mx.array(ids[s: min(len(ids) - 1, s + 512)])[None], cache=caches)
            mx.eval([c.state for c in caches])
            t = time.perf_counter()
            want = [int(t_) for t_, _ in generate_step(mx.array(ids[-1:]), loaded.model, max_tokens=max_tokens,
                                                       prompt_cache=caches)]
            dt = time.perf_counter() - t
        wants.append(want)
        plain_s += dt
    for p in rates:
        spec_s, same = 0.0, 0
        stats_all = SpecStats()
        for ids, want in zip(prompts, wants):
            for timed_pass in (False, True):
                caches, source = row_state(loaded, provider, ids)
                stats = SpecStats()
                t = time.perf_counter()
                got = [t_ for t_, _, _ in speculative_decode(
                    loaded.model, caches, ids[-1], Forced(source, want, p, rng), max_tokens=max_tokens,
                    num_draft_tokens=top, stats=stats,
                    policy=provider.policy(top, recurrent=not loaded_plain_kv(loaded)) if own_policy
                    else FixedDraftLength(top))]
                dt = time.perf_counter() - t
            spec_s += dt
            same += got == want
            stats_all += stats
        out[str(p)] = {"acceptance": round(stats_all.acceptance_rate, 3),
                       "mean_accepted_per_round": round(stats_all.mean_accepted_length, 3),
                       "rounds_replayed": stats_all.replayed, "texts_equal_plain": same,
                       "decode_s": {"mtp": round(spec_s, 4), "plain": round(plain_s, 4)},
                       "measured_speedup_over_plain": round(plain_s / spec_s, 3)}
        print(f"forced p={p}: acceptance {out[str(p)]['acceptance']}, texts equal {same}/{len(prompts)}, "
              f"replayed {stats_all.replayed}, speedup over plain (pipelined) {out[str(p)]['measured_speedup_over_plain']}x",
              flush=True)
    return out


def model_of(measured: dict, p: dict, top: int) -> dict:
    ws = sorted(measured["verify_s"])
    a, m = fit_line([w - 1 for w in ws], [measured["verify_s"][w] for w in ws])
    ns = sorted(measured["draft_s"])
    d0, d1 = fit_line(ns, [measured["draft_s"][n] for n in ns])
    plain = measured["verify_s"][1]
    table = {}
    for n in range(1, top + 1):
        tokens = 1 + sum(p[k] for k in range(1, n + 1))
        cost = measured["verify_s"][n + 1] + measured["draft_s"][n]
        table[n] = {"tokens_per_step": round(tokens, 3), "step_s": round(cost, 6),
                    "speedup_over_plain": round(tokens * plain / cost, 3)}
    best = max(table, key=lambda n: table[n]["speedup_over_plain"])
    return {"plain_step_s": round(plain, 6), "fit": {"a_s": a, "m_s": m, "verify_overhead": m / a if a else None,
                                                      "draft_d0_s": d0, "draft_d1_s": d1,
                                                      "cost_ratio": (d0 + d1) / a if a else None},
            "break_even_acceptance": round((m + d1) / a, 4) if a else None,
            "by_draft_length": table, "best_draft_length": best,
            "speed_by_acceptance": speed_by_acceptance(measured, top)}


def speed_by_acceptance(measured: dict, top: int, rates=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)) -> dict:
    """{p: {"best_draft_length", "speedup_over_plain"}}: each draft holding with probability p given the ones before
    it (P(first k hold) = p^k), the measured step costs."""
    plain = measured["verify_s"][1]
    out = {}
    for p in rates:
        speed = {n: (1 + sum(p ** k for k in range(1, n + 1))) * plain
                 / (measured["verify_s"][n + 1] + measured["draft_s"][n]) for n in range(1, top + 1)}
        n = max(speed, key=lambda k: speed[k])
        out[str(p)] = {"best_draft_length": n, "speedup_over_plain": round(speed[n], 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint that ships MTP heads (what --model accepts)")
    src.add_argument("--zoo", choices=["qwen3_5", "glm4_moe_lite", "nemotron_h"],
                     help="tests.fixtures.zoo_mtp's tiny model")
    src.add_argument("--shape", help="bench/gpu.py's random-weight shape with untrained heads, built into --model-dir "
                                     "(qwen3_5 shapes: qwen3.5-9b, qwen3.5-tiny)")
    ap.add_argument("--model-dir", default="/dev/shm/mlx-lane-mtp-model", help="where --shape builds (default %(default)s)")
    ap.add_argument("--reuse-model", action="store_true", help="--shape: use the model in --model-dir if it is there")
    ap.add_argument("--vocab", type=int, default=None, help="--shape: cut the vocabulary to this size")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".whl" / "tok"),
                    help="--shape: tokenizer files to copy in (default .whl/tok, else the default model's)")
    ap.add_argument("--fit-steps", type=int, default=0, help="train the head this many steps first (default 0: no)")
    ap.add_argument("--fit-on", choices=["stdlib", "measured"], default="stdlib",
                    help="stdlib: greedy continuations of Python standard-library windows, held out from the measured "
                         "prompts; measured: the measured prompts' own continuations (a random-weight target's "
                         "tokens follow no pattern a head could learn beyond the text it saw, so this is how a random "
                         "target reaches a real head's acceptance: by memory; say so where the figure is used)")
    ap.add_argument("--fit-lr", type=float, default=3e-4,
                    help="AdamW's peak learning rate, cosine-decayed (default 3e-4: the 10-layer GLM-4.7-Flash-shaped "
                         "head fitted fully at 3e-4 in 1,000 steps on the H200, reached 0.29 at depth 1 at 1e-3 and "
                         "0.15 at 3e-3; the Qwen3.5-9B head was fitted at 3e-3: BENCHMARKS.md, 2026-12-07)")
    ap.add_argument("--fit-depth", type=int, default=2, choices=[1, 2, 3, 4],
                    help="chained drafts the fit trains (default 2; a Qwen-family head trains 3 and 4 exactly too, "
                         "bench/mtp_train.py)")
    ap.add_argument("--fit-experts", choices=["gather", "dense"], default="gather",
                    help="how a mixture-of-experts head's experts compute while it trains (bench/mtp_train.py fit): "
                         "gather (mlx-lm's gather_mm, the default) or dense (every expert for every token, no "
                         "gather_mm gradient)")
    ap.add_argument("--fit-sequences", type=int, default=64, help="greedy continuations to fit on (default 64)")
    ap.add_argument("--fit-prompt-tokens", type=int, default=64)
    ap.add_argument("--fit-new-tokens", type=int, default=192)
    ap.add_argument("--fit-batch", type=int, default=4, help="sequences per training step (default 4)")
    ap.add_argument("--save", default=None, help="write the fitted head's checkpoint here (--shape: in place)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--context", type=int, default=2048, help="tokens each row's caches hold (default 2048)")
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--rows", default="1", help="rows measured at once, e.g. 1,16 (default 1)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--forced", default="",
                    help="then, with echo weights (see echo_weights), decode with drafts forced to hold with each "
                         "of these probabilities, e.g. 0.5,0.7,0.9: the measured speed-vs-acceptance curve")
    ap.add_argument("--rewind", default="choose",
                    help="how a hybrid's rejected drafts are taken back, one or more of choose,replay (spec.rewind; "
                         "the first one's acceptance feeds the model; default %(default)s)")
    ap.add_argument("--reads", default="lazy",
                    help="forced drafts: when a round reads its drafts, one or more of lazy,wait (lazy: with the "
                         "verify forward's verdict, one wait a round, the default since 2026-12-06; wait: before "
                         "building the verify forward, as before; spec.verify.READ_DRAFTS_WITH_VERDICT)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from common import ensure_blas_here, run_record, write_result

    ensure_blas_here()  # on the CPU, MLX's matmuls run on OpenBLAS only when it is preloaded (ENVIRONMENT.md)

    if args.shape and not Path(args.tokenizer_dir, "tokenizer.json").is_file():
        from models import ensure_default_model

        args.tokenizer_dir = str(ensure_default_model(progress=False))
    loaded, provider = load(args)
    tokenizer = loaded.tokenizer
    ids = context(tokenizer, args.context)
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    result = {**run_record(), "args": vars(args), "mlx_enable_tf32": os.environ.get("MLX_ENABLE_TF32"),
              "heads": provider.facts.__dict__ if provider.facts else None, "rows": {}}
    if args.fit_steps:
        result["fit"] = fit_head(args, loaded, provider, prompts)
    import spec.rewind

    result["acceptance_by_rewind"] = {}
    for mode in args.rewind.split(","):  # the same rounds, a hybrid's rejected drafts taken back one way or the other
        spec.rewind.CHOOSE = mode == "choose"
        got = result["acceptance_by_rewind"][mode] = acceptance(loaded, provider, prompts, args.max_draft,
                                                                args.max_tokens)
        print(f"[rewind {mode}] acceptance (first k drafts hold, {got['rounds']} rounds): "
              + ", ".join(f"k={k} {v:.2f}" for k, v in got["p_first_k_hold"].items())
              + f"; texts equal to plain greedy {got['texts_equal_plain']}/{len(prompts)} (first differences "
              f"{got['first_difference']}); rounds replayed {got['rounds_replayed']}; decode {got['decode_s']} s, "
              f"measured speedup {got['measured_speedup_over_plain']}x", flush=True)
    spec.rewind.CHOOSE = True
    result["acceptance"] = next(iter(result["acceptance_by_rewind"].values()))
    p = result["acceptance"]["p_first_k_hold"]
    for rows in [int(x) for x in args.rows.split(",") if x]:
        if rows > 1 and not loaded_plain_kv(loaded):
            print(f"rows {rows}: skipped (recurrent or windowed layers: such a model's requests speculate solo)")
            continue
        measured = measure_rows(loaded, provider, ids, rows, args.max_draft, args.reps)
        fitted = model_of(measured, p, args.max_draft)
        result["rows"][str(rows)] = {"measured": measured, **fitted}
        print(f"rows {rows}: plain step {fitted['plain_step_s'] * 1e3:.2f} ms, verify overhead "
              f"{fitted['fit']['verify_overhead']}, cost ratio {fitted['fit']['cost_ratio']}, break-even acceptance "
              f"{fitted['break_even_acceptance']}; best n={fitted['best_draft_length']}: "
              + ", ".join(f"n={n} {v['speedup_over_plain']}x" for n, v in fitted["by_draft_length"].items()),
              flush=True)
    if args.forced:
        echo_weights(loaded.model)  # last: it changes the target
        result["forced"] = {}
        import spec.verify

        rates = [float(x) for x in args.forced.split(",")]
        for reads in args.reads.split(","):  # keys: the rewind mode, "_wait" after it for drafts read before verifying
            spec.verify.READ_DRAFTS_WITH_VERDICT = reads == "lazy"
            tail = "" if reads == "lazy" else "_wait"
            for mode in args.rewind.split(","):
                spec.rewind.CHOOSE = mode == "choose"
                print(f"[rewind {mode}, drafts read {reads}] forced drafts, echo weights:", flush=True)
                result["forced"][mode + tail] = forced_speed(loaded, provider, prompts, rates, args.max_draft,
                                                             args.max_tokens)
                if mode == "choose":
                    print(f"[rewind choose, drafts read {reads}] forced drafts, the server's adaptive policy:",
                          flush=True)
                    result["forced"]["choose_adaptive" + tail] = forced_speed(
                        loaded, provider, prompts, rates, args.max_draft, args.max_tokens, own_policy=True)
        spec.rewind.CHOOSE, spec.verify.READ_DRAFTS_WITH_VERDICT = True, True
    if args.out:
        write_result(result, args.out)
    return 0


def fit_head(args, loaded, provider, prompts) -> dict:
    """Acceptance before, the fit (bench/mtp_train.py), and the head written where --save (or --shape) says."""
    import mtp_train

    before = acceptance(loaded, provider, prompts, args.max_draft, args.max_tokens)
    print(f"before fitting: acceptance {before['p_first_k_hold']}", flush=True)
    t = time.perf_counter()
    if args.fit_on == "measured":  # the measured prompts' own continuations, each alone (see --fit-on)
        sequences = []
        for ids in prompts:
            (seq,) = mtp_train.continuations(loaded.model, [ids], args.max_tokens + args.max_draft + 2)
            sequences.append(seq)
    else:
        windows = mtp_train.fit_prompts(loaded.tokenizer, args.fit_sequences, args.fit_prompt_tokens)
        sequences = mtp_train.continuations(loaded.model, windows, args.fit_new_tokens)
    made_s = time.perf_counter() - t
    print(f"{len(sequences)} greedy continuations ({args.fit_on}) of {min(map(len, sequences))}-{max(map(len, sequences))} "
          f"tokens in {made_s:.1f} s", flush=True)
    fitted = mtp_train.fit(loaded, provider.head, provider.tap, sequences, args.fit_steps, lr=args.fit_lr,
                           depth=args.fit_depth, batch=args.fit_batch, experts=args.fit_experts)
    out = args.save or (args.model_dir if args.shape else None)
    if out:
        mtp_train.write_heads(provider.head, loaded.model, Path(loaded.path), Path(out))
        print(f"fitted head written to {out}", flush=True)
    return {**fitted, "continuations_s": round(made_s, 1), "acceptance_before": before, "written_to": out}


def loaded_plain_kv(loaded) -> bool:
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return all(type(c) is KVCache for c in make_prompt_cache(loaded.model))


if __name__ == "__main__":
    raise SystemExit(main())
