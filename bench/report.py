"""The generated sections of BENCHMARKS.md, from the JSON results in bench/results/.

    python bench/report.py --write BENCHMARKS.md                   # regenerate every marked section in place
    python bench/report.py warm_hit bench/results/warm_hit.json    # print one result's table

A generated section sits between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`. Its content is rebuilt from the
results matching bench/results/NAME*.json, newest first by their "date" (undated ones last): busy warnings from
their preflight, the table of RENDERERS[NAME], then one provenance line per run shown (file, exact command, date,
git rev, machine facts, preflight). Text outside the markers is never touched. A NAME with no results is left as
it is (with a note on stderr); a NAME with results but no renderer gets a key/value table of the newest one.

Registering a renderer: `RENDERERS["name"] = fn`, where fn(runs: list[Run]) -> str renders the newest run
(runs[0]). `Renderer(fn, pattern=..., pick=...)` instead chooses the files (a glob in bench/results/) and which
runs fn gets (`newest(n)`, `newest_per(key)`, `every`); `provenance=False` drops the warnings and provenance lines.

About 500 lines on purpose: each section's renderer sits next to the registry and the marker rewrite, so adding a
section is one function and one RENDERERS entry in this file.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, busy_row  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Run:
    """One result file and its parsed JSON."""

    path: Path
    data: dict

    @property
    def date(self) -> str | None:
        return self.data.get("date")

    @property
    def git_rev(self) -> str | None:
        return self.data.get("git_rev") or self.data.get("git")  # ssd_restart.py wrote "git" before


Pick = Callable[[list[Run]], list[Run]]


def newest(n: int = 1) -> Pick:
    return lambda runs: runs[:n]


def newest_per(key: str) -> Pick:
    """The newest run of each distinct value of data[key], newest first."""
    def pick(runs: list[Run]) -> list[Run]:
        seen: dict = {}
        for r in runs:
            seen.setdefault(r.data.get(key), r)
        return list(seen.values())
    return pick


def every(runs: list[Run]) -> list[Run]:
    return runs


@dataclass(frozen=True)
class Renderer:
    render: Callable[[list[Run]], str]
    pattern: str | None = None  # glob in bench/results/; None means NAME*.json
    pick: Pick = newest(1)
    provenance: bool = True


def load_runs(pattern: str, results: Path = RESULTS) -> list[Run]:
    runs = [Run(p, json.loads(p.read_text())) for p in results.glob(pattern)]
    return sorted(runs, key=lambda r: (_date_key(r.date), r.path.name), reverse=True)


def _date_key(date: str | None) -> str:
    m = re.match(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d)(:\d\d)?", date or "")
    return f"{m[1]} {m[2]}{m[3] or ':00'}" if m else ""


# ---------------------------------------------------------------------------------------------- number formatting

def num(x, nd: int = 2, sep: bool = False) -> str:
    """x rounded half-up to nd decimals, as written (JSON numbers are decimals: 0.745 -> 0.75, not 0.74)."""
    d = Decimal(repr(x) if isinstance(x, float) else str(x)).quantize(Decimal(1).scaleb(-nd), ROUND_HALF_UP)
    return f"{d:,}" if sep else str(d)


def pct(x, nd: int = 0) -> str:
    return num(Decimal(repr(x)) * 100, nd) + "%"


def mr(text: str, nd: int = 2) -> str:
    """Re-round a common.median_range string "m (lo-hi)"."""
    m = re.fullmatch(r"\s*([-\d.]+) \(([-\d.]+)-([-\d.]+)\)\s*", text or "")
    return f"{num(m[1], nd)} ({num(m[2], nd)}-{num(m[3], nd)})" if m else str(text)


def spread(values: list, nd: int = 2) -> str:
    """Per-round values: both when there are two or fewer, else min-max."""
    if len(values) <= 2:
        return ", ".join(num(v, nd) for v in sorted(values))
    return f"{num(min(values), nd)}-{num(max(values), nd)}"


def table(head: list[str], rows: list[list]) -> str:
    def line(cells: list) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"
    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(row) for row in rows])


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------------------ provenance

def machine_line(m: dict | None, full: bool = False) -> str:
    if not m:
        return "machine not recorded"
    blas = str(m.get("blas", "?")) if full else str(m.get("blas", "?")).split(" (")[0]
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('ram_gib', '?')} GiB RAM, BLAS {blas}, "
            f"mlx {m.get('mlx', '?')}, mlx-lm {m.get('mlx_lm', '?')}, Python {m.get('python', '?')}")


def preflight_note(run: Run) -> str:
    pf = run.data.get("preflight")
    if not pf:
        end = run.data.get("load_avg_end")
        return "no preflight recorded" + (
            f" (load average at the end {' / '.join(num(x) for x in end)})" if end else "")
    state = "busy (warning above)" if pf.get("busy") else "quiet"
    mem = pf.get("mem_available_mib")
    return (f"preflight: {state}, load {' / '.join(num(x) for x in pf.get('load_avg', []))} on "
            f"{pf.get('cores')} cores" + (f", {num(mem / 1024, 1)} GiB available" if mem is not None else "")
            + (f", swap used {num(pf['swap_used_mib'], 0)} MiB" if pf.get("swap_used_mib") is not None else ""))


def provenance(runs: list[Run]) -> str:
    lines = []
    for r in runs:
        cmd = f"`{r.data['command']}`" if r.data.get("command") else "command not recorded"
        lines.append(f"- `{rel(r.path)}`: {cmd}; {r.date or 'date not recorded'}; "
                     f"git {r.git_rev or 'rev not recorded'}; {machine_line(r.data.get('machine'))}; "
                     f"{preflight_note(r)}.")
    return "\n".join(lines)


def warnings(runs: list[Run]) -> str:
    out = []
    for r in runs:
        for key, when in (("preflight", "before the measurement"), ("preflight_end", "at the end")):
            row = busy_row(r.data.get(key) or {}, when=f"{when} of `{r.path.name}`")
            if row:
                out.append(row)
    return "\n\n".join(out)


def run_label(run: Run, i: int) -> str:
    when = run.date[:16] + " UTC" if run.date else None
    what = ", ".join(x for x in (f"git {run.git_rev}" if run.git_rev else None, when) if x) or \
        f"`{run.path.name}`, undated"
    busy = " (busy)" if (run.data.get("preflight") or {}).get("busy") else ""
    return f"{'latest' if i == 0 else 'previous'}: {what}{busy}"


# ------------------------------------------------------------------------------------------------------- renderers

def render_machine(runs: list[Run]) -> str:
    # the CPU suite's machine: GPU results describe another machine
    facts = [r for r in runs if isinstance(r.data.get("machine"), dict) and not r.path.name.startswith("gpu")]
    if not facts:
        return "No result in bench/results/ records machine facts."
    top, m = facts[0], facts[0].data["machine"]
    differ = [r.path.name for r in facts[1:] if r.data["machine"] != m]
    return (f"**Machine facts** of the newest result (`{rel(top.path)}`, {top.date or 'undated'}; "
            f"`bench/common.py machine_facts`): {machine_line(m, full=True)}. "
            + (f"Different on: {', '.join(differ)}." if differ else
               f"The same in all {len(facts)} results that record machine facts."))


def render_decode_overhead(runs: list[Run]) -> str:
    d = [r.data for r in runs]

    def ratio(x, i):
        v = num(x["ratio_median"], 3)
        return f"{f'**{v}**' if i == 0 else v} (per round {', '.join(num(y) for y in x['ratio_per_round'])})"
    tokens = [f" ({x['tokens']} tokens)" if x.get("tokens") else "" for x in d]
    return table([""] + [run_label(r, i) + tokens[i] for i, r in enumerate(runs)], [
        ["served decode (tok/s)"] + [mr(x["served_tok_s"]) for x in d],
        ["raw mlx_lm decode (tok/s)"] + [mr(x["raw_tok_s"]) for x in d],
        ["**served / raw** (target >= 0.98)"] + [ratio(x, i) for i, x in enumerate(d)],
    ])


def render_dashboard_overhead(runs: list[Run]) -> str:
    """Served decode with the dashboard open vs closed (bench/dashboard_overhead.py), newest run first."""
    d = [r.data for r in runs]

    def ratio(x, i):
        v = num(x["ratio_median"], 3)
        return f"{f'**{v}**' if i == 0 else v} (per round {', '.join(num(y) for y in x['ratio_per_round'])})"
    head = [""] + [f"{run_label(r, i)} ({x['tokens']} tokens, {x['rounds']} rounds, page polls every "
                   f"{num(x['interval_s'], 2)} s)" for i, (r, x) in enumerate(zip(runs, d))]
    return table(head, [
        ["served decode, page closed (tok/s)"] + [mr(x["closed_tok_s"]) for x in d],
        ["served decode, page open (tok/s)"] + [mr(x["open_tok_s"]) for x in d],
        ["**open / closed**"] + [ratio(x, i) for i, x in enumerate(d)],
        ["/stats polls per open run"] + [spread(x["polls_per_open_run"], 0) for x in d],
        ["idle lane, server CPU (ms per s), page closed / open"] + [_idle(x, "server", ("closed", "open")) for x in d],
        ["idle lane, browser CPU (ms per s), page closed / open"] + [_idle(x, "browser", ("closed", "open"))
                                                                     for x in d],
    ])


def _idle(x: dict, who: str, kinds: tuple[str, ...]) -> str:
    """Median CPU ms per second of `who` over the idle windows of each kind, "closed / open"; "-" if not measured."""
    idle = x.get("idle_cpu") or {}
    if not all(idle.get(k) for k in kinds):
        return "not measured"
    return " / ".join(num(1000 * statistics.median(w[f"{who}_cpu_s_per_s"] for w in idle[k]), 1) for k in kinds)


def render_warm_hit(runs: list[Run]) -> str:
    d = [r.data for r in runs]
    key = [mr(x["ttft_over_raw_step"]) for x in d]
    return table([""] + [run_label(r, i) for i, r in enumerate(runs)], [
        ["warm-hit TTFT, 1 new token (ms)"] + [mr(x["hit_ttft_ms"], 0) for x in d],
        [f"one raw decode step at {num(d[0]['context_tokens'], 0, sep=True)} context (ms)"]
        + [mr(x["raw_decode_step_ms"], 0) for x in d],
        ["served inter-token time (ms)"] + [mr(x["served_inter_token_ms"], 0) for x in d],
        ["**TTFT / raw decode step** (target <= 1.3)"] + [f"**{key[0]}**"] + key[1:],
        ["TTFT / served inter-token time"] + [mr(x["ttft_over_served_inter_token"]) for x in d],
        ["TTFT measured to"] + [x.get("hit_ttft_method", "the first non-empty text chunk") for x in d],
        ["first non-empty text chunk / raw decode step"] + [mr(x["first_text_over_raw_step"])
                                                             if x.get("first_text_over_raw_step") else "-" for x in d],
    ])


def render_ssd_restart(runs: list[Run]) -> str:
    d, rounds = runs[0].data, runs[0].data.get("rounds") or []
    wb = d["write_behind"]
    cached = ", ".join(sorted({f"{num(r['cached_tokens'], 0, True)} of {num(r['prompt_tokens'], 0, True)}"
                               for r in rounds}))
    restored = [r for r in rounds if r.get("restore_mb_s") and r.get("restore_ms_last")]
    mb = statistics.mean(r["restore_mb_s"] * r["restore_ms_last"] / 1000 for r in restored) if restored else None
    ms = [r["restore_ms_last"] for r in restored]
    ms_range = f"{num(min(ms), 0)}-{num(max(ms), 0)}" if ms else "?"
    dd = [r for r in rounds if r.get("dd_mb_s")]
    dropped = "" if all(r.get("page_cache_dropped") for r in rounds) else " (page cache NOT dropped on every round)"
    return table(["", "median (min-max)"], [
        ["next-turn TTFT after a restart (s)", mr(d["restart_ttft_s"]) + (f"; cached_tokens {cached}" if cached
                                                                           else "")],
        ["same next turn on a cold server (s)", mr(d["cold_ttft_s"])],
        ["**restart / cold** (target <= 1.5%)", f"**{pct(d['restart_over_cold_median'], 1)}** (per round "
         f"{', '.join(pct(x, 1) for x in d['restart_over_cold_per_round'])})"],
        [f"restore: {num(mb, 0) if mb else '?'} MB in {ms_range} ms, MB/s (server's /stats)",
         " / ".join(num(r["restore_mb_s"], 0, True) for r in restored) or "-"],
        ["disk sequential read of the same file with `dd` after dropping the page cache, MB/s" + dropped,
         " / ".join(num(r["dd_mb_s"], 0, True) for r in dd) or "-"],
        ["**restore / dd** (target >= 0.5)", f"**{' / '.join(num(x) for x in d['restore_over_dd'])}**"
         if d.get("restore_over_dd") else "-"],
        ["decode tok/s, SSD tier on vs off", f"{mr(wb['on_tok_s'])} vs {mr(wb['off_tok_s'])}"],
        ["**write-behind overhead: on / off** (target >= 0.98)",
         f"**{num(wb['ratio_median'], 3)}** (per round {spread(wb['ratio_per_round'])})"],
    ])


SPEC_TARGETS = {"ngram": 2.0, "two-model": 1.5}
SPEC_PROMPTS = {"repeat": '"repeat this file with one change"', "code": "coding prompt"}


def render_speculative(runs: list[Run]) -> str:
    rows = []
    for x in (r.data for r in runs):
        model = x["target"] + (f" + {Path(x['draft']).name} draft" if x.get("draft") else "")
        label = (f"{'n-gram' if x['kind'] == 'ngram' else x['kind']}, {model}, k<={x['k']}"
                 + (", fixed k" if x.get("policy") == "fixed" else "")
                 + f", {SPEC_PROMPTS.get(x['prompt'], x['prompt'])}, {x['generated_tokens']} tokens, "
                 f"{len(x['speedup_per_round'])} rounds")
        target = SPEC_TARGETS.get(x["kind"])
        verdict = f" (>= {target:g}x: {'met' if x['speedup_median'] >= target else 'missed'})" if target else ""
        rows.append([label, mr(x["plain_tok_s"]), mr(x["spec_tok_s"]),
                     f"**{num(x['speedup_median'])}x** ({spread(x['speedup_per_round'])}){verdict}",
                     pct(x["acceptance_rate"]), pct(x["from_draft_share"]),
                     "identical" if x.get("text_identical") else "DIFFERENT"])
    return table(["", "plain tok/s", "speculative tok/s", "**speed-up** (target)", "acceptance",
                  "tokens from drafts", "text"], rows)


def render_quant(runs: list[Run]) -> str:
    parts = []
    for r in runs:
        x = r.data
        what = f"Model `{x.get('model')}`" + (f" (hidden {x['hidden_size']})" if x.get("hidden_size") else "")
        if x.get("group_size"):
            what += f", group size {x['group_size']}, rotation {x.get('rotation')}"
        chk = x.get("rotation_float_check")
        if chk:
            what += (f"; the rotation alone on the float model: max |logit diff| {chk['max_abs_diff']:.1e} "
                     f"(max |logit| {num(chk['max_abs_logit'], 1)}), "
                     f"same argmax: {'yes' if chk['same_argmax'] else 'NO'}")
        if x.get("seconds"):
            what += f"; {num(x['seconds'], 0, True)} s"
        parts.append(f"{what} (`{r.path.name}`):\n\n" + table(
            ["config", "bpw", "size MB", "KL (nats)", "top-1", "ppl", "ppl float", "tokens"],
            [[q["config"], "-" if q.get("bits_per_weight") is None else q["bits_per_weight"],
              "-" if q.get("size_mb") is None else q["size_mb"], num(q["kl"], 4), num(q["top1"], 3),
              num(q["ppl"], 3), num(q["ppl_float"], 3), q["tokens"]] for q in x["rows"]]))
    return "\n\n".join(parts)


def render_soak(runs: list[Run]) -> str:
    d = runs[0].data
    curve, final = d["curve"], d["final"]
    at = {c["request"]: c["rss_mib"] for c in curve}
    points = [p for p in dict.fromkeys((curve[0]["request"], 50, d["requests"] // 2, d["requests"])) if p in at]
    return ("Written by `make soak` (tests/integration/test_cache_soak.py).\n\n" + table(["", "value"], [
        [f"RAM tier bytes, max over the {len(curve)} sampled checks (every {curve[0]['request']}th request)",
         f"{num(max(c['cache_bytes'] for c in curve), 0, True)} of {num(d['cap'], 0, True)} (the test asserts "
         f"bytes <= cap after every request before it writes this file)"],
        ["evictions / request hit rate / token hit rate",
         f"{final['evictions']} / {num(final['request_hit_rate'], 3)} / {num(final['token_hit_rate'], 3)}"],
        [f"RSS after {' / '.join(num(p, 0, True) for p in points)} requests (MiB)",
         " / ".join(num(at[p], 0, True) for p in points)],
    ]))


def render_generic(runs: list[Run]) -> str:
    """The newest run's scalar fields (one level of nesting flattened), for a NAME without its own renderer."""
    skip = {"command", "date", "git_rev", "git", "machine", "preflight", "preflight_end", "records"}
    rows = []

    def add(key: str, v) -> None:
        if isinstance(v, list) and (len(v) > 10 or any(isinstance(e, (dict, list)) for e in v)):
            return
        rows.append([key, json.dumps(v) if isinstance(v, (list, bool)) or v is None else str(v).replace("|", "\\|")])

    for k, v in runs[0].data.items():
        if k in skip:
            continue
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if not isinstance(v2, dict):
                    add(f"{k}.{k2}", v2)
        else:
            add(k, v)
    return table(["key", "value"], rows)


