"""What one decode step of the server's batch runs on the device, kernel by kernel (issue 43), under Nsight Compute.

A served 16-row Qwen3.5-9B step takes ~15.6 ms on an H100 where its bytes allow ~5.6, and the lane's thread spends
40% of its time waiting inside ``mx.async_eval`` for the device (bench/gpu_agents.py --profile-ours): the device
is busy, so what it runs is what to make cheaper. This builds the --shape model (random weights), installs this
project's kernels and fused attention as the server does, fills the server's decode batch (``RaggedBatch``,
pipelined) with --rows rows of --context cached tokens, and then:

  1. times --steps pipelined steps (ms a step, wall);
  2. runs --profile-steps more steps between ``cuProfilerStart`` / ``cuProfilerStop``: run under
     ``ncu --profile-from-start off`` (``--ncu`` does that: it runs this script again under ncu), only those
     steps' kernels are measured, each alone (``gpu__time_duration``, clocks and caches left as they are);
  3. sums them by kernel name: count a step, microseconds a step, share of the step's kernel time, and the sum of
     all kernels against the wall of a step (what is left is launch gaps and waiting between graphs).

``--what prefill`` does the same for one batched prompt forward instead of a decode step: --rows rows of --chunk new
tokens over --context cached ones each (0: cold), mlx-lm's caches, as the lane's gathered prefill runs them.

    bash bench/gpu.sh bench/gpu_kernel_times.py --ncu --shape qwen3.5-9b        # the device (ncu is on its image)
    python bench/gpu_kernel_times.py --shape qwen3.5-tiny --dtype float32 --rows 2 --context 32 --steps 4
                                                                                # the CPU: the script's logic only

Writes OUT/kernel_times_<what>_<shape>[_<rows>x<chunk>].json (and OUT/ncu_<same>.csv, ncu's own rows).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu  # noqa: E402

UNITS_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}


def profiler(on: bool) -> bool:
    """cuProfilerStart / cuProfilerStop (the lane's own, server.lane.cuda_profile); False off CUDA."""
    from server.lane.cuda_profile import driver_profiler

    return driver_profiler(on)


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and parameter list (enough to tell kernels apart)."""
    name = re.sub(r"\(.*$", "", kernel.strip())
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).replace("void ", "").strip()
    return name[-120:]


def find_ncu(given: str | None = None) -> str | None:
    """Nsight Compute's CLI: ``given``, else on PATH, else under /opt/nvidia or /usr/local."""
    return given or shutil.which("ncu") or next(
        (str(p) for base in ("/opt/nvidia", "/usr/local") for p in sorted(Path(base).glob("**/ncu"))
         if p.is_file() and os.access(p, os.X_OK)), None)


def ncu_prefix(ncu: str, csv_path: Path) -> list[str]:
    """The launcher that measures each kernel's time between cuProfilerStart and cuProfilerStop, as CSV."""
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
            "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base", "--log-file", str(csv_path)]


def read_ncu_csv(path: Path) -> list[dict]:
    """The rows of ncu's CSV (its log lines before the header skipped); [] when there is none."""
    text = path.read_text() if path.is_file() else ""
    start = text.find('"ID"')
    return list(csv.DictReader(text[start:].splitlines())) if start >= 0 else []


def summarize(rows: list[dict], steps: int, step_ms: float) -> dict:
    """ncu's CSV rows (one per kernel and metric) -> per kernel name: launches and microseconds a step."""
    per: dict = defaultdict(lambda: {"launches": 0, "ns": 0.0})
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(str(r.get("Metric Value", "0")).replace(",", ""))
        ns = value * UNITS_NS.get(str(r.get("Metric Unit", "nsecond")).strip(), 1.0)
        k = per[short_name(r.get("Kernel Name", "?"))]
        k["launches"] += 1
        k["ns"] += ns
    total_ns = sum(k["ns"] for k in per.values())
    table = sorted(({"kernel": name, "launches_per_step": round(k["launches"] / steps, 2),
                     "us_per_step": round(k["ns"] / steps / 1e3, 1),
                     "share": round(k["ns"] / total_ns, 4) if total_ns else 0.0} for name, k in per.items()),
                   key=lambda x: -x["us_per_step"])
    kernels_ms = total_ns / steps / 1e6
    return {"kernels_per_step": round(sum(k["launches"] for k in per.values()) / steps, 1),
            "kernel_ms_per_step": round(kernels_ms, 3), "step_ms_wall": round(step_ms, 3),
            "kernels_share_of_wall": round(kernels_ms / step_ms, 3) if step_ms else None, "by_kernel": table}


