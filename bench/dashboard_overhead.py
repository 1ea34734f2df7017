"""Served decode tok/s with the dashboard page open in a browser vs closed (issue 14: the page must be light).

One `mlx-lane serve --cache-bytes 0` (every request decodes in full); one headless Chromium (Debian's `chromium`
through Playwright, as the browser tests) on the same machine, as a user watching their local server would have it.
Each round measures the same greedy stream of --tokens tokens (EOS suppressed) twice, alternated (order flipped
every round): "open" with a fresh browser context showing http://127.0.0.1:PORT/ and polling /stats every
--interval seconds (the page's default is 1 s), "closed" with no page at all (the context is closed; the idle
browser process stays). The page's poll count during each open measurement is recorded, to show it was live.

Decode speed on a shared 2-core machine is noisy, so the page's cost is also measured as CPU time, which other
processes do not disturb: with the lane idle, --idle-window seconds with the page closed, then open (--idle-pairs
pairs, alternated), the server process's CPU seconds per second and the browser's (Playwright's driver and
Chromium: this process's other descendants), from /proc/PID/stat.
JSON (with a preflight of the machine before and after) in bench/results/dashboard_overhead.json.

    python bench/dashboard_overhead.py --rounds 6 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from common import (ROOT, ServerProc, _descendants, _proc_cpu_ticks, _ps_rows, ensure_blas_here, median_range,
                    preflight, run_record, write_result)
from decode_overhead import served_rate

CHROMIUM = "/usr/bin/chromium"


def measure_open(browser, url: str, tokens: int, eos: list[int], interval: float) -> tuple[float, int]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = context.new_page()
        page.goto(f"{url}/?interval={interval:g}")
        page.wait_for_function("() => window.mlxLaneDashboard && window.mlxLaneDashboard.polls >= 2", timeout=30000)
        polls0 = page.evaluate("() => window.mlxLaneDashboard.polls")
        rate = served_rate(url, tokens, eos)
        polls = page.evaluate("() => window.mlxLaneDashboard.polls") - polls0
        return rate, polls
    finally:
        context.close()


def _cpu_s(pids: set[int]) -> float:
    ticks = _proc_cpu_ticks()
    return sum(ticks[p][0] for p in pids if p in ticks) / os.sysconf("SC_CLK_TCK")


def idle_cost(browser, url: str, server_pid: int, window_s: float, interval: float, open_page: bool) -> dict:
    """CPU seconds per second of the server and of the browser over `window_s` with the lane idle."""
    context = page = None
    if open_page:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.goto(f"{url}/?interval={interval:g}")
        page.wait_for_function("() => window.mlxLaneDashboard && window.mlxLaneDashboard.polls >= 2", timeout=30000)
    try:
        rows = _ps_rows()
        tree = _descendants(os.getpid(), {r["pid"]: r["ppid"] for r in rows})
        browser_pids = tree - {os.getpid(), server_pid} - _descendants(server_pid, {r["pid"]: r["ppid"] for r in rows})
        polls0 = page.evaluate("() => window.mlxLaneDashboard.polls") if page else 0
        s0, b0, t0 = _cpu_s({server_pid}), _cpu_s(browser_pids), time.monotonic()
        time.sleep(window_s)
        s1, b1, t1 = _cpu_s({server_pid}), _cpu_s(browser_pids), time.monotonic()
        polls = (page.evaluate("() => window.mlxLaneDashboard.polls") - polls0) if page else 0
    finally:
        if context is not None:
            context.close()
    dt = t1 - t0
    return {"server_cpu_s_per_s": round((s1 - s0) / dt, 4), "browser_cpu_s_per_s": round((b1 - b0) / dt, 4),
            "polls": polls, "window_s": round(dt, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--interval", type=float, default=1.0, help="the page's /stats polling period, seconds")
    ap.add_argument("--chromium", default=CHROMIUM)
    ap.add_argument("--idle-window", type=float, default=20.0, help="seconds per idle CPU-cost window")
    ap.add_argument("--idle-pairs", type=int, default=3, help="closed/open pairs of idle windows (0 skips them)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dashboard_overhead.json"))
    args = ap.parse_args()
    ensure_blas_here()
    from playwright.sync_api import sync_playwright

    from models import load_model

    eos = sorted(load_model("default").tokenizer.eos_token_ids)
    srv = ServerProc("--model", "default", "--cache-bytes", "0")
    # this process runs with OpenBLAS preloaded (ensure_blas_here); Playwright's node driver and Chromium must not
    # inherit it (the driver died with "pthread_create: Invalid argument" when they did)
    os.environ.pop("LD_PRELOAD", None)
    closed, opened, polls = [], [], []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True, args=["--no-sandbox"])
            served_rate(srv.url, 8, eos)  # warm-up: the server and the browser's first page
            measure_open(browser, srv.url, 8, eos, args.interval)
            pf = preflight()
            for i in range(args.rounds):
                order = ["closed", "open"] if i % 2 == 0 else ["open", "closed"]
                for kind in order:
                    if kind == "open":
                        rate, n = measure_open(browser, srv.url, args.tokens, eos, args.interval)
                        opened.append(rate)
                        polls.append(n)
                    else:
                        time.sleep(0.5)  # the same settle as after a page closes
                        closed.append(served_rate(srv.url, args.tokens, eos))
                print(f"round {i + 1}: page closed {closed[-1]:.2f} tok/s, page open {opened[-1]:.2f} tok/s "
                      f"({polls[-1]} polls of /stats during it)", flush=True)
            idle = {"closed": [], "open": []}
            for i in range(args.idle_pairs):
                for kind in (["closed", "open"] if i % 2 == 0 else ["open", "closed"]):
                    idle[kind].append(idle_cost(browser, srv.url, srv.proc.pid, args.idle_window, args.interval,
                                                kind == "open"))
                print(f"idle pair {i + 1}: " + ", ".join(
                    f"{k} server {idle[k][-1]['server_cpu_s_per_s'] * 1000:.1f} ms/s, browser "
                    f"{idle[k][-1]['browser_cpu_s_per_s'] * 1000:.1f} ms/s" for k in ("closed", "open")), flush=True)
            pf_end = preflight()
            browser.close()
    finally:
        srv.stop()
    ratio = [o / c for o, c in zip(opened, closed)]
    result = {
        **run_record(),
        "preflight": pf,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "interval_s": args.interval,
        "closed_tok_s": median_range(closed),
        "open_tok_s": median_range(opened),
        "closed_per_round": [round(x, 3) for x in closed],
        "open_per_round": [round(x, 3) for x in opened],
        "ratio_median": round(statistics.median(ratio), 3),
        "ratio_per_round": [round(x, 3) for x in ratio],
        "polls_per_open_run": polls,
        "idle_window_s": args.idle_window,
        "idle_cpu": idle,
        "preflight_end": pf_end,
    }
    write_result(result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