AR_LABELS = {"ours": "mlx-lane", "mlx_lm": "mlx_lm.server", "llama_cpp": "llama.cpp server"}


def _ar_ratios(res: dict) -> dict:
    """Ratios per peer; older two-server results kept them flat (ours vs mlx_lm)."""
    r = res.get("ratios") or {}
    if "per_request_ratio_median" in r:
        return {"mlx_lm": {"per_request_ratio_median": r["per_request_ratio_median"],
                           "per_request_ratio_min": r["per_request_ratio_min"],
                           "per_request_ratio_max": r["per_request_ratio_max"],
                           "per_request_ratio_later_turns_median": r.get("per_request_ratio_later_turns_median")}}
    return r


def agent_replay(res: dict) -> str:
    s = res["summary"]
    names = [n for n in AR_LABELS if n in s]
    peers = [n for n in names if n != "ours"]
    ratios = _ar_ratios(res)
    cfg = res.get("config") or {}
    head = ["", *(AR_LABELS[n] for n in names), *(f"ours / {n}" for n in peers if "ours" in s)]
    rows = []

    def row(title, key, fmt="{:.2f}", ratio=True):
        vals = [s[n].get(key) for n in names]
        if all(v is None for v in vals):
            return
        cells = [fmt.format(v) if v is not None else "-" for v in vals]
        if "ours" in s:
            for p in peers:
                o, v = s["ours"].get(key), s[p].get(key)
                cells.append(f"{o / v:.3f}" if ratio and o is not None and v else "")
        rows.append([title, *cells])

    row("mean TTFT (s)", "ttft_mean_s")
    row("median TTFT (s)", "ttft_median_s")
    row("p95 TTFT (s)", "ttft_p95_s")
    rows.append(["min-max TTFT (s)", *(f"{s[n]['ttft_min_s']:.2f}-{s[n]['ttft_max_s']:.2f}" for n in names),
                 *("" for p in peers if "ours" in s)])
    row("mean TTFT, turn 1 (s)", "ttft_mean_turn1_s")
    row("mean TTFT, turns 2+ (s)", "ttft_mean_later_turns_s")
    row(f"mean TTFT, turn {cfg.get('restart_after_turn', 0) + 1} right after the restart (s)",
        "ttft_mean_after_restart_s")
    row("p95 TTFT right after the restart (s)", "ttft_p95_after_restart_s")
    row("sum of request times (s)", "total_request_time_s", "{:.1f}")
    row("prompt tokens", "prompt_tokens", "{:d}", ratio=False)
    row("reusable tokens", "reusable_tokens", "{:d}", ratio=False)
    row("cached tokens (server's usage; llama.cpp reports none)", "cached_tokens", "{:d}", ratio=False)
    row("cache efficiency = cached / reusable", "cache_efficiency", "{:.3f}", ratio=False)
    row("mean TTFT / ideal mean TTFT", "mean_ttft_over_ideal", "{:.2f}", ratio=False)
    if res.get("peak_rss_mib"):
        rss = res["peak_rss_mib"]
        rows.append(["peak RSS (MiB, VmHWM)", *(f"{rss[n]:.0f}" if rss.get(n) else "-" for n in names),
                     *(f"{rss['ours'] / rss[p]:.3f}" if rss.get("ours") and rss.get(p) else "" for p in peers
                       if "ours" in s)])
    if res.get("restart_ready_s"):
        rows.append(["restart: seconds until ready again", *(f"{res['restart_ready_s'].get(n, 0):.1f}" for n in names),
                     *("" for p in peers if "ours" in s)])
    text = table(head, rows)
    notes = []
    for p in peers:
        r = ratios.get(p) or {}
        if r:
            note = (f"per-request TTFT ratio ours/{p} (same step, back to back): median "
                    f"{r['per_request_ratio_median']:.3f} (min-max {r['per_request_ratio_min']:.3f}-"
                    f"{r['per_request_ratio_max']:.3f})")
            if r.get("per_request_ratio_later_turns_median") is not None:
                note += f"; turns 2+ only: median {r['per_request_ratio_later_turns_median']:.3f}"
            notes.append(note)
    if notes:
        joined = "; ".join(notes)
        text += "\n\n" + joined[0].upper() + joined[1:] + "."
    # per-turn table: mean TTFT per server, ours' new/reusable tokens, the ideal and the raw prefill rate
    recs = res["records"]
    turns = sorted({x["turn"] for x in recs})
    lines = [["turn", "mean new tokens (ours)", "mean reusable", *(f"mean TTFT {AR_LABELS[n]} (s)" for n in names),
              "mean ideal (s)", "raw prefill tok/s", *(f"cached/reusable {AR_LABELS[n]}" for n in names
                                                       if n != "llama_cpp")]]
    for t in turns:
        def sel(n):
            return [x for x in recs if x["turn"] == t and x["server"] == n]

        def eff(rs):
            reuse = sum(x["reusable_tokens"] for x in rs)
            return f"{sum(x['cached_tokens'] or 0 for x in rs) / reuse:.3f}" if reuse else "-"
        base = sel(names[0])
        ideal = [x["ideal_s"] for x in base if x.get("ideal_s") is not None]
        rates = res["raw_prefill_tok_s_by_turn"].get(str(t)) or res["raw_prefill_tok_s_by_turn"].get(t) or []
        mark = " (after restart)" if any(x.get("after_restart") for x in base) else ""
        lines.append([f"{t}{mark}", f"{statistics.mean(x['new_tokens'] for x in base):.0f}",
                      f"{statistics.mean(x['reusable_tokens'] for x in base):.0f}",
                      *(f"{statistics.mean(x['ttft_s'] for x in sel(n)):.2f}" if sel(n) else "-" for n in names),
                      f"{statistics.mean(ideal):.2f}" if ideal else "-", ", ".join(f"{x:.0f}" for x in rates),
                      *(eff(sel(n)) for n in names if n != "llama_cpp")])
    text += "\n\n" + table(lines[0], lines[1:])
    for f in res.get("failures") or []:
        text += (f"\n\n**Failure**: {AR_LABELS.get(f['server'], f['server'])}, turn {f['turn']} conversation "
                 f"{f['conv']}: `{f['error'][:160]}`; process "
                 + ("still alive" if f["process_alive"] else f"dead (exit status {f['exit_code']}), restarted")
                 + "; the request was retried once.")
    pc = res.get("ours_stats_prompt_cache") or {}
    if pc:
        text += ("\n\nmlx-lane `/stats` `prompt_cache` after the replay: "
                 f"queries {pc.get('queries')}, hits {pc.get('hits')} (request hit rate "
                 f"{pc.get('request_hit_rate', 0):.3f}), tokens queried {pc.get('tokens_queried')}, tokens hit "
                 f"{pc.get('tokens_hit')} (token hit rate {pc.get('token_hit_rate', 0):.3f}), entries "
                 f"{pc.get('entries')}, bytes {pc.get('bytes')} of max {pc.get('max_bytes')}, evictions "
                 f"{pc.get('evictions')}, superseded {pc.get('superseded')}.")
    return text


