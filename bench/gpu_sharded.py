"""GPU sharding benchmark (issue 15, part 2): one random Llama-3-8B-shaped bf16 model served by one GPU vs
tensor-parallel over 2 GPUs (`mlx.launch -n 2 --backend nccl`, one GPU per rank), same server, same workload.

Runs on the device machine with 2 GPUs (`nvidia-h200-x2`); `bash bench/gpu.sh sharded [flags]` installs the carried
wheels and calls this. The model is built once (bench/gpu.py's build_model: random normal weights, seed 0, on a
tmpfs when there is one), then each system runs alone, one after the other (never two servers on one GPU):
  one   `mlx-lane serve --dtype bfloat16 --no-ssd-cache --prefill-chunk 2048` with CUDA_VISIBLE_DEVICES=0
  tp2   the same flags under `mlx.launch -n 2 --backend nccl` (rank r gets GPU r; rank 0 serves HTTP)
Per system, after a warm-up of every shape:
  decode   single-stream decode tok/s: --decode-prompt-token random prompt, --decode-tokens tokens, EOS suppressed
           (logit_bias -100), greedy, --rounds rounds; rate = (tokens - 1) / (last - first token time)
  ttft     cold TTFT at each of --lengths (default 8192, 32768): a fresh random prompt, max_tokens 1,
           --ttft-reps reps (the RAM cache is cleared between reps so every prompt is cold)
  batch    N concurrent distinct --batch-prompt-token prompts of --batch-tokens tokens for N in --levels:
           aggregate tok/s (all completion tokens / wall) and mean TTFT, median over --batch-rounds
Ratios tp2 / one per measure are in the JSON's "ratios". Writes OUT/gpu_sharded.json (after every step) and
OUT/gpu_sharded.log; copy the JSON to bench/results/ for the record.

    bash bench/gpu.sh sharded                                # the 2x H200 run
    python bench/gpu_sharded.py --out /tmp/gs --shape tiny --dtype float32 --backend ring --lengths 256 \
        --levels 1,2 --rounds 1 --ttft-reps 1 --batch-rounds 1 --decode-tokens 16 --batch-tokens 8 \
        --batch-prompt-tokens 64                              # logic check on a CPU (ring backend, 2 processes)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu  # noqa: E402  (SHAPES, build_model, eos_ids, Server.complete, helpers)
from gpu import ROOT, meminfo, sh, summary  # noqa: E402

T0 = time.monotonic()
R: dict = {"script": "bench/gpu_sharded.py"}
OUT = Path(".")
LOG = None


def log(msg: str) -> None:
    line = f"[{time.monotonic() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def save() -> None:
    R["elapsed_s"] = round(time.monotonic() - T0, 1)
    tmp = OUT / "gpu_sharded.json.tmp"
    tmp.write_text(json.dumps(R, indent=1))
    os.replace(tmp, OUT / "gpu_sharded.json")


class Served(gpu.Server):
    """A server (one process, or a group under mlx.launch) with gpu.Server's streamed-completion client."""

    def __init__(self, name: str, n: int, backend: str, env: dict, *args: str):
        from tests.launchproc import LaunchedServer
        from tests.serverproc import ServerProc

        self.name = name
        t = time.perf_counter()
        if n == 1:
            self.proc = ServerProc(*args, env=env, startup_timeout=900)
        else:
            self.proc = LaunchedServer(n, *args, env=env, startup_timeout=900, backend=backend)
        self.start_s = time.perf_counter() - t
        self.url = self.proc.url
        log(f"server {name} up in {self.start_s:.1f}s: {n} process(es), {' '.join(args)}")
        R.setdefault("servers", {})[name] = {"processes": n, "backend": backend if n > 1 else None,
                                             "args": list(args), "start_s": round(self.start_s, 1)}

    def stop(self, kill: bool = False) -> None:
        rc = self.proc.stop(timeout=300)
        R["servers"][self.name]["rc"] = rc
        with open(OUT / "servers.log", "a") as f:
            f.write(f"\n===== server {self.name} (rc {rc}) =====\n{self.proc.log()[-8000:]}")
        log(f"server {self.name} stopped (rc {rc})")


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, gpu.PROMPT_VOCAB) for _ in range(n)]


def phase_decode(srv: Served, args, rng, bias) -> dict:
    for _ in range(2):
        srv.complete(rand_prompt(rng, args.decode_prompt_tokens), 32, logit_bias=bias)
    rates = []
    for i in range(args.rounds):
        r = srv.complete(rand_prompt(rng, args.decode_prompt_tokens), args.decode_tokens, logit_bias=bias)
        rates.append(r["decode_tok_s"])
        log(f"{srv.name} decode round {i}: {r['decode_tok_s']:.1f} tok/s ({r['completion_tokens']} tokens)")
    return {"tok_s": summary(rates), "prompt_tokens": args.decode_prompt_tokens, "max_tokens": args.decode_tokens}


def phase_ttft(srv: Served, args, rng) -> dict:
    out = {}
    for L in args.lengths:
        srv.complete(rand_prompt(rng, L), 1)  # warm-up: MLX compiles kernels per shape
        ts = []
        for i in range(args.ttft_reps):
            srv.post("/admin/cache/clear")
            r = srv.complete(rand_prompt(rng, L), 1)
            ts.append(r["ttft_s"])
            log(f"{srv.name} cold TTFT {L}: {r['ttft_s']:.3f}s (cached {r['cached_tokens']})")
        out[str(L)] = {"cold_s": summary(ts), "prefill_tok_s": round(L / med(ts), 1) if med(ts) else None}
    srv.post("/admin/cache/clear")
    return out


