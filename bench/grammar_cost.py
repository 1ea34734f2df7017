"""Cost of constrained decoding: decode tok/s of mlx-lane with and without a JSON schema, alternated in one run.

One live server (the default model unless --model), the same prompt for both kinds, --tokens tokens at
temperature 0 with EOS banned (logit_bias -100), streamed. "schema" adds a `response_format` json_schema whose
shortest valid answer is longer than --tokens (an array of at least 40 small objects), so both kinds decode
exactly --tokens tokens and the grammar never ends the answer early. Every round runs both kinds, order rotated;
decode tok/s = (tokens - 1) / (last content chunk - first content chunk), tokens from the usage chunk. The grammar
is compiled per request on the handler side: the time to the first token ("ttft_s") includes it.

    python bench/grammar_cost.py [--model default] [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ROOT, ServerProc, ensure_blas_here, preflight, run_record, spread, sse_chunks, write_result)

PROMPT = "List the employees of a small company as JSON: name, age and whether they work remotely."
SCHEMA = {
    "type": "object",
    "properties": {"employees": {"type": "array", "minItems": 40, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 18, "maximum": 70},
                       "remote": {"type": "boolean"}},
        "required": ["name", "age", "remote"], "additionalProperties": False}}},
    "required": ["employees"], "additionalProperties": False,
}


def one(client, url: str, tokens: int, eos: list[int], schema: dict | None) -> dict:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": {str(e): -100 for e in eos}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "employees", "schema": schema}}
    stamps, usage, first, text = [], None, None, []
    for elapsed, chunk in sse_chunks(client, url + "/v1/chat/completions", body):
        usage = chunk.get("usage") or usage
        for ch in chunk.get("choices") or []:
            content = (ch.get("delta") or {}).get("content")
            if content:
                stamps.append(elapsed)
                text.append(content)
                first = elapsed if first is None else first
    n = (usage or {}).get("completion_tokens") or len(stamps)
    rate = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return {"decode_tok_s": rate, "ttft_s": first, "completion_tokens": n, "text": "".join(text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--note", default="", help="free text stored with the result (e.g. the machine was shared)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_cost.json"))
    args = ap.parse_args()
    ensure_blas_here()

    import httpx
    from mlx_lm.utils import load_tokenizer

    from models import ensure_default_model

    model_dir = ensure_default_model(progress=False) if args.model == "default" else Path(args.model)
    eos = sorted(int(e) for e in (load_tokenizer(Path(model_dir)).eos_token_ids or []))
    server = ServerProc("--model", args.model, "--cache-bytes", "256M")
    kinds = {"plain": None, "schema": SCHEMA}
    rows = {k: [] for k in kinds}
    try:
        client = httpx.Client()
        for k, schema in kinds.items():  # warm-up: kernels, the llguidance tokenizer (built on first use)
            one(client, server.url, 8, eos, schema)
        pf = preflight()
        names = list(kinds)
        for i in range(args.rounds):
            for k in names[i % 2:] + names[:i % 2]:
                r = one(client, server.url, args.tokens, eos, kinds[k])
                rows[k].append(r)
                print(f"round {i} {k:6s} decode {r['decode_tok_s']:.2f} tok/s  ttft {r['ttft_s']:.3f} s  "
                      f"{r['completion_tokens']} tokens", flush=True)
        pf_end = preflight()
    finally:
        server.stop()

    summary = {k: {"decode_tok_s": spread([round(r["decode_tok_s"], 3) for r in v]),
                   "ttft_s": spread([round(r["ttft_s"], 4) for r in v]),
                   "completion_tokens": [r["completion_tokens"] for r in v]} for k, v in rows.items()}
    ratio = summary["schema"]["decode_tok_s"]["median"] / summary["plain"]["decode_tok_s"]["median"]
    result = {**run_record(), "model": args.model, "note": args.note, "preflight": pf, "preflight_end": pf_end,
              "config": {"rounds": args.rounds, "tokens": args.tokens, "prompt": PROMPT, "schema": SCHEMA,
                         "alternation": "every round runs both kinds, order rotated"},
              "summary": summary, "schema_over_plain_decode": round(ratio, 3),
              "sample_schema_text": rows["schema"][-1]["text"]}
    write_result(result, args.out)
    for k, s in summary.items():
        print(f"{k:6s} decode {s['decode_tok_s']['median']:.2f} tok/s ({s['decode_tok_s']['min']:.2f}-"
              f"{s['decode_tok_s']['max']:.2f})  ttft {s['ttft_s']['median']:.3f} s")
    print(f"schema / plain decode: {ratio:.3f}")


if __name__ == "__main__":
    main()