def render_single_request(runs: list[Run]) -> str:
    d = runs[0].data
    s, ratios = d["summary"], d.get("ratios") or {}
    names = [n for n in AR_LABELS if n in s]
    peers = [n for n in names if n != "ours"]

    def mmm(x, nd=1):
        return f"{x['median']:.{nd}f} ({x['min']:.{nd}f}-{x['max']:.{nd}f})" if x else "-"
    rows = [["cold prefill tok/s, ~" + str(d["config"]["prompt_tokens"]) + "-token prompt",
             *(mmm(s[n]["prefill_tok_s"]) for n in names),
             *(num(ratios.get(p, {}).get("prefill_ours_over_peer"), 3) for p in peers)],
            [f"decode tok/s, {d['config']['decode_tokens']} tokens", *(mmm(s[n]["decode_tok_s"], 2) for n in names),
             *(num(ratios.get(p, {}).get("decode_ours_over_peer"), 3) for p in peers)],
            ["peak RSS (MiB, VmHWM)", *(num(s[n].get("peak_rss_mib"), 0) for n in names),
             *(num(ratios.get(p, {}).get("peak_rss_ours_over_peer"), 3) for p in peers)]]
    return (f"Median (min-max) of {d['config']['rounds']} rounds, every server in every round, order rotated:\n\n"
            + table(["", *(AR_LABELS[n] for n in names), *(f"ours / {p}" for p in peers)], rows))


