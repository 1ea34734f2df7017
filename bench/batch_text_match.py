"""Batch text match (issue 12): how often a greedy reply generated in a batch equals the same request served alone.

For each server (--servers, bench/peers.py; default ours), started fresh, with N varied chat prompts (--n; two of
every three are short questions, every third is a long coding-agent turn from agent_workload.py: system prompt,
task, 150-400 tokens of tool output) and --max-tokens tokens at temperature 0 (non-streamed):
  1. alone: each prompt by itself, one after another (nothing else in flight);
  2. batch: all N at once (threads released together, --stagger-ms apart), so a batching lane runs them together;
  3. with --repeat-alone, the alone pass again: the noise floor (a mismatch there is not batching's doing).
Each batch text is compared with the same prompt's alone text: the match rate, and for every mismatch the first
differing character and token (the model's tokenizer on both texts, longest common prefix of the ids) with both
texts from a little before that point. For ours the RAM prompt cache is cleared (POST /admin/cache/clear) before
every alone request and before the batch pass, so both sides prefill cold and only batching differs (--keep-cache:
leave it on); mlx_lm.server has no such endpoint, so there the batch pass finds the alone pass's prompts cached.
Writes bench/results/batch_text_match.json (common.write_result) and prints a summary.

    python bench/batch_text_match.py                         # ours, 24 prompts, 32 tokens
    python bench/batch_text_match.py --servers ours,mlx_lm --repeat-alone
    python bench/batch_text_match.py --n 4 --max-tokens 8    # smoke
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
import threading
import time
from pathlib import Path

import peers as peer_servers
from agent_workload import SYSTEM_PROMPT, user_message, workload
from common import ROOT, preflight, run_record, write_result

SHORT = [
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash map is to a beginner.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about autumn leaves.",
    "What does the HTTP status code 404 mean?",
    "Give me a SQL query that counts the rows of a table named users.",
    "Why is the sky blue? Keep it short.",
    "Write a bash one-liner that counts the lines of every .py file in a directory.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Convert 100 degrees Fahrenheit to Celsius and show the formula.",
    "Suggest a name for a coffee shop run by robots.",
    "How do I undo the last git commit but keep the changes?",
    "Write a JavaScript function that returns the largest number in an array.",
]


def prompts(tokenizer, n: int, seed: int) -> list[list[dict]]:
    """N chat conversations: every third (i % 3 == 2) a long agent turn, the others short questions."""
    n_long = sum(1 for i in range(n) if i % 3 == 2)
    tasks, chunks = workload(tokenizer, max(n_long, 1), 1, seed)
    out, j, s = [], 0, 0
    for i in range(n):
        if i % 3 == 2:
            out.append([{"role": "system", "content": SYSTEM_PROMPT}, user_message(tasks[j], chunks[j][0], 0)])
            j += 1
        else:
            q = SHORT[s % len(SHORT)] + ("" if s < len(SHORT) else f" (Variant {s // len(SHORT)}.)")
            out.append([{"role": "user", "content": q}])
            s += 1
    return out


def chat(client, url: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", timeout=1200,
                    json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return {"text": body["choices"][0]["message"].get("content") or "", "usage": body.get("usage") or {},
            "finish_reason": body["choices"][0].get("finish_reason"), "seconds": round(time.perf_counter() - t0, 3)}


def clear_cache(url: str | None) -> None:
    """Empty ours' RAM prompt cache (url None: leave the cache alone)."""
    import httpx

    if url:
        httpx.post(url + "/admin/cache/clear", timeout=60).raise_for_status()


def alone_pass(url: str, convs: list[list[dict]], max_tokens: int, clear_url: str | None) -> tuple[list[dict], float]:
    """Each prompt by itself, in order (the cache cleared before each when clear_url); (results, seconds)."""
    import httpx

    t0 = time.perf_counter()
    out = []
    with httpx.Client() as c:
        for m in convs:
            clear_cache(clear_url)
            out.append(chat(c, url, m, max_tokens))
    return out, time.perf_counter() - t0


def batch_pass(url: str, convs: list[list[dict]], max_tokens: int, stagger_s: float) -> tuple[list[dict], float]:
    """All prompts at once, one thread each; a failed request is {"error": ...} in its slot."""
    import httpx

    out: list[dict | None] = [None] * len(convs)
    start = threading.Barrier(len(convs))

    def one(i: int) -> None:
        with httpx.Client() as c:
            start.wait()
            time.sleep(i * stagger_s)
            try:
                out[i] = chat(c, url, convs[i], max_tokens)
            except Exception as exc:  # recorded per prompt; the others still count
                out[i] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out, time.perf_counter() - t0


