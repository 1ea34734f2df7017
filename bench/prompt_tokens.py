"""What tokenizing an agent's resent conversation costs, whole (what mlx_lm.server does: the template's
``apply_chat_template(..., tokenize=True)``) vs from the pieces earlier turns tokenized (server.core.token_cache), side
by side in one process on the default model's tokenizer (issue 45: the lane's fixed cost outside the model).

For each --tokens size: a conversation of ~N tokens (a long system prompt, then user / assistant turns), whose
previous turn (the same conversation without its last exchange) was tokenized once through the cache; then, --reps
times each, interleaved: the whole template tokenized (the peer's way) and ours (the template rendered as text, then
the piece cache). Medians in ms, and the ratio ours / whole. Both are checked to give the same ids.

    python bench/prompt_tokens.py --tokens 8000,32000 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import write_result  # noqa: E402

FILL = ("The build system reads the manifest, resolves every dependency to a pinned version, fetches what is "
        "missing into the local cache and then compiles each package in topological order. ")


def conversation(tok, n_tokens: int) -> list[dict]:
    msgs = [{"role": "system", "content": FILL * 40}]
    i = 0
    while len(tok.encode(" ".join(m["content"] for m in msgs))) < n_tokens:
        msgs.append({"role": "user", "content": f"step {i}: tool output follows.\n" + FILL * 10})
        msgs.append({"role": "assistant", "content": f"Done with step {i}. " + FILL * 3})
        i += 1
    msgs.append({"role": "user", "content": "Go on."})
    return msgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8000,32000")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prompt_tokens.json"))
    args = ap.parse_args()

    from mlx_lm.utils import load_tokenizer

    from models import ensure_default_model
    from server.core.token_cache import SegmentEncoder

    tok = load_tokenizer(ensure_default_model(progress=False))
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        msgs = conversation(tok, n)
        enc = SegmentEncoder(tok)
        enc.encode(tok.apply_chat_template(msgs[:-3] + msgs[-1:], add_generation_prompt=True, tokenize=False))
        whole_ms, ours_ms = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            want = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
            whole_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            got = enc.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
            ours_ms.append((time.perf_counter() - t0) * 1000)
            assert got == want, "the piece cache changed the tokens"
        row = {"tokens": len(want), "messages": len(msgs), "whole_ms": round(statistics.median(whole_ms), 2),
               "ours_ms": round(statistics.median(ours_ms), 2),
               "ratio": round(statistics.median(ours_ms) / statistics.median(whole_ms), 4), "cache": enc.stats()}
        rows.append(row)
        print(f"{row['tokens']:6d} tokens, {row['messages']} messages: whole {row['whole_ms']:.2f} ms, "
              f"from pieces {row['ours_ms']:.2f} ms, ratio {row['ratio']:.3f}", flush=True)
    write_result({"script": "prompt_tokens.py", "argv": sys.argv[1:], "rows": rows}, args.out)


if __name__ == "__main__":
    main()