def render_quant_speed(runs: list[Run]) -> str:
    d = runs[0].data
    s = d["summary"]
    rows = [[n, v["size_mb"], f"{v['prefill_tok_s']['median']:.1f} ({v['prefill_tok_s']['min']:.1f}-"
             f"{v['prefill_tok_s']['max']:.1f})", f"{v['prefill_vs_float32']:.2f}x",
             f"{v['decode_tok_s']['median']:.2f} ({v['decode_tok_s']['min']:.2f}-{v['decode_tok_s']['max']:.2f})",
             f"{v['decode_vs_float32']:.2f}x"] for n, v in s.items()]
    c = d["config"]
    return (f"Model `{d['model']}`, raw mlx-lm on this CPU, {c['prompt_tokens']}-token prefill + {c['tokens']} "
            f"decode tokens, median (min-max) of {c['rounds']} rounds, configurations alternated:\n\n"
            + table(["weights", "size MB", "prefill tok/s", "vs float32", "decode tok/s", "vs float32"], rows))


def _mmm(x: dict | None, nd: int = 2) -> str:
    """A common.spread / gpu.summary dict as "median (min-max)", or the median alone for one value."""
    if not x or x.get("median") is None:
        return "-"
    if x.get("min") == x.get("max"):
        return num(x["median"], nd)
    return f"{num(x['median'], nd)} ({num(x['min'], nd)}-{num(x['max'], nd)})"


