"""Speculative decode speed vs plain decode, alternated in one run, greedy, same prompt tokens.

Two sources:
- ngram (default): prompt lookup on an agent-style "repeat this file with one change" prompt,
  on the target alone (default: the packaged default model);
- two-model: ``--draft DIR`` (a smaller model with the target's tokenizer, e.g. the converted
  Qwen2.5-Coder-0.5B-Instruct for the 1.5B target) on a coding prompt.

Both sides start from the same prefilled caches (prefill is not timed), decode until EOS or
--tokens, and must produce identical token ids (the script fails otherwise). Reported: decode
tok/s medians (min-max) over --rounds, the speed-up, and acceptance counters; JSON (with a preflight of the
machine before and after the rounds) in bench/results/speculative_ngram.json or speculative_two_model.json.

    python bench/speculative.py --rounds 3 --tokens 200          # ngram, k=8
    # measured on the 2-core CPU while other jobs loaded it: k=8 2.79x median (2.17-3.67),
    # 74.5% of tokens from drafts; k=4 1.64x (1.34-2.48); text identical every round
    python bench/speculative.py --target ~/.cache/mlx-lane/models/Qwen2.5-Coder-1.5B-Instruct \
        --draft ~/.cache/mlx-lane/models/Qwen2.5-Coder-0.5B-Instruct --kind two-model
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import ROOT, ensure_blas_here, median_range, preflight, run_record, write_result

FILE = '''import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Config:
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 2
    log_level: str = "info"


def load_config(path: Path) -> Config:
    data = json.loads(path.read_text())
    return Config(
        host=data.get("host", "127.0.0.1"),
        port=int(data.get("port", 8080)),
        workers=int(data.get("workers", 2)),
        log_level=data.get("log_level", "info"),
    )


def save_config(config: Config, path: Path) -> None:
    data = {
        "host": config.host,
        "port": config.port,
        "workers": config.workers,
        "log_level": config.log_level,
    }
    path.write_text(json.dumps(data, indent=2))
'''

PROMPTS = {
    "repeat": [
        {"role": "user", "content": "Here is config.py:\n\n```python\n" + FILE + "```\n\n"
         "Rewrite the whole file with one change: the default port becomes 9090. Output the complete file "
         "in one code block and nothing else."},
    ],
    "code": [
        {"role": "user", "content": "Write a Python function that parses an INI file into a dict of dicts, "
         "with type hints, a docstring and error handling, then a short test with pytest."},
    ],
}


def decode(loaded, prompt: list[int], tokens: int, provider=None, k: int = 4, adaptive: bool = True):
    """(token ids, seconds, stats) of one greedy decode from freshly prefilled caches."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from spec import FixedDraftLength, SpecStats, speculative_decode

    model, eos = loaded.model, set(loaded.tokenizer.eos_token_ids)
    caches = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=caches)
    mx.eval([c.state for c in caches])
    stats = SpecStats()
    if provider is None:
        steps = ((t, lp, False) for t, lp in generate_step(mx.array(prompt[-1:]), model, max_tokens=tokens,
                                                              prompt_cache=caches))
    else:
        source = provider.open()
        source.prefill(prompt[:-1])
        policy = provider.policy(k) if adaptive else FixedDraftLength(k)
        steps = speculative_decode(model, caches, prompt[-1], source, max_tokens=tokens, num_draft_tokens=k,
                                   policy=policy, stats=stats)
    out = []
    t0 = time.perf_counter()
    for t, _, _ in steps:
        out.append(t)
        if t in eos:
            break
    steps.close()
    return out, time.perf_counter() - t0, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="default", help="model spec or directory (default: the default model)")
    ap.add_argument("--draft", default=None, help="draft model directory for --kind two-model")
    ap.add_argument("--kind", choices=["ngram", "two-model"], default=None)
    ap.add_argument("--prompt", choices=sorted(PROMPTS), default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=None, help="max draft tokens per round (default: 8 ngram, 4 two-model)")
    ap.add_argument("--fixed", action="store_true", help="fixed draft length k instead of the adaptive policy")
    ap.add_argument("--out", default=None, help="default: bench/results/speculative_<kind>.json")
    args = ap.parse_args()
    ensure_blas_here()

    from models import load_model
    from spec import NgramProvider, SpecStats, TwoModelProvider

    kind = args.kind or ("two-model" if args.draft else "ngram")
    if args.k is None:
        args.k = 8 if kind == "ngram" else 4
    loaded = load_model(args.target, progress=False)
    if kind == "two-model":
        if not args.draft:
            ap.error("--kind two-model needs --draft DIR")
        provider = TwoModelProvider.from_loaded(loaded, load_model(args.draft, progress=False))
    else:
        provider = NgramProvider()
    prompt_name = args.prompt or ("repeat" if kind == "ngram" else "code")
    prompt = loaded.tokenizer.apply_chat_template(PROMPTS[prompt_name], add_generation_prompt=True)

    decode(loaded, prompt, 8)  # warm-up both paths
    decode(loaded, prompt, 8, provider, args.k)
    plain, spec, total = [], [], SpecStats()
    pf = preflight()
    for i in range(args.rounds):
        order = ["plain", "spec"] if i % 2 == 0 else ["spec", "plain"]
        res = {}
        for name in order:
            res[name] = decode(loaded, prompt, args.tokens, provider if name == "spec" else None, args.k,
                               not args.fixed)
        (p_ids, p_s, _), (s_ids, s_s, st) = res["plain"], res["spec"]
        if p_ids != s_ids:
            first = next((j for j, (a, b) in enumerate(zip(p_ids, s_ids)) if a != b), min(len(p_ids), len(s_ids)))
            raise SystemExit(f"round {i + 1}: speculative output differs from plain at token {first}")
        plain.append(len(p_ids) / p_s)
        spec.append(len(s_ids) / s_s)
        total += st
        print(f"round {i + 1}: {len(p_ids)} tokens, plain {plain[-1]:.2f} tok/s, spec {spec[-1]:.2f} tok/s, "
              f"accepted {st.accepted}/{st.drafted} in {st.rounds} rounds{' (stopped)' if st.stopped else ''}",
              flush=True)
    pf_end = preflight()
    ratios = [s / p for s, p in zip(spec, plain)]
    result = {
        **run_record(),
        "preflight": pf,
        "target": loaded.model_id,
        "kind": kind,
        "draft": args.draft,
        "prompt": prompt_name,
        "prompt_tokens": len(prompt),
        "generated_tokens": len(p_ids),
        "k": args.k,
        "policy": "fixed" if args.fixed else "adaptive",
        "plain_tok_s": median_range(plain),
        "spec_tok_s": median_range(spec),
        "speedup_median": round(statistics.median(ratios), 3),
        "speedup_per_round": [round(x, 3) for x in ratios],
        "text_identical": True,
        "acceptance_rate": round(total.acceptance_rate, 3),
        "mean_accepted_length": round(total.mean_accepted_length, 2),
        "from_draft_share": round(total.accepted / max(1, total.emitted), 3),
        "counters": {k: v for k, v in total.as_dict().items() if isinstance(v, int)},
        "preflight_end": pf_end,
    }
    write_result(result, args.out or ROOT / "bench" / "results" / f"speculative_{kind.replace('-', '_')}.json")
    print(json.dumps(result, indent=2))
    print("text:\n" + loaded.tokenizer.decode(p_ids))


if __name__ == "__main__":
    main()
