"""Warm RAM-hit TTFT with exactly one new token, as a ratio to one plain decode step.

A base prompt of --context tokens (token ids, so the count is exact) is sent once to
`mlx-lane serve` through /v1/completions to fill its prefix cache. Then, each round:

  hit    the base prompt + 1 new token (a different one every round), streamed, max_tokens=2, logprobs on:
         TTFT = request sent -> first chunk carrying a token (with logprobs every token has a chunk, even one
         whose text the streaming detokenizer holds back: a lone space comes out with the next token); the
         first non-empty text chunk is recorded too; the server reuses the base prompt's KV (cached_tokens is
         checked) and forwards a single token;
  step   raw mlx_lm in this process: one forward of one token on a warm KV cache holding the
         same base prompt (median of --steps steps, each trimmed back), i.e. one plain decode
         step of the same model at the same context length;
  itl    the server's own decode inter-token time (median gap between streamed tokens of a
         --decode-tokens generation on the same base prompt).

The three are alternated every round (order rotated), --rounds rounds, medians and min-max.
Target: hit TTFT <= 1.3x the plain decode step. A preflight of the machine is recorded right before the rounds
and after them.

    python bench/warm_hit.py --rounds 7 --context 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from common import ROOT, ServerProc, ensure_blas_here, median_range, preflight, run_record, sse_chunks, write_result

MODEL_DIR = Path.home() / ".cache" / "mlx-lane" / "models" / "SmolLM2-135M-Instruct"

BASE_TEXT = (
    "def merge_intervals(intervals):\n    \"\"\"Merge overlapping [start, end] pairs.\"\"\"\n"
    "    out = []\n    for s, e in sorted(intervals):\n        if out and s <= out[-1][1]:\n"
    "            out[-1][1] = max(out[-1][1], e)\n        else:\n            out.append([s, e])\n"
    "    return out\n\n# Tests: merge_intervals([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]\n"
)


def stream_completion(client, url: str, prompt: list[int], max_tokens: int, eos: list[int], token_stamps=None):
    """Stamps of the chunks that carry text; with ``token_stamps`` (a list) the request asks for logprobs, so that
    every token has a chunk even when its text is held back (a lone space, half a UTF-8 character: the streaming
    detokenizer emits it with the next token), and the stamps of chunks carrying a token go there."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {str(e): -100 for e in eos}}
    if token_stamps is not None:
        body["logprobs"] = 0
    stamps = []
    usage = {}
    for elapsed, chunk in sse_chunks(client, url + "/v1/completions", body, timeout=600):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            if ch.get("text"):
                stamps.append(elapsed)
            if token_stamps is not None and (ch.get("logprobs") or {}).get("tokens"):
                token_stamps.append(elapsed)
    return stamps, usage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=1024, help="base prompt tokens (default 1024)")
    ap.add_argument("--steps", type=int, default=5, help="raw decode steps per round (median)")
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--model-dir", default=str(MODEL_DIR))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "warm_hit.json"))
    args = ap.parse_args()
    ensure_blas_here()

    import httpx
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model, tokenizer = load(args.model_dir)
    eos = sorted(tokenizer.eos_token_ids)
    ids = tokenizer.encode(BASE_TEXT, add_special_tokens=False)
    base = (ids * (args.context // len(ids) + 1))[: args.context]
    vocab_words = tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
                                   "omicron pi rho sigma tau upsilon phi chi psi omega", add_special_tokens=False)

    # raw: one warm cache over the base prompt
    cache = make_prompt_cache(model)
    for i in range(0, len(base), 512):
        mx.eval(model(mx.array(base[i:i + 512])[None], cache=cache), [c.state for c in cache])

    def raw_step(token: int) -> float:
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            logits = model(mx.array([[token]]), cache=cache)
            mx.eval(mx.argmax(logits[0, -1]))
            times.append(time.perf_counter() - t0)
            trim_prompt_cache(cache, 1)
        return statistics.median(times)

    raw_step(base[-1])  # warm-up

    srv = ServerProc("--model", args.model_dir, "--log-level", "warning")
    hits, text_hits, steps, itls, cached_ok = [], [], [], [], []
    client = httpx.Client()
    try:
        stream_completion(client, srv.url, base, 1, eos)  # fill the prefix cache (cold prefill)
        stream_completion(client, srv.url, base + [vocab_words[-1]], 2, eos)  # warm the hit path once
        pf = preflight()
        for r in range(args.rounds):
            new_tok = vocab_words[r % len(vocab_words)]

            def hit():
                tokens_at: list = []
                stamps, usage = stream_completion(client, srv.url, base + [new_tok], 2, eos, tokens_at)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                cached_ok.append(cached == len(base))
                hits.append(tokens_at[0])
                text_hits.append(stamps[0])

            def step():
                steps.append(raw_step(new_tok))

            def itl():
                stamps, _ = stream_completion(client, srv.url, base + [vocab_words[(r + 7) % len(vocab_words)]],
                                              args.decode_tokens, eos)
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                itls.append(statistics.median(gaps))

            fns = [hit, step, itl]
            k = r % 3
            for fn in fns[k:] + fns[:k]:
                fn()
            print(f"round {r + 1}: hit TTFT {hits[-1] * 1000:7.1f} ms, raw step {steps[-1] * 1000:7.1f} ms, "
                  f"served inter-token {itls[-1] * 1000:7.1f} ms, cached ok {cached_ok[-1]}", flush=True)
        pf_end = preflight()
        stats = client.get(srv.url + "/stats", timeout=30).json()
    finally:
        client.close()
        code = srv.stop()
    ratio_step = [h / s for h, s in zip(hits, steps)]
    ratio_itl = [h / i for h, i in zip(hits, itls)]
    result = {
        **run_record(),
        "preflight": pf,
        "load_avg_end": os.getloadavg(),
        "context_tokens": len(base),
        "rounds": args.rounds,
        "hit_ttft_ms": median_range([h * 1000 for h in hits]),
        "hit_ttft_method": "request sent -> first chunk carrying a token (logprobs on)",
        "hit_first_text_ms": median_range([h * 1000 for h in text_hits]),
        "first_text_over_raw_step": median_range([h / s for h, s in zip(text_hits, steps)]),
        "raw_decode_step_ms": median_range([s * 1000 for s in steps]),
        "served_inter_token_ms": median_range([i * 1000 for i in itls]),
        "ttft_over_raw_step": median_range(ratio_step),
        "ttft_over_raw_step_median": round(statistics.median(ratio_step), 3),
        "ttft_over_served_inter_token": median_range(ratio_itl),
        "all_hits_cached_full_base": all(cached_ok),
        "server_exit_code": code,
        "prompt_cache": stats.get("prompt_cache"),
        "preflight_end": pf_end,
    }
    write_result(result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
