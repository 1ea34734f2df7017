"""Print the markdown tables of BENCHMARKS.md from the JSON results in bench/results/.

    python bench/report.py agent_replay bench/results/agent_replay.json
    python bench/report.py warm_hit bench/results/warm_hit.json
"""

from __future__ import annotations

import json
import statistics
import sys


def agent_replay(res: dict) -> str:
    s, r = res["summary"], res.get("ratios", {})
    names = [n for n in ("ours", "mlx_lm") if n in s]
    label = {"ours": "mlx-lane", "mlx_lm": "mlx_lm.server"}
    out = ["| | " + " | ".join(label[n] for n in names) + (" | ours / mlx_lm |" if len(names) == 2 else " |"),
           "|---|" + "---|" * len(names) + ("---|" if len(names) == 2 else "")]

    def row(title, key, fmt="{:.2f}", ratio=True):
        vals = [s[n][key] for n in names]
        cells = [fmt.format(v) if v is not None else "-" for v in vals]
        tail = ""
        if len(names) == 2:
            tail = f" {vals[0] / vals[1]:.3f} |" if ratio and vals[1] else " |"
        out.append(f"| {title} | " + " | ".join(cells) + " |" + tail)

    row("mean TTFT (s)", "ttft_mean_s")
    row("median TTFT (s)", "ttft_median_s")
    row("p95 TTFT (s)", "ttft_p95_s")
    row("min-max TTFT (s)", "ttft_min_s")
    out[-1] = out[-1].split("|")[0] + "| min-max TTFT (s) | " + " | ".join(
        f"{s[n]['ttft_min_s']:.2f}-{s[n]['ttft_max_s']:.2f}" for n in names) + " |" + (" |" if len(names) == 2 else "")
    row("mean TTFT, turn 1 (s)", "ttft_mean_turn1_s")
    if s[names[0]].get("ttft_mean_later_turns_s") is not None:
        row("mean TTFT, turns 2+ (s)", "ttft_mean_later_turns_s")
    row("sum of request times (s)", "total_request_time_s", "{:.1f}")
    row("prompt tokens", "prompt_tokens", "{:d}", ratio=False)
    row("reusable tokens", "reusable_tokens", "{:d}", ratio=False)
    row("cached tokens (server's usage)", "cached_tokens", "{:d}", ratio=False)
    row("cache efficiency = cached / reusable", "cache_efficiency", "{:.3f}", ratio=False)
    row("mean TTFT / ideal mean TTFT", "mean_ttft_over_ideal", "{:.2f}", ratio=False)
    text = "\n".join(out)
    if r:
        text += ("\n\nPer-request TTFT ratio ours/mlx_lm (same step, back to back): median "
                 f"{r['per_request_ratio_median']:.3f} (min-max {r['per_request_ratio_min']:.3f}-"
                 f"{r['per_request_ratio_max']:.3f})")
        if r.get("per_request_ratio_later_turns_median") is not None:
            text += f"; turns 2+ only: median {r['per_request_ratio_later_turns_median']:.3f}"
        text += "."
    # per-turn table
    recs = res["records"]
    turns = sorted({x["turn"] for x in recs})
    lines = ["| turn | mean new tokens (ours) | mean reusable | mean TTFT ours (s) | mean TTFT mlx_lm (s) | "
             "ratio | mean ideal (s) | raw prefill tok/s | cached/reusable ours | cached/reusable mlx_lm |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in turns:
        def sel(n):
            return [x for x in recs if x["turn"] == t and x["server"] == n]
        o, m = sel("ours"), sel("mlx_lm")
        mo = statistics.mean(x["ttft_s"] for x in o) if o else None
        mm = statistics.mean(x["ttft_s"] for x in m) if m else None
        ideal = [x["ideal_s"] for x in o if x["ideal_s"] is not None]
        rates = res["raw_prefill_tok_s_by_turn"].get(str(t)) or res["raw_prefill_tok_s_by_turn"].get(t) or []

        def eff(rs):
            reuse = sum(x["reusable_tokens"] for x in rs)
            return f"{sum(x['cached_tokens'] or 0 for x in rs) / reuse:.3f}" if reuse else "-"
        lines.append(
            f"| {t} | {statistics.mean(x['new_tokens'] for x in o):.0f} | "
            f"{statistics.mean(x['reusable_tokens'] for x in o):.0f} | "
            f"{mo:.2f} | {mm:.2f} | {mo / mm:.3f} | "
            f"{statistics.mean(ideal):.2f} | {', '.join(f'{x:.0f}' for x in rates)} | {eff(o)} | {eff(m)} |")
    text += "\n\n" + "\n".join(lines)
    pc = res.get("ours_stats_prompt_cache") or {}
    if pc:
        text += ("\n\nmlx-lane `/stats` `prompt_cache` after the replay: "
                 f"queries {pc.get('queries')}, hits {pc.get('hits')} (request hit rate "
                 f"{pc.get('request_hit_rate', 0):.3f}), tokens queried {pc.get('tokens_queried')}, tokens hit "
                 f"{pc.get('tokens_hit')} (token hit rate {pc.get('token_hit_rate', 0):.3f}), entries "
                 f"{pc.get('entries')}, bytes {pc.get('bytes')} of max {pc.get('max_bytes')}, evictions "
                 f"{pc.get('evictions')}, superseded {pc.get('superseded')}.")
    return text


def main() -> None:
    kind, path = sys.argv[1], sys.argv[2]
    res = json.load(open(path))
    if kind == "agent_replay":
        print(agent_replay(res))
    else:
        print(json.dumps({k: v for k, v in res.items() if k != "records"}, indent=2))


if __name__ == "__main__":
    main()
