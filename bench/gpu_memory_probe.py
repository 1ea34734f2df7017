"""Where a CUDA card's memory goes beyond MLX's counters, in-process (issue 43: 16 Llama-3-8B agents on an 80 GB card
fail out of memory while MLX counts 64-68 GB).

A random model of the bench shape runs prefill forwards of many shapes (B rows x L new tokens after P cached, as a
busy lane's gathered prefills are), keeps their KV caches the way the RAM tier does (up to --held-gb, oldest let go
first), and every --every forwards reads, side by side: MLX's counters (active, cache, peak) and the driver's
(server/device_memory.py: the card's used bytes, the memory pool's reserved / used bytes, what lies outside the
pool). At the end it empties MLX's cache and then trims the pool, and reads again after each. Each --variants entry
runs in a process of its own:

  default       MLX as the server runs it
  no_cudnn_sdpa MLX_CUDA_USE_CUDNN_SDPA=0 (prefill attention in MLX's own ops, no cuDNN graph per shape)
  graphs_small  MLX_CUDA_GRAPH_CACHE_SIZE=16 (fewer cached CUDA graphs)
  from_disk     the weights saved as safetensors first (--model-dir) and loaded by mlx_lm.load, as the server does

    bash bench/gpu.sh bench/gpu_memory_probe.py --shape llama3-8b --forwards 100 --held-gb 45
    bash bench/gpu.sh bench/gpu_memory_probe.py --shape llama3-8b --forwards 0 --events 5000 --variants default
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

VARIANTS = {"default": {}, "no_cudnn_sdpa": {"MLX_CUDA_USE_CUDNN_SDPA": "0"},
            "graphs_small": {"MLX_CUDA_GRAPH_CACHE_SIZE": "16"}, "from_disk": {}}
GB = 1e9


def reading(label: str, t0: float) -> dict:
    import mlx.core as mx

    from server import device_memory

    row = {"at": label, "t_s": round(time.perf_counter() - t0, 2), "mlx_active_gb": mx.get_active_memory() / GB,
           "mlx_cache_gb": mx.get_cache_memory() / GB, "mlx_peak_gb": mx.get_peak_memory() / GB}
    snap = device_memory.snapshot() or {}
    for k, v in snap.items():
        row[k.replace("_bytes", "_gb")] = None if v is None else v / GB
    if snap.get("used_bytes") is not None:
        row["card_beyond_mlx_gb"] = (snap["used_bytes"] - mx.get_active_memory() - mx.get_cache_memory()) / GB
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}


def events_phase(n: int, t0: float) -> list:
    """A lead for the memory outside the pool in the server (BENCHMARKS.md 2026-12-06, fourth session): MLX's CUDA
    event (``AtomicEvent``, mlx/backend/cuda/event.cu) is 4 bytes of managed memory, and ``mx.async_eval`` attaches
    one to every array it evaluates until something reads that array again. ``n`` tiny arrays evaluated one
    ``async_eval`` each and kept untouched hold ``n`` events: the card's reading beside them, then after a plain
    ``mx.eval`` of them all (which lets their events go)."""
    import mlx.core as mx

    kept = []
    for i in range(n):
        a = mx.full((4,), float(i))
        mx.async_eval(a)
        kept.append(a)
    mx.synchronize()
    out = [reading(f"{n} async_eval'd arrays kept", t0)]
    mx.eval(kept)
    out.append(reading("after mx.eval of them", t0))
    del kept
    out.append(reading("after they are let go", t0))
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def probe(args) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gpu_write_cost import build
    from server import device_memory
    from server.sizes import apply_allocator_limits, default_memory_budget

    t0 = time.perf_counter()
    rows = [reading("start", t0)]
    if args.one == "from_disk":
        from mlx_lm import load

        model = load(args.model_dir)[0]
    else:
        model = build(args.shape, "bfloat16")[0]
    mx.eval(model.parameters())
    rows.append(reading("weights", t0))
    if args.server_limits:
        apply_allocator_limits(default_memory_budget()[0])
    if args.events:
        rows.extend(events_phase(args.events, t0))
    rng = random.Random(args.seed)
    held: list = []
    held_bytes = 0
    for i in range(1, args.forwards + 1):
        b = rng.choice((1, 2, 4, 8))
        cached = rng.randrange(0, 8000 // b)
        new = rng.randrange(16, 2048 // b + 1)
        cache = make_prompt_cache(model)
        if cached:
            model(mx.array([[rng.randrange(1000, 40000) for _ in range(cached)]] * b), cache=cache)
        logits = model(mx.array([[rng.randrange(1000, 40000) for _ in range(new)] for _ in range(b)]), cache=cache)
        mx.eval(logits[:, -1], [c.state for c in cache])
        del logits
        size = sum(c.nbytes for c in cache)
        held.append((cache, size))
        held_bytes += size
        while held_bytes > args.held_gb * GB:
            held_bytes -= held.pop(0)[1]
        if i % args.every == 0:
            rows.append({**reading(f"forward {i}", t0), "held_gb": round(held_bytes / GB, 2)})
            print(json.dumps(rows[-1]), flush=True)
    rows.append(reading("end", t0))
    mx.synchronize()
    mx.clear_cache()
    rows.append(reading("after mx.clear_cache", t0))
    trimmed = device_memory.trim_pool(0)
    rows.append({**reading("after trim_pool", t0), "trimmed": trimmed})
    held.clear()
    mx.synchronize()
    mx.clear_cache()
    device_memory.trim_pool(0)
    rows.append(reading("all let go + trim", t0))
    for r in rows[-4:]:
        print(json.dumps(r), flush=True)
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".bench/gpu-out")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--forwards", type=int, default=100)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--held-gb", type=float, default=45.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="default,no_cudnn_sdpa")
    ap.add_argument("--server-limits", action="store_true", help="MLX's allocator limits as the server sets them")
    ap.add_argument("--events", type=int, default=0, help="first, this many async_eval'd arrays kept (events_phase)")
    ap.add_argument("--model-dir", default="/tmp/gpu-memory-probe-model", help="from_disk: where the model is saved")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".whl" / "tok"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = ap.parse_args()
    if args.one == "build":  # in a process of its own, so that no variant shares the card with its arrays
        import gpu

        gpu.build_model(Path(args.model_dir), args.shape, "bfloat16", Path(args.tokenizer_dir))
        return
    if args.one:
        print("RESULT " + json.dumps(probe(args)), flush=True)
        return
    if "from_disk" in args.variants.split(",") and not (Path(args.model_dir) / "config.json").exists():
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", "build"], check=True)
    out: dict = {"script": "gpu_memory_probe.py", "argv": sys.argv[1:], "variants": {}}
    for name in args.variants.split(","):
        env = {**os.environ, **VARIANTS[name]}
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name]
        print(f"== {name} {VARIANTS[name]}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(proc.stdout[-6000:], proc.stderr[-3000:], flush=True)
        res = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        out["variants"][name] = json.loads(res[0]) if res else {"error": proc.stderr[-3000:], "rc": proc.returncode}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_memory_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
