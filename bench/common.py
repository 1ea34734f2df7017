"""Shared helpers of the benchmark scripts (not tests): machine facts, preflight, timing, servers, result files."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.serverproc import ServerProc, free_port  # noqa: E402,F401


def sse_chunks(client, url: str, body: dict, timeout: float = 1200):
    """POST a streaming request; yield (seconds since sent, parsed chunk) for every `data: {...}` event."""
    import json
    import time

    import httpx

    t0 = time.perf_counter()
    with client.stream("POST", url, json=body, timeout=timeout) as r:
        if r.status_code >= 400:  # keep the server's own words: a status alone does not say what went wrong
            r.read()
            raise httpx.HTTPStatusError(f"{r.status_code} from {url}: {r.text[:500]}", request=r.request, response=r)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield time.perf_counter() - t0, json.loads(line[6:])


def machine_facts() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    import mlx.core as mx
    import mlx_lm

    from models import blas_info

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_gib, 1),
        "blas": blas_info(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
    }


def spread(values: list[float]) -> dict:
    """{"median", "min", "max", "values"} of per-round measurements (the shape the report renders)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def median_seconds(fn, reps: int, warm: int = 1) -> float:
    """Median seconds of ``reps`` calls of ``fn`` (which evaluates what it computes), after ``warm`` calls."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def ensure_blas_here() -> None:
    """Re-exec this script with OpenBLAS preloaded (same rule as the server)."""
    from models.runtime import ensure_blas

    ensure_blas(sys.argv)


def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def run_record() -> dict:
    """The provenance every result JSON starts with: the exact command, date (UTC), git rev, machine facts."""
    return {"command": shlex.join(["python", "bench/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": utc_now(), "git_rev": git_rev(), "machine": machine_facts()}


def write_result(result: dict, out: str | Path) -> Path:
    """Write ``result`` as JSON to ``out``; a folder (bench/gpu.sh passes its OUT) gets ``<script>.json`` in it."""
    out = Path(out)
    if out.is_dir():
        out = out / (Path(sys.argv[0]).stem + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return out


# preflight: what counts as a busy machine
BUSY_LOAD_PER_CORE = 0.5  # 1-minute load average, less this process tree's own share, over cores
BUSY_PROCESS_CPU_PCT = 25.0  # any other process's CPU over the sample
BUSY_MEM_AVAILABLE_MIB = 1024
BUSY_SWAP_USED_MIB = 256
PREFLIGHT_SAMPLE_S = 1.0
LOAD1_TAU_S = 60.0  # the kernel's 1-minute load average is a moving average with this time constant

_last_own_cpu: tuple[float, float] | None = None  # (monotonic s, own tree CPU s) at the previous preflight()


def preflight() -> dict:
    """The machine's state right before (or after) a measurement, and whether it looks busy.

    Records the load average (1/5/15 min), cores, MemTotal / MemAvailable and swap (/proc/meminfo), and the top 5
    other processes by CPU: `ps` lists them (its %CPU, `pcpu`, is an average over each process's whole life), and a
    PREFLIGHT_SAMPLE_S sample of /proc/PID/stat gives each one's CPU now (`cpu_now`), which the busy rule reads.
    This process and its descendants (the servers a benchmark starts) are left out of the list. The load average
    counts this process tree too, so the load rule first subtracts an estimate of its own share (`own_load_est`):
    the tree's mean CPU use since the previous preflight() (or since the process started), as the 1-minute moving
    average would see a constant load over that time. Outside Linux the /proc figures are None and `ps` decides.

    busy is True when any of: load1 - own_load_est > BUSY_LOAD_PER_CORE x cores; another process above
    BUSY_PROCESS_CPU_PCT; MemAvailable < BUSY_MEM_AVAILABLE_MIB; swap in use > BUSY_SWAP_USED_MIB. `reasons` says
    which, one string each; a busy result also prints one WARNING line to stderr. Takes about PREFLIGHT_SAMPLE_S.
    """
    global _last_own_cpu
    me = os.getpid()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    ticks0, t0 = _proc_cpu_ticks(), time.monotonic()
    time.sleep(PREFLIGHT_SAMPLE_S)
    ticks1, t1 = _proc_cpu_ticks(), time.monotonic()
    rows = _ps_rows()
    mine = _descendants(me, {r["pid"]: r.pop("ppid") for r in rows})

    own_cpu = sum(os.times()[:4]) + sum(ticks1[p][1] for p in mine if p != me and p in ticks1) / tick
    if _last_own_cpu is None:
        window, used = _process_age_s(me, tick), own_cpu
    else:
        window, used = t1 - _last_own_cpu[0], own_cpu - _last_own_cpu[1]
    _last_own_cpu = (t1, own_cpu)
    own_load = used / window * (1 - math.exp(-window / LOAD1_TAU_S)) if window and window > 0 else 0.0

    others = [r for r in rows if r["pid"] not in mine]
    for r in others:
        if r["pid"] in ticks1:
            done = ticks1[r["pid"]][0] - (ticks0[r["pid"]][0] if r["pid"] in ticks0 else 0)
            r["cpu_now"] = round(100.0 * done / tick / (t1 - t0), 1)
        else:
            r["cpu_now"] = None
    others.sort(key=lambda r: r["pcpu"] if r["cpu_now"] is None else r["cpu_now"], reverse=True)

    load = os.getloadavg()
    cores = os.cpu_count() or 1
    mem = _meminfo_mib()
    swap_used = mem["SwapTotal"] - mem["SwapFree"] if "SwapTotal" in mem and "SwapFree" in mem else None
    reasons = []
    limit = BUSY_LOAD_PER_CORE * cores
    if load[0] - own_load > limit:
        own = f", ~{own_load:.2f} of it this benchmark's own" if own_load >= 0.05 else ""
        reasons.append(f"load average {load[0]:.2f} (1 min){own}: {load[0] - own_load:.2f} > {limit:g} "
                       f"({BUSY_LOAD_PER_CORE:g} x {cores} cores)")
    for r in others:
        cpu = r["pcpu"] if r["cpu_now"] is None else r["cpu_now"]
        if cpu > BUSY_PROCESS_CPU_PCT:
            reasons.append(f"pid {r['pid']} {r['comm']} at {cpu:.0f}% CPU")
    if mem.get("MemAvailable") is not None and mem["MemAvailable"] < BUSY_MEM_AVAILABLE_MIB:
        reasons.append(f"MemAvailable {mem['MemAvailable']:.0f} MiB < {BUSY_MEM_AVAILABLE_MIB} MiB")
    if swap_used is not None and swap_used > BUSY_SWAP_USED_MIB:
        reasons.append(f"swap in use {swap_used:.0f} MiB > {BUSY_SWAP_USED_MIB} MiB")
    result = {
        "date": utc_now(),
        "load_avg": [round(x, 2) for x in load],
        "cores": cores,
        "own_load_est": round(own_load, 2),
        "mem_total_mib": mem.get("MemTotal"),
        "mem_available_mib": mem.get("MemAvailable"),
        "swap_total_mib": mem.get("SwapTotal"),
        "swap_used_mib": swap_used,
        "others_cpu_now": round(sum(r["cpu_now"] or 0 for r in others), 1) if ticks1 else None,
        "top_processes": others[:5],
        "busy": bool(reasons),
        "reasons": reasons,
    }
    if reasons:
        print("WARNING: the machine is busy: " + "; ".join(reasons), file=sys.stderr, flush=True)
    return result


def busy_row(pf: dict, when: str = "before the measurement") -> str:
    """A markdown line warning that `pf` (a preflight() result) found the machine busy; "" when it did not."""
    if not pf or not pf.get("busy"):
        return ""
    return (f"> **Warning: the machine was busy {when}** (preflight {pf.get('date', 'undated')}): "
            + "; ".join(pf.get("reasons") or ["no reason recorded"]) + ".")


def _ps_rows() -> list[dict]:
    """Every process as {pid, ppid, pcpu, rss_mib, comm}, highest pcpu first; [] when ps is missing."""
    try:
        text = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,rss,comm"], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    rows = []
    for line in text.splitlines()[1:]:
        parts = line.split(None, 4)
        if len(parts) == 5:
            rows.append({"pid": int(parts[0]), "ppid": int(parts[1]), "pcpu": float(parts[2]),
                         "rss_mib": round(int(parts[3]) / 1024, 1), "comm": parts[4].strip()})
    return sorted(rows, key=lambda r: r["pcpu"], reverse=True)


def _descendants(root: int, parent: dict[int, int]) -> set[int]:
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _proc_cpu_ticks() -> dict[int, tuple[int, int]]:
    """pid -> (utime + stime, that + cutime + cstime) in clock ticks, from /proc/PID/stat; {} without /proc."""
    out = {}
    for d in Path("/proc").glob("[0-9]*") if Path("/proc/self/stat").exists() else []:
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        own = int(f[11]) + int(f[12])
        out[int(d.name)] = (own, own + int(f[13]) + int(f[14]))
    return out


def _process_age_s(pid: int, tick: int) -> float | None:
    try:
        start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / tick
        return float(Path("/proc/uptime").read_text().split()[0]) - start
    except (OSError, IndexError, ValueError):
        return None


def _meminfo_mib() -> dict[str, float]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree"):
                out[key] = round(int(rest.split()[0]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return out