def child(args) -> dict:
    """Build, fill the batch, time steps, then the profiled steps; the timings (ncu reads the kernels)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gpu_window_solo import build
    from models import kernels
    from models.attention import gpu as lane_attention
    from server.engine.batch.protocol import Row
    from server.engine.batch.ragged import RaggedBatch

    t0 = time.perf_counter()
    if args.vocab:
        import gpu

        gpu.SHAPES[args.shape] = {**gpu.SHAPES[args.shape], "vocab_size": args.vocab}
    model, cfg = build(args.shape, args.dtype)
    installed = {"kernels": kernels.install(model), "attention": lane_attention.install(model)}
    mx.eval(model.parameters())
    built_s = time.perf_counter() - t0
    prompt = mx.array([[(7 * i + 3) % 40000 + 100 for i in range(args.context)]])
    if args.what == "prefill":
        return {**prefill_child(args, model, prompt), "build_s": round(built_s, 1), "installed": installed}
    one = make_prompt_cache(model)
    for i in range(0, args.context, 1024):
        model(prompt[:, i:i + 1024], cache=one)
        mx.eval([c.state for c in one])
    batch = RaggedBatch(model, pipelined=True)
    batch.add([Row(SimpleNamespace(id=r), _clone(one), list(range(args.context)) + [5]) for r in range(args.rows)])
    for _ in range(4):
        batch.step()
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        batch.step()
    mx.synchronize()
    step_ms = (time.perf_counter() - t) * 1e3 / args.steps
    started = profiler(True)
    for _ in range(args.profile_steps):
        batch.step()
        mx.synchronize()  # each step whole inside the window (a pipelined step queues the next)
    profiler(False)
    return {"shape": args.shape, "dtype": args.dtype, "rows": args.rows, "context": args.context,
            "steps_timed": args.steps, "profile_steps": args.profile_steps, "profiler_started": started,
            "step_ms": round(step_ms, 3), "build_s": round(built_s, 1), "installed": installed,
            "device": str(mx.default_device())}


def prefill_child(args, model, prompt) -> dict:
    """One forward of --rows rows x --chunk new tokens over --context cached tokens each, timed, then profiled."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def caches():
        c = make_prompt_cache(model)
        for i in range(0, args.context, 1024):  # every row the same cached tokens
            model(mx.broadcast_to(prompt[:, i:i + 1024], (args.rows, min(1024, args.context - i))), cache=c)
            mx.eval([x.state for x in c])
        return c

    chunk = mx.array([[(11 * i + 5 * r) % 40000 + 100 for i in range(args.chunk)] for r in range(args.rows)])

    def forward(c) -> None:
        mx.eval(model(chunk, cache=c)[:, -1, :])

    forward(caches())  # the kernels compiled, the plans made

    def timed(release: str) -> list:
        """Forwards over fresh caches; ``release``: before each, nothing (``none``), or MLX's freed buffers handed
        back to the device (``clear``: mx.clear_cache, as each served prefill forward does), then the device
        synchronized (where the CUDA pool gives back what it keeps beyond its release threshold)."""
        out = []
        for _ in range(max(1, args.steps // 8)):
            c = caches()
            if release != "none":
                mx.clear_cache()
            mx.synchronize()
            t = time.perf_counter()
            forward(c)
            out.append((time.perf_counter() - t) * 1e3)
        return sorted(out)

    by_release = {}
    for release in args.release.split(","):
        if release == "clear_keep":  # the pool keeps 8 GiB freed (--cuda-pool-keep 8G); for the rest of the process
            from server.device_memory import driver

            dm = driver()
            if dm is None or not dm.set_release_threshold(8 << 30):
                by_release[release] = "the driver did not take the release threshold"
                continue
        elif release not in ("none", "clear"):
            raise SystemExit(f"--release: none, clear or clear_keep, not {release!r}")
        ms = timed("clear" if release == "clear_keep" else release)
        by_release[release] = {"median_ms": round(ms[len(ms) // 2], 3), "ms": [round(x, 2) for x in ms]}
        print(f"prefill {args.rows}x{args.chunk} release {release}: {by_release[release]}", flush=True)
    times = timed("none")
    c = caches()
    mx.synchronize()
    started = profiler(True)
    forward(c)
    mx.synchronize()
    profiler(False)
    times.sort()
    return {"what": "prefill", "shape": args.shape, "dtype": args.dtype, "rows": args.rows, "chunk": args.chunk,
            "context": args.context, "profile_steps": 1, "profiler_started": started,
            "step_ms": round(times[len(times) // 2], 3), "forwards_timed": len(times), "by_release": by_release,
            "device": str(mx.default_device())}


def _clone(caches: list) -> list:
    from gpu_hybrid_parts import _clone as clone

    return clone(caches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vocab", type=int, default=None,
                    help="cut the vocabulary to this size (49152: the model bench/gpu_agents.py serves; default: the "
                         "shape's own)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=5000, help="each row's cached tokens (default %(default)s)")
    ap.add_argument("--steps", type=int, default=32, help="pipelined steps timed (default %(default)s)")
    ap.add_argument("--profile-steps", type=int, default=1, help="steps whose kernels ncu measures (default 1)")
    ap.add_argument("--what", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--chunk", type=int, default=330, help="--what prefill: new tokens a row (default %(default)s)")
    ap.add_argument("--release", default="none",
                    help="--what prefill: comma list of none, clear (mx.clear_cache before each forward, as served "
                         "prefill does), clear_keep (the same with the CUDA pool keeping 8 GiB: --cuda-pool-keep)")
    ap.add_argument("--ncu", action="store_true", help="run this script again under ncu and sum its kernels")
    ap.add_argument("--ncu-bin", default=None, help="ncu's path (default: on PATH, or under /opt/nvidia, /usr/local)")
    ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child_json or not args.ncu:
        got = child(args)
        tag = f"{args.what}_{args.shape}" + (f"_{args.rows}x{args.chunk}" if args.what == "prefill" else f"_{args.rows}")
        Path(args.child_json or out / f"kernel_times_{tag}.json").write_text(json.dumps(got, indent=1))
        print(json.dumps(got), flush=True)
        return 0
    ncu = find_ncu(args.ncu_bin)
    if ncu is None:
        print("ncu not found: pass --ncu-bin", file=sys.stderr)
        return 2
    tag = f"{args.what}_{args.shape}" + (f"_{args.rows}x{args.chunk}" if args.what == "prefill" else f"_{args.rows}")
    raw, timings = out / f"ncu_{tag}.csv", out / f"kernel_times_{tag}_child.json"
    argv = [a for a in sys.argv[1:] if a != "--ncu"]
    cmd = [*ncu_prefix(ncu, raw), sys.executable, str(Path(__file__).resolve()), *argv, "--child-json", str(timings)]
    print("running: " + " ".join(cmd), flush=True)
    t = time.perf_counter()
    rc = subprocess.call(cmd)
    got = json.loads(timings.read_text()) if timings.is_file() else {}
    rows = read_ncu_csv(raw)
    got.update({"ncu": ncu, "ncu_rc": rc, "ncu_wall_s": round(time.perf_counter() - t, 1),
                "summary": summarize(rows, max(1, args.profile_steps), got.get("step_ms", 0.0))})
    Path(out / f"kernel_times_{tag}.json").write_text(json.dumps(got, indent=1))
    s = got["summary"]
    print(f"{tag}: {args.rows} rows x {args.context} (chunk {args.chunk}): {got.get('step_ms')} ms wall; "
          f"kernels {s['kernels_per_step']} a step, {s['kernel_ms_per_step']} ms of kernel time "
          f"({s['kernels_share_of_wall']} of the wall)", flush=True)
    for k in s["by_kernel"][:25]:
        print(f"  {k['us_per_step']:9.1f} us  {k['share'] * 100:5.1f}%  x{k['launches_per_step']:<6} {k['kernel']}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