def first_diff(a, b) -> int:
    """Length of the common prefix of two strings or two lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def compare(tokenizer, ref: list[dict], other: list[dict]) -> dict:
    """Match rate of other's texts against ref's, and where each mismatch starts."""
    mismatches, matched, compared = [], 0, 0
    for i, (a, b) in enumerate(zip(ref, other)):
        if "error" in a or "error" in b:
            continue
        compared += 1
        if a["text"] == b["text"]:
            matched += 1
            continue
        c = first_diff(a["text"], b["text"])
        ta = tokenizer.encode(a["text"], add_special_tokens=False)
        tb = tokenizer.encode(b["text"], add_special_tokens=False)
        tok = first_diff(ta, tb)  # works on lists too
        mismatches.append({"prompt": i, "first_diff_char": c, "first_diff_token": tok,
                           "tokens": [len(ta), len(tb)], "ref": a["text"][max(0, c - 20):c + 40],
                           "other": b["text"][max(0, c - 20):c + 40]})
    return {"compared": compared, "matched": matched, "match_rate": round(matched / compared, 4) if compared else None,
            "mismatches": mismatches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours", help=f"comma list (from: {', '.join(peer_servers.ALL)})")
    ap.add_argument("--n", type=int, default=24, help="prompts (default 24)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stagger-ms", type=float, default=5.0, help="gap between the batch pass's requests")
    ap.add_argument("--repeat-alone", action="store_true", help="run the alone pass twice (the noise floor)")
    ap.add_argument("--keep-cache", action="store_true", help="do not clear ours' RAM prompt cache between requests")
    ap.add_argument("--ours-args", default="", help="extra `mlx-lane serve` arguments (one shell-quoted string)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "batch_text_match.json"))
    args = ap.parse_args()
    names = [n.strip() for n in args.servers.split(",") if n.strip()]

    import httpx
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(peer_servers.default_paths()[0]))
    convs = prompts(tokenizer, args.n, args.seed)
    prompt_tokens = [len(tokenizer.apply_chat_template(m, add_generation_prompt=True)) for m in convs]
    extra = {"ours": tuple(shlex.split(args.ours_args)), "llama_cpp": ("--interrupt_requests", "false")}
    peers = peer_servers.make(names, Path(tempfile.mkdtemp(prefix="batch-text-match-")), extra=extra)
    pf = preflight()
    per: dict = {}
    for p in peers:
        res: dict = {"label": p.label}
        try:
            p.start()
            with httpx.Client() as c:
                chat(c, p.url, [{"role": "user", "content": "Say hi."}], 2)  # warm-up
            clear_url = p.url if p.name == "ours" and not args.keep_cache else None
            res["cache_cleared"] = bool(clear_url)
            alone, res["alone_wall_s"] = alone_pass(p.url, convs, args.max_tokens, clear_url)
            clear_cache(clear_url)
            batch, res["batch_wall_s"] = batch_pass(p.url, convs, args.max_tokens, args.stagger_ms / 1e3)
            res.update(compare(tokenizer, alone, batch))
            res["batch_errors"] = [b["error"] for b in batch if "error" in b]
            if args.repeat_alone:
                again, res["alone2_wall_s"] = alone_pass(p.url, convs, args.max_tokens, clear_url)
                res["alone_repeat"] = compare(tokenizer, alone, again)
            res["records"] = [{"prompt": i, "prompt_tokens": prompt_tokens[i], "alone": a, "batch": b}
                              for i, (a, b) in enumerate(zip(alone, batch))]
            if p.name == "ours":
                res["lane_after"] = httpx.get(p.url + "/stats", timeout=30).json().get("lane")
        except Exception as exc:  # a server that fails is a result; the next one still runs
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            res["exit_code"] = p.stop() if p.pid() is not None else p.exit_code()
        per[p.name] = res
        mm = res.get("mismatches") or []
        print(f"{p.name:9s} batch == alone: {res.get('matched')}/{res.get('compared')} "
              f"(match rate {res.get('match_rate')}); alone {res.get('alone_wall_s', 0):.1f}s, batch "
              f"{res.get('batch_wall_s', 0):.1f}s; first differing token of mismatches: "
              f"{[m['first_diff_token'] for m in mm] or '-'}"
              + (f"; alone vs alone again: {res['alone_repeat']['match_rate']}" if "alone_repeat" in res else "")
              + (f"; ERROR {res['error']}" if "error" in res else ""), flush=True)
    result = {**run_record(), "preflight": pf, "preflight_end": preflight(),
              "config": {"servers": names, "n": args.n, "max_tokens": args.max_tokens, "seed": args.seed,
                         "stagger_ms": args.stagger_ms, "repeat_alone": args.repeat_alone,
                         "keep_cache": args.keep_cache,
                         "prompt_tokens_mean": round(statistics.mean(prompt_tokens), 1),
                         "prompt_tokens_range": [min(prompt_tokens), max(prompt_tokens)]},
              "servers": per}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