def phase_batch(srv: Served, args, rng, bias) -> dict:
    out = {}
    with cf.ThreadPoolExecutor(max(args.levels)) as pool:
        for n in args.levels:  # warm-up of this batch shape
            list(pool.map(lambda p: srv.complete(p, 8, logit_bias=bias),
                          [rand_prompt(rng, args.batch_prompt_tokens) for _ in range(n)]))
        for n in args.levels:
            aggs, ttfts = [], []
            for i in range(args.batch_rounds):
                prompts = [rand_prompt(rng, args.batch_prompt_tokens) for _ in range(n)]
                t = time.perf_counter()
                rows = list(pool.map(lambda p: srv.complete(p, args.batch_tokens, logit_bias=bias), prompts))
                wall = time.perf_counter() - t
                toks = sum(r["completion_tokens"] for r in rows)
                aggs.append(toks / wall)
                ttfts.append(statistics.mean(r["ttft_s"] for r in rows if r["ttft_s"] is not None))
                log(f"{srv.name} batch N={n} round {i}: {toks / wall:.1f} tok/s aggregate, mean TTFT "
                    f"{ttfts[-1]:.3f}s")
            out[str(n)] = {"aggregate_tok_s": summary(aggs), "mean_ttft_s": summary(ttfts)}
    return out


def ratios() -> dict:
    one, tp = R.get("one", {}), R.get("tp2", {})
    out = {}

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    if "decode" in one and "decode" in tp:
        out["decode_tok_s"] = ratio(tp["decode"]["tok_s"]["median"], one["decode"]["tok_s"]["median"])
    for L in (one.get("ttft") or {}):
        if L in (tp.get("ttft") or {}):
            out[f"cold_ttft_{L}"] = ratio(tp["ttft"][L]["cold_s"]["median"], one["ttft"][L]["cold_s"]["median"])
    for n in (one.get("batch") or {}):
        if n in (tp.get("batch") or {}):
            out[f"batch_{n}_aggregate_tok_s"] = ratio(tp["batch"][n]["aggregate_tok_s"]["median"],
                                                      one["batch"][n]["aggregate_tok_s"]["median"])
    return out


def main() -> int:
    global OUT, LOG
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="nccl", help="mlx.launch backend of the 2-process system")
    ap.add_argument("--systems", default="one,tp2")
    ap.add_argument("--phases", default="decode,ttft,batch")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--batch-rounds", type=int, default=2)
    ap.add_argument("--batch-prompt-tokens", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--cache-bytes", default="20G")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".whl" / "tok"))
    ap.add_argument("--model-dir")
    ap.add_argument("--reuse-model", action="store_true")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.levels = [int(x) for x in args.levels.split(",")]
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    LOG = open(OUT / "gpu_sharded.log", "a")
    home = OUT / "mlx-lane-home"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    gpu.HOME = home

    import mlx.core as mx
    import mlx_lm

    R["facts"] = {"nvidia_smi": sh("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"),
                  "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device()),
                  "cpus": os.cpu_count(), "meminfo_at_start": meminfo(),
                  "git": sh(f"git -C {ROOT} rev-parse --short HEAD 2>/dev/null") or "unknown"}
    R["args"] = {k: v for k, v in vars(args).items()}
    log(f"facts: {R['facts']}")
    tok_dir = Path(args.tokenizer_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        from models.loading.default import ensure_default_model

        tok_dir = ensure_default_model(progress=False)
    model_dir = Path(args.model_dir) if args.model_dir else (
        Path("/dev/shm/mlx-lane-bench-model") if os.path.isdir("/dev/shm") else ROOT / ".bench" / "gpu-model")
    if not (args.reuse_model and (model_dir / "config.json").is_file()):
        model = gpu.build_model(model_dir, args.shape, args.dtype, tok_dir)
        del model
        mx.clear_cache()
    R["model"] = {"dir": str(model_dir), "shape": args.shape, "dtype": args.dtype}
    eos = gpu.eos_ids(model_dir)
    bias = {str(e): -100 for e in eos}
    flags = ("--model", str(model_dir), "--dtype", args.dtype, "--no-ssd-cache", "--prefill-chunk",
             str(args.prefill_chunk), "--cache-bytes", args.cache_bytes, "--max-batch", str(max(args.levels)))
    phases = args.phases.split(",")
    env = {"MLX_LANE_HOME": str(home), "MLX_LANE_EMBEDDING_MODEL": "none"}  # no embeddings: nothing to fetch
    for system in args.systems.split(","):
        n = 1 if system == "one" else int(system.removeprefix("tp"))
        sys_env = dict(env, CUDA_VISIBLE_DEVICES="0") if n == 1 and args.backend == "nccl" else env
        rng = random.Random(0)  # the same prompts for every system
        srv = Served(system, n, args.backend, sys_env, *flags)
        R[system] = {}
        try:
            if "decode" in phases:
                R[system]["decode"] = phase_decode(srv, args, rng, bias)
                save()
            if "ttft" in phases:
                R[system]["ttft"] = phase_ttft(srv, args, rng)
                save()
            if "batch" in phases:
                R[system]["batch"] = phase_batch(srv, args, rng, bias)
                save()
            R[system]["stats_distributed"] = srv.stats().get("distributed")
        except Exception as exc:  # keep what was measured
            R[system]["error"] = repr(exc)
            log(f"{system} failed: {exc!r}")
        finally:
            srv.stop()
        R["ratios"] = ratios()
        save()
    log(f"ratios tp2 / one: {json.dumps(R.get('ratios'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