def render_concurrent_agents(runs: list[Run]) -> str:
    d = runs[0].data
    s, ratios, c, v = d["summary"], d.get("ratios") or {}, d["config"], d.get("target") or {}
    rows = []
    for K, per in s.items():
        for n, x in per.items():
            r = (ratios.get(K) or {}).get(n) or {}
            rows.append([K, AR_LABELS.get(n, n), _mmm(x.get("wall_s"), 1), _mmm(x.get("ttft_mean_s")),
                         _mmm(x.get("ttft_p95_s")), _mmm(x.get("tok_s")),
                         num(statistics.median(x["cached_tokens"]), 0, True), x["requests_failed"],
                         num(r["wall_ours_over_peer"], 3) if r.get("wall_ours_over_peer") else "",
                         num(r["ttft_mean_ours_over_peer"], 3) if r.get("ttft_mean_ours_over_peer") else "",
                         num(x["replies_equal_ours"], 2) if x.get("replies_equal_ours") is not None else ""])
    text = (f"K agents x {c['turns']} turns, all at once, each turn right after its previous reply; "
            f"{c['max_tokens']}-token greedy replies; median (min-max) of {c['rounds']} round(s); servers one after "
            "the other, started fresh for each K, order rotated:\n\n" + table(
                ["K", "server", "wall (s)", "mean TTFT (s)", "p95 TTFT (s)", "generated tok/s (all / wall)",
                 "cached prompt tokens", "failed", "wall ours/peer", "mean TTFT ours/peer", "replies = ours"], rows))
    if v.get("met") is not None:
        cond = "" if v.get("conditions_as_issue") else " (this run's T / tokens differ from the issue's 3 / 64)"
        text += (f"\n\n**Issue 12 target at K={v['k']}{cond}**: wall ours/mlx_lm.server {num(v['wall_ratio'], 3)} "
                 f"(<= {v['wall_target']}), mean TTFT {num(v['ttft_mean_ratio'], 3)} (<= {v['ttft_mean_target']}): "
                 f"**{'met' if v['met'] else 'missed'}**.")
    if "llama_cpp" in c.get("servers", {}):
        text += f"\n\nllama.cpp's server: {c.get('llama_cpp_parallel')}."
    last = max((r for r in d.get("runs") or [] if r["server"] == "ours" and r.get("lane_after")),
               key=lambda r: (r["k"], r["round"]), default=None)
    if last:
        flat = [f"{k} {json.dumps(x)}" for k, x in last["lane_after"].items()
                if isinstance(x, (int, float, str)) and not isinstance(x, bool)]
        text += (f"\n\nmlx-lane `/stats` `lane` after the K={last['k']} run (round {last['round']}): "
                 + ", ".join(flat) + ".")
    return text


