"""Served decode tok/s (HTTP streaming through mlx-lane) vs raw mlx_lm generate_step.

Same model directory, same prompt tokens, same greedy sampler, EOS suppressed by a logit
bias on both sides so every run decodes exactly --tokens tokens. The two are alternated
for --rounds rounds in one process run; we report medians and min-max, and the ratio. JSON (with a
preflight of the machine before and after the rounds) in bench/results/decode_overhead.json.

    python bench/decode_overhead.py --rounds 5 --tokens 96
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import ROOT, ServerProc, ensure_blas_here, median_range, preflight, run_record, write_result

PROMPT = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper and the sea."}]


def served_rate(url: str, tokens: int, eos: list[int]) -> float:
    import httpx

    body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(e): -100 for e in eos}}
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                    stamps.append(time.perf_counter())
    # first stamp is the role chunk; tokens follow one chunk each (empty text chunks are skipped
    # by the server, so count only the time span over the chunks we saw).
    stamps = stamps[1:]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def raw_rate(model, tokenizer, tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    procs = make_logits_processors(logit_bias={e: -100.0 for e in tokenizer.eos_token_ids})
    stamps = []
    for _tok, _lp in generate_step(mx.array(prompt), model, max_tokens=tokens, logits_processors=procs):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_overhead.json"))
    args = ap.parse_args()
    ensure_blas_here()

    from models import load_model

    loaded = load_model("default")
    eos = sorted(loaded.tokenizer.eos_token_ids)
    srv = ServerProc("--model", "default", "--cache-bytes", "0")
    served, raw = [], []
    try:
        served_rate(srv.url, 8, eos)  # warm-up both
        raw_rate(loaded.model, loaded.tokenizer, 8)
        pf = preflight()
        for i in range(args.rounds):
            pair = [("served", lambda: served_rate(srv.url, args.tokens, eos)),
                    ("raw", lambda: raw_rate(loaded.model, loaded.tokenizer, args.tokens))]
            if i % 2:
                pair.reverse()
            for name, fn in pair:
                (served if name == "served" else raw).append(fn())
            print(f"round {i + 1}: served {served[-1]:.2f} tok/s, raw {raw[-1]:.2f} tok/s", flush=True)
        pf_end = preflight()
    finally:
        srv.stop()
    ratio = [s / r for s, r in zip(served, raw)]
    result = {
        **run_record(),
        "preflight": pf,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "served_tok_s": median_range(served),
        "raw_tok_s": median_range(raw),
        "ratio_median": round(statistics.median(ratio), 3),
        "ratio_per_round": [round(x, 3) for x in ratio],
        "preflight_end": pf_end,
    }
    write_result(result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