def render_batch_text_match(runs: list[Run]) -> str:
    d = runs[0].data
    c = d["config"]
    rows = []
    for name, x in d["servers"].items():
        if "error" in x:
            rows.append([AR_LABELS.get(name, name), f"error: {x['error'][:120]}", "", "", "", ""])
            continue
        mm = x.get("mismatches") or []
        rep = x.get("alone_repeat")
        rows.append([AR_LABELS.get(name, name), f"**{x['matched']} / {x['compared']}** ({pct(x['match_rate'])})",
                     ", ".join(str(m["first_diff_token"]) for m in mm) or "-",
                     f"{num(x['alone_wall_s'], 1)} / {num(x['batch_wall_s'], 1)}",
                     "yes" if x.get("cache_cleared") else "no",
                     f"{rep['matched']} / {rep['compared']}" if rep else "not run"])
    return (f"{c['n']} chat prompts ({num(c['prompt_tokens_mean'], 0)} tokens on average, "
            f"{c['prompt_tokens_range'][0]}-{c['prompt_tokens_range'][1]}), {c['max_tokens']} greedy tokens each, "
            "first one at a time, then all at once:\n\n" + table(
                ["server", "batch text = alone text", "first differing token of each mismatch",
                 "seconds alone / all at once", "RAM cache cleared before each", "alone = alone again"], rows))


def render_gpu_batch(runs: list[Run]) -> str:
    d = runs[0].data
    a, lv, ratios = d.get("args") or {}, d.get("levels") or {}, d.get("ratios") or {}
    names = [n for n in ("raw", "mlx_lm", "ours") if any(n in per for per in lv.values())]
    label = {"raw": "raw BatchGenerator", "mlx_lm": "mlx_lm.server", "ours": "mlx-lane"}
    rows = []
    for n, per in sorted(lv.items(), key=lambda kv: int(kv[0])):
        r = ratios.get(n) or {}
        rows.append([n, *(_mmm((per.get(s) or {}).get("tok_s"), 0) for s in names),
                     *(_mmm((per.get(s) or {}).get("ttft_mean_s"), 2) for s in names),
                     num(r["mlx_lm"]["tok_s_ours_over_peer"], 2) if "mlx_lm" in r else "",
                     num(r["raw"]["tok_s_ours_over_peer"], 2) if "raw" in r else "",
                     num(r["mlx_lm"]["ttft_mean_ours_over_peer"], 2) if "mlx_lm" in r else ""])
    text = (f"{(d.get('facts') or {}).get('nvidia_smi', 'device not recorded')}; random-weight "
            f"{a.get('shape', '?')} {a.get('dtype', '?')}; N distinct {a.get('prompt_tokens')}-token prompts at once, "
            f"{a.get('max_tokens')} greedy tokens each (EOS suppressed); median (min-max) of the rounds run "
            f"({a.get('rounds')} asked):\n\n" + table(
                ["N", *(f"{label[s]} tok/s" for s in names), *(f"{label[s]} mean TTFT (s)" for s in names),
                 "tok/s ours / mlx_lm", "tok/s ours / raw", "TTFT ours / mlx_lm"], rows))
    ss = d.get("single_stream") or {}
    if ss:
        dec = ss.get("decode_tok_s") or {}
        single = {**label, "raw": "raw mlx-lm generate_step"}
        text += ("\n\nSingle stream decode tok/s: " + ", ".join(f"{single[s]} {_mmm(dec.get(s), 1)}" for s in names
                                                             if s in dec)
                 + (f"; **served / raw generate_step: mlx-lane {num(ss['ours_over_raw'], 3)}**"
                    if ss.get("ours_over_raw") else "")
                 + (f", mlx_lm.server {num(ss['mlx_lm_over_raw'], 3)}" if ss.get("mlx_lm_over_raw") else "")
                 + (f" (mlx-lane's own `/stats` lane decode rate: {_mmm(ss['ours_lane_decode_tok_s'], 1)})"
                    if (ss.get("ours_lane_decode_tok_s") or {}).get("median") else "")
                 + ".")
    for note in d.get("notes") or []:
        text += f"\n\nNote: {note}."
    return text


def render_grammar_cost(runs: list[Run]) -> str:
    d = runs[0].data
    s, c = d["summary"], d["config"]
    pairs = zip(s["plain"]["decode_tok_s"]["values"], s["schema"]["decode_tok_s"]["values"])

    def mmm(x, nd=2):
        return f"{num(x['median'], nd)} ({num(x['min'], nd)}-{num(x['max'], nd)})"
    rows = [[k, mmm(s[k]["decode_tok_s"]), mmm(s[k]["ttft_s"], 3)] for k in ("plain", "schema")]
    note = f" {d['note']}." if d.get("note") else ""
    return (f"Model `{d['model']}`, one live server, {c['tokens']} decode tokens (EOS banned), median (min-max) of "
            f"{c['rounds']} rounds, both kinds in every round, order rotated.{note} Schema / plain decode: "
            f"**{d['schema_over_plain_decode']:.3f}** (per round: "
            + ", ".join(f"{b / a:.2f}" for a, b in pairs) + "):\n\n"
            + table(["request", "decode tok/s", "TTFT s (grammar compiled in it)"], rows))


def render_embeddings(runs: list[Run]) -> str:
    d = runs[0].data
    c = d["config"]

    def mmm(x, nd=1):
        return f"{num(x['median'], nd)} ({num(x['min'], nd)}-{num(x['max'], nd)})"
    return (f"`{c['model']}`, {c['n']} sentences of 8-40 words in batches of {c['batch']}, tokenizing included, "
            f"median (min-max) of {c['rounds']} rounds, both sides in every round, order rotated; max |difference| "
            f"between the two sides' vectors {d['max_abs_diff']:.1e}. Peer: transformers + torch {c['torch']} on the "
            f"CPU ({c['torch_threads']} threads), the computation sentence-transformers runs. Ours / peer: "
            f"**{num(d['ratio']['median'])}** (per round: {', '.join(num(x) for x in d['ratio']['values'])}):\n\n"
            + table(["", "embeddings/s"], [["mlx-lane (MLX, in process)", mmm(d["ours_per_s"])],
                                           ["transformers + torch (CPU)", mmm(d["peer_per_s"])]]))


def render_adapters_cost(runs: list[Run]) -> str:
    d = runs[0].data
    c = d["config"]

    def mmm(x, nd=2):
        return f"{num(x['median'], nd)} ({num(x['min'], nd)}-{num(x['max'], nd)})"
    t = d["tok_s"]
    return (f"`{c['model']}`, two random rank-{c['rank']} adapters over the last {c['lora_layers']} layers, "
            f"{c['steps']} decode ticks of two rows after a short prefill, median (min-max) of {c['rounds']} rounds, "
            f"order rotated. Tick time of two adapters (two groups, one row each) over one adapter (one batch of two "
            f"rows): **{num(d['tick_time_two_over_one']['median'])}x** (per round: "
            f"{', '.join(num(x) for x in d['tick_time_two_over_one']['values'])}):\n\n"
            + table(["two rows decoding as", "aggregate tok/s"], [
                ["base model, one batch", mmm(t["base_2rows"])],
                ["one adapter, one batch", mmm(t["one_adapter"])],
                ["two adapters, two groups stepped each tick", mmm(t["two_adapters"])]]))


def render_cluster_affinity(runs: list[Run]) -> str:
    """bench/cluster_affinity.py: session hashing vs round-robin, the kill -9 run, the restore-vs-cold replay."""
    d = runs[0].data
    c = d["config"]
    text = (f"{c['replicas']} replicas of `{c['serve_args']}` behind {c['proxy']}, one fresh shared SSD folder per "
            f"run; {c['k']} agents x {c['turns']} turns at once (concurrent_agents.py's workload, each agent with its "
            f"X-Session-Id), {c['max_tokens']}-token greedy replies.")
    aff = d.get("affinity") or []
    if aff:
        rows = []
        for r in aff:
            m = r["metrics"]
            restores = sum((x or {}).get("ssd_hits") or 0 for x in (r.get("ssd") or {}).values())
            rows.append([r["round"], r["balance"], pct(m["hit_rate"], 1),
                         f"{num(m['cached_tokens'], 0, True)} / {num(m['prompt_tokens'], 0, True)}",
                         num(m["ttft_mean_s"], 2), num(m["ttft_mean_turn2plus_s"], 2), num(m["wall_s"], 1),
                         m["replica_switches"], restores, m["requests_failed"]])
        text += "\n\n" + table(["round", "balance", "cache hit rate", "cached / prompt tokens", "mean TTFT (s)",
                                "mean TTFT turns >= 2 (s)", "wall (s)", "replica switches", "SSD restores",
                                "failed"], rows)
        summ = d.get("affinity_summary") or {}
        ratios = summ.get("ratio_over_roundrobin") or (
            {"session": summ["ratio_session_over_roundrobin"]} if "ratio_session_over_roundrobin" in summ else {})
        for b, ratio in ratios.items():
            text += (f"\n\n{b} / round-robin (medians over rounds): mean TTFT **{num(ratio.get('ttft_mean_s'), 3)}**, "
                     f"turns >= 2 {num(ratio.get('ttft_mean_turn2plus_s'), 3)}, wall {num(ratio.get('wall_s'), 3)}.")
        if ratios:
            text += ("\n\nRound-robin's SSD restores are the shared folder at work: a turn landing on the other "
                     "replica restores what the first one wrote (after its 1 s write-behind debounce).")
    fo = d.get("failover")
    if fo:
        m, k = fo["metrics"], fo.get("kill") or {}
        if not k.get("victim"):  # the first run's killer waited for r1, which had finished its only conversation
            text += ("\n\n**Failover: not measured in this run**: the kill -9 landed after the last turn (no request "
                     "in flight), so nothing moved.")
            return text
        kill = (f"kill -9 of {k['victim']} after {k.get('at_done')} of {k.get('of_turns')} turns had finished, "
                f"with {k.get('in_flight_on_victim')} request(s) in flight on it")
        by_error: dict[str, list[str]] = {}
        for x in fo["failed"]:
            by_error.setdefault(x["error"], []).append(f"agent {x['agent']} turn {x['turn']}")
        failed = "; ".join(f"{len(v)} ({', '.join(v)}): `{e}`" for e, v in by_error.items()) or "none"
        text += (f"\n\n**Failover** ({kill}): every agent finished all its turns: "
                 f"**{'yes' if fo['every_agent_finished'] else 'NO'}** ({m['turns_done']} / {m['turns_total']} turns); "
                 f"requests cut by the kill, each retried by its agent and answered by the survivor: {failed}.")
        if fo.get("moved"):
            rows = [[x["agent"], x["turn"], num(x["prompt_tokens"], 0, True), num(x["cached_tokens"], 0, True),
                     num(x["prev_prompt_tokens"], 0, True), "yes" if x["restored"] else "no", num(x["ttft_s"], 2)]
                    for x in fo["moved"]]
            text += ("\n\nConversations that moved off the killed replica, their first turn on the survivor (in the "
                     "run, under load):\n\n"
                     + table(["agent", "turn", "prompt tokens", "cached tokens", "last prompt on the victim",
                              "restored from the shared folder", "TTFT (s)"], rows))
        if fo.get("replay"):
            rows = [[x["agent"], x["turn"], num(x["prompt_tokens"], 0, True), num(x["cold_s"], 2),
                     num(x["cold_cached"], 0), num(x["restore_s"], 2), num(x["restore_cached"], 0, True),
                     num(x["restore_over_cold"], 3)] for x in fo["replay"]]
            text += ("\n\nThe same prompts replayed one at a time after the run (1 token): a fresh replica on the "
                     "failover's folder (restores from SSD) vs a fresh replica without an SSD tier (cold prefill, "
                     "RAM cleared before each):\n\n"
                     + table(["agent", "turn", "prompt tokens", "cold TTFT (s)", "cold cached", "restore TTFT (s)",
                              "restore cached", "restore / cold"], rows))
    return text


RENDERERS: dict[str, Renderer | Callable[[list[Run]], str]] = {
    "embeddings": render_embeddings,
    "adapters_cost": render_adapters_cost,
    "cluster_affinity": Renderer(lambda runs: "\n\n".join(  # every run, newest first: policies and K differ
        f"**{r.path.name}**: " + render_cluster_affinity([r]) for r in runs), pick=every),
    "machine": Renderer(render_machine, pattern="*.json", pick=every, provenance=False),
    "decode_overhead": Renderer(render_decode_overhead, pick=newest(2)),
    "warm_hit": Renderer(render_warm_hit, pick=newest(2)),
    "dashboard_overhead": Renderer(render_dashboard_overhead, pick=newest(2)),
    "ssd_restart": render_ssd_restart,
    "speculative": Renderer(render_speculative, pick=lambda runs: sorted(  # n-gram row first
        newest_per("kind")(runs), key=lambda r: r.data.get("kind") != "ngram")),
    "quant": Renderer(render_quant, pick=lambda runs: sorted(  # quant.json, quant_qwen05.json, quant_tiny.json
        newest_per("model")([r for r in runs if "rows" in r.data]), key=lambda r: r.path.name)),
    "soak": render_soak,
    "agent_replay": Renderer(lambda runs: agent_replay(runs[0].data), pattern="agent_replay.json"),
    "agent_replay_restart": Renderer(lambda runs: agent_replay(runs[0].data), pattern="agent_replay_restart*.json"),
    "single_request": render_single_request,
    "quant_speed": render_quant_speed,
    "concurrent_agents": Renderer(lambda runs: "\n\n".join(  # every run, newest first: the lane changed between
        f"**{r.path.name}**: " + render_concurrent_agents([r]) for r in runs), pick=every),
    "batch_text_match": render_batch_text_match,
    "gpu_batch": render_gpu_batch,
    "grammar_cost": render_grammar_cost,
}


def renderer(name: str) -> Renderer:
    r = RENDERERS.get(name, render_generic)
    return r if isinstance(r, Renderer) else Renderer(r)


# ---------------------------------------------------------------------------------------------- BENCHMARKS.md

OPEN = re.compile(r"<!-- bench:([\w.-]+) -->")
SECTION = re.compile(r"<!-- bench:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /bench:(?P=name) -->", re.S)


def section(name: str, results: Path = RESULTS) -> str | None:
    """The generated content of section NAME, or None when no result matches."""
    spec = renderer(name)
    pattern = spec.pattern or f"{name}*.json"
    runs = load_runs(pattern, results)
    if not runs:
        return None
    shown = spec.pick(runs)
    parts = [f"<!-- generated by `python bench/report.py --write BENCHMARKS.md` from {rel(results)}/{pattern}; "
             "edits between the markers are overwritten -->"]
    parts += [warnings(shown), spec.render(shown), provenance(shown)] if spec.provenance else [spec.render(shown)]
    return "\n\n".join(p for p in parts if p)


def rewrite(text: str, results: Path = RESULTS) -> tuple[str, list[str], list[str]]:
    """(new text, sections regenerated, notes on sections left alone). Raises ValueError on broken markers."""
    opened = OPEN.findall(text)
    found = [m["name"] for m in SECTION.finditer(text)]
    if opened != found or any(OPEN.search(m["body"]) for m in SECTION.finditer(text)):
        raise ValueError(f"unbalanced or nested markers: opened {opened}, closed in order {found}")
    done, notes = [], []

    def sub(m: re.Match) -> str:
        name = m["name"]
        content = section(name, results)
        if content is None:
            notes.append(f"bench:{name}: no {rel(results)}/{renderer(name).pattern or name + '*.json'}; "
                         "section left as it was")
            return m[0]
        done.append(name)
        return f"<!-- bench:{name} -->\n{content}\n\n<!-- /bench:{name} -->"

    return SECTION.sub(sub, text), done, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="print the table of one result file: NAME FILE")
    ap.add_argument("file", nargs="?")
    ap.add_argument("--write", metavar="MD", help="regenerate the marked sections of this markdown file in place")
    ap.add_argument("--results", default=str(RESULTS), help="results folder (default bench/results)")
    args = ap.parse_args()
    if args.write:
        path = Path(args.write)
        old = path.read_text()
        try:
            new, done, notes = rewrite(old, Path(args.results))
        except ValueError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 1
        for note in notes:
            print(note, file=sys.stderr)
        if new != old:
            path.write_text(new)
        print(f"{path}: regenerated {', '.join(done) or 'nothing'}" + ("" if new != old else " (no change)"),
              file=sys.stderr)
        return 0
    if not (args.name and args.file):
        ap.error("give NAME FILE, or --write MD")
    print(renderer(args.name).render([Run(Path(args.file), json.loads(Path(args.file).read_text()))]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
