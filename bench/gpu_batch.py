"""GPU batching benchmark (issue 12): N concurrent distinct requests on a random Llama-3-8B-shaped bf16 model.

Runs on the device machine (NVIDIA H200, MLX's CUDA build); `bash bench/gpu.sh batch [flags]` installs the carried
wheels and calls this. In one process and one call, for every concurrency level N in --levels (default
1,4,8,16,32), N distinct random-word prompts of --prompt-tokens tokens (default 1,024) each asking for --max-tokens
tokens (default 128), greedy, EOS suppressed (logit_bias -100, as bench/gpu.py does), against:
  raw     mlx-lm's BatchGenerator in this process: all N prompts inserted at once, stepped until every row has its
          tokens (completion / prefill batch sizes = --decode-concurrency / --prompt-concurrency, prefill step 2048);
          TTFT of a row = insert -> its first generated token
  mlx_lm  `mlx_lm.server --decode-concurrency 32 --prompt-concurrency 8` (streamed /v1/completions)
  ours    `mlx-lane serve --dtype bfloat16 --no-ssd-cache --prefill-chunk 2048` (+ --ours-args), streamed
  ours_ssd  the same server at its defaults, SSD tier on (`--ssd-cache` in the run's temp dir, its own home), only
          when --systems names it: what the write-behind costs; its /stats ssd_cache section is kept at the end
Servers get their N requests from N client threads, connections opened --stagger-ms apart (mlx_lm.server's
listen backlog is 5). Both servers stay up for the whole run; every (round, N) draws fresh prompts shared by the
three systems, which run one after the other in an order rotated every round and level. A warm-up pass (8 tokens
at every level, its own prompts) comes first, since MLX JIT-compiles each new shape.

Per system and N: aggregate tok/s = all completion tokens / wall (first request sent -> last token), mean TTFT
(each request's send -> its first token chunk), median (min-max) over --rounds rounds. Also the single-stream
decode rate served (ours, mlx_lm) vs raw mlx-lm generate_step (bench/gpu.py's raw_run) alternated --single-rounds
times, and ours / mlx_lm, ours / raw (and ours_ssd / ours) ratios per N. Rounds after the first are skipped when
the previous round's duration would overrun --time-budget-s (counted from the script's start), so a run fits its
device time.

Writes OUT/gpu_batch.json (after every step) and OUT/gpu_batch.log; copy gpu_batch.json to bench/results/ for
bench/report.py's `gpu_batch` section.

    bash bench/gpu.sh batch                                   # the H200 run (installs the carried wheels first)
    python bench/gpu_batch.py --out /tmp/gb --shape tiny --dtype float32 --levels 1,2 --max-tokens 8 \
        --prompt-tokens 64 --rounds 1 --single-rounds 1        # logic check on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu  # noqa: E402  (build_model, eos_ids, raw_run, facts helpers)
from gpu import ROOT, fs_type, free_gib, meminfo, sh, summary  # noqa: E402

T0 = time.monotonic()
R: dict = {"script": "bench/gpu_batch.py"}
OUT = Path(".")
LOG = None
SYSTEMS = ("raw", "mlx_lm", "ours")  # the default; "ours_ssd" (SSD tier on) only when --systems names it


def log(msg: str) -> None:
    line = f"[{time.monotonic() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def save() -> None:
    R["elapsed_s"] = round(time.monotonic() - T0, 1)
    tmp = OUT / "gpu_batch.json.tmp"
    tmp.write_text(json.dumps(R, indent=1))
    os.replace(tmp, OUT / "gpu_batch.json")


# ------------------------------------------------------------------------------------------------------ prompts

def word_pieces(tokenizer) -> list[str]:
    """" word" pieces that are single tokens of the tokenizer (byte-level BPE: 'Ġ' + lowercase letters)."""
    vocab = tokenizer._tokenizer.get_vocab() if hasattr(tokenizer, "_tokenizer") else tokenizer.get_vocab()
    words = sorted(" " + t[1:] for t in vocab if re.fullmatch(r"Ġ[a-z]{3,10}", t))
    if len(words) < 100:
        raise SystemExit(f"the tokenizer has only {len(words)} 'Ġword' tokens: cannot build random-word prompts")
    return words


def make_prompt(rng: random.Random, words: list[str], tokenizer, n_tokens: int) -> str:
    """Random words whose encoding (as the servers encode a text prompt) is n_tokens long (or within a few)."""
    ws = [rng.choice(words) for _ in range(n_tokens)]
    for _ in range(10):
        n = len(tokenizer.encode("".join(ws)))
        if n == n_tokens:
            break
        if n > n_tokens:
            del ws[-(n - n_tokens):]
        else:
            ws += [rng.choice(words) for _ in range(n_tokens - n)]
    return "".join(ws)


# ------------------------------------------------------------------------------------------------------ clients

def stream_completion(url: str, text: str, max_tokens: int, bias: dict) -> dict:
    """One streamed /v1/completions request: send time, chunk stamps, completion tokens (usage, else chunks)."""
    import httpx

    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": bias}
    stamps, usage = [], None
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            # a chunk that carries text (mlx_lm.server puts the last tokens' text in its finish chunk) or is not a
            # bare finish; servers may hold tokens back until a word ends, so chunks are not tokens one to one
            if any(ch.get("text") or not ch.get("finish_reason") for ch in obj.get("choices") or []):
                stamps.append(time.perf_counter())
            if obj.get("usage"):
                usage = obj["usage"]
    end = time.perf_counter()
    n = (usage or {}).get("completion_tokens") or len(stamps)
    return {"sent": sent, "first": stamps[0] if stamps else end, "end": end, "tokens": n,
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and len(stamps) > 1 and stamps[-1] > stamps[0]
            else None}


def run_served(url: str, texts: list[str], max_tokens: int, bias: dict, stagger_s: float) -> dict:
    """All texts at once from one thread each, --stagger-ms apart; one connection retry after 50 ms."""
    import httpx

    out: list[dict | None] = [None] * len(texts)
    barrier = threading.Barrier(len(texts))

    def one(i: int) -> None:
        barrier.wait()
        time.sleep(i * stagger_s)
        for attempt in (1, 2):
            try:
                out[i] = {**stream_completion(url, texts[i], max_tokens, bias), "attempts": attempt}
                return
            except httpx.ConnectError as exc:
                out[i] = {"error": f"ConnectError: {exc}"}
                time.sleep(0.05)
            except Exception as exc:  # recorded; the other requests still count
                out[i] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                return

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = [r for r in out if r and "error" not in r]
    if not ok:
        raise RuntimeError(f"every request failed: {out[0]}")
    t0 = min(r["sent"] for r in ok)
    wall = max(r["end"] for r in ok) - t0
    return metrics(wall, [r["first"] - r["sent"] for r in ok], sum(r["tokens"] for r in ok),
                   errors=[r["error"] for r in out if r and "error" in r],
                   retries=sum(1 for r in ok if r["attempts"] > 1),
                   prompt_tokens=[r["prompt_tokens"] for r in ok])


def run_raw(model, prompts: list[list[int]], max_tokens: int, procs, decode_conc: int, prompt_conc: int) -> dict:
    """mlx-lm BatchGenerator: insert every prompt at once, step until each row has max_tokens tokens."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=None, logits_processors=procs,
                         completion_batch_size=decode_conc, prefill_batch_size=prompt_conc, prefill_step_size=2048)
    t0 = time.perf_counter()
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    first: dict[int, float] = {}
    count = dict.fromkeys(uids, 0)
    done: set[int] = set()
    for _ in range(len(prompts) * (max_tokens + 64) + 1000):  # a bound, so a bug cannot spin forever
        _, responses = gen.next()
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now)
            count[r.uid] += 1
            if r.finish_reason is not None:
                done.add(r.uid)
        if len(done) == len(uids):
            break
    else:
        raise RuntimeError(f"BatchGenerator did not finish: {len(done)} of {len(uids)} rows done")
    wall = time.perf_counter() - t0
    gen.close()
    del gen
    mx.clear_cache()
    return metrics(wall, [first[u] - t0 for u in uids], sum(count.values()), prompt_tokens=[len(p) for p in prompts])


def lane_ticks(url: str) -> tuple[int, dict]:
    """The lane's tick count and seconds per phase so far (/stats lane.ticks, lane.tick_seconds)."""
    import httpx

    lane = httpx.get(url + "/stats", timeout=60).json().get("lane") or {}
    return int(lane.get("ticks") or 0), dict(lane.get("tick_seconds") or {})


def metrics(wall: float, ttfts: list[float], tokens: int, **extra) -> dict:
    return {"wall_s": round(wall, 4), "tok_s": round(tokens / wall, 2), "ttft_mean_s": round(statistics.mean(ttfts), 4),
            "ttft_max_s": round(max(ttfts), 4), "completion_tokens": tokens, **extra}


# --------------------------------------------------------------------------------------------------------- main

def model_place(args) -> Path:
    """The model directory: tmpfs /dev/shm when it has room (gpu.py's place for the 8B shape), else .bench/."""
    if args.model_dir:
        return Path(args.model_dir)
    name = "mlx-lane-bench-model" + ("" if args.shape == "llama3-8b" else f"-{args.shape}")
    need = 20 if args.shape == "llama3-8b" else 1
    if os.path.isdir("/dev/shm") and fs_type("/dev/shm") == "tmpfs" and free_gib("/dev/shm") >= need:
        return Path("/dev/shm") / name
    return ROOT / ".bench" / name


def main() -> int:
    global OUT, LOG
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--levels", default="1,4,8,16,32", help="concurrency levels (default 1,4,8,16,32)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of raw, mlx_lm, ours, ours_ssd")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--single-rounds", type=int, default=3, help="single-stream served vs raw decode rounds")
    ap.add_argument("--decode-concurrency", type=int, default=32, help="mlx_lm.server's and raw's decode batch")
    ap.add_argument("--prompt-concurrency", type=int, default=8, help="mlx_lm.server's and raw's prefill batch")
    ap.add_argument("--stagger-ms", type=float, default=3.0)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--raw-no-bias", action="store_true",
                    help="raw BatchGenerator without the EOS logit_bias processor (rows cannot stop on EOS anyway)")
    ap.add_argument("--time-budget-s", type=float, default=360,
                    help="skip further rounds when the last round's duration would overrun this (from the start)")
    ap.add_argument("--cache-bytes", default="8G", help="ours --cache-bytes")
    ap.add_argument("--ours-args", default="", help="extra `mlx-lane serve` arguments (one shell-quoted string)")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".whl" / "tok"))
    ap.add_argument("--model-dir")
    ap.add_argument("--reuse-model", action="store_true", help="load the model in the model dir if it is there")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    systems = [s for s in args.systems.split(",") if s.strip()]
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    LOG = open(OUT / "gpu_batch.log", "a")

    import httpx
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.utils import load_tokenizer

    import peers

    R.update(command=shlex.join(["python", "bench/gpu_batch.py", *sys.argv[1:]]),
             date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
             git_rev=sh(f"git -C {ROOT} rev-parse --short HEAD 2>/dev/null") or "unknown",
             args=vars(args))
    R["facts"] = {"nvidia_smi": sh("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"),
                  "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "mlx_default_device": str(mx.default_device()),
                  "python": platform.python_version(), "cpus": os.cpu_count(), "meminfo_at_start": meminfo()}
    log(f"facts: {R['facts']}")
    tok_dir = Path(args.tokenizer_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        from models.loading.default import ensure_default_model

        tok_dir = Path(ensure_default_model(False))
    model_dir = model_place(args)
    if args.reuse_model and (model_dir / "config.json").is_file():
        model = mlx_lm.load(str(model_dir))[0]
        R["model"] = {"reused": str(model_dir)}
    else:
        model = gpu.build_model(model_dir, args.shape, args.dtype, tok_dir)
        R["model"] = gpu.R.get("model")
    eos = gpu.eos_ids(model_dir)
    bias = {str(e): -100 for e in eos}
    procs = None if args.raw_no_bias else make_logits_processors(logit_bias={e: -100.0 for e in eos})
    tokenizer = load_tokenizer(model_dir)
    words = word_pieces(tokenizer)
    rng = random.Random(1234)
    R.update(eos_ids=eos, levels={}, warmup_s={}, method={
        "tok_s": "all completion tokens / wall (first request sent -> last token); servers: streamed /v1/completions "
                 "from one thread per request, --stagger-ms apart; raw: BatchGenerator in this process",
        "ttft": "request sent (raw: insert) -> its first token chunk", "greedy": "temperature 0, EOS logit_bias -100"})
    save()

    workdir = Path(tempfile.mkdtemp(prefix="gpu-batch-"))  # servers' homes: outside OUT, which comes back whole
    servers: dict = {}
    try:
        if "ours" in systems:
            servers["ours"] = peers.Ours(workdir, model_dir, extra=(
                "--dtype", args.dtype, "--cache-bytes", args.cache_bytes, "--prefill-chunk", "2048",
                *shlex.split(args.ours_args)))
        if "ours_ssd" in systems:  # its own home and KV dir: the cost model it measures and saves is its own
            (workdir / "ssd").mkdir()
            servers["ours_ssd"] = peers.Ours(workdir / "ssd", model_dir, persistent=True, extra=(
                "--dtype", args.dtype, "--cache-bytes", args.cache_bytes, "--prefill-chunk", "2048",
                *shlex.split(args.ours_args)))
            R["ours_ssd_dir_fs"] = fs_type(str(workdir))
        if "mlx_lm" in systems:
            servers["mlx_lm"] = peers.MlxLm(workdir, model_dir, extra=(
                "--decode-concurrency", str(args.decode_concurrency), "--prompt-concurrency",
                str(args.prompt_concurrency), "--prefill-step-size", "2048"))
        for name, p in servers.items():
            t = time.perf_counter()
            p.start()
            R.setdefault("servers", {})[name] = {"args": list(p.extra), "start_s": round(time.perf_counter() - t, 1)}
            log(f"{name} up in {R['servers'][name]['start_s']}s: {' '.join(p.extra)}")

        def run(system: str, n_tok: int, texts: list[str], ids: list[list[int]]) -> dict:
            if system == "raw":
                return run_raw(model, ids, n_tok, procs, args.decode_concurrency, args.prompt_concurrency)
            before = lane_ticks(servers[system].url) if system.startswith("ours") else None
            m = run_served(servers[system].url, texts, n_tok, bias, args.stagger_ms / 1e3)
            if before is not None:  # where the lane's time went during this run (its /stats tick_seconds)
                after = lane_ticks(servers[system].url)
                m["lane_ticks"] = after[0] - before[0]
                m["lane_tick_s"] = {k: round(v - before[1].get(k, 0.0), 3) for k, v in after[1].items()}
            return m

        def prompts(n: int) -> tuple[list[str], list[list[int]]]:
            texts = [make_prompt(rng, words, tokenizer, args.prompt_tokens) for _ in range(n)]
            return texts, [tokenizer.encode(t) for t in texts]

        if not args.no_warmup:
            for system in systems:
                t = time.perf_counter()
                for n in levels:
                    run(system, min(8, args.max_tokens), *prompts(n))
                R["warmup_s"][system] = round(time.perf_counter() - t, 1)
                log(f"warm-up {system}: {R['warmup_s'][system]}s")
            save()

        single: dict = {s: [] for s in systems}
        lane_rates: list = []  # ours' own /stats lane.decode_tokens_per_s.last: no chunking in it
        for i in range(args.single_rounds):
            for system in (systems[i % len(systems):] + systems[:i % len(systems)]):
                texts, ids = prompts(1)
                if system == "raw":
                    rate = gpu.raw_run(model, ids[0], args.max_tokens, eos)["decode_tok_s"]
                else:
                    rate = stream_completion(servers[system].url, texts[0], args.max_tokens, bias)["decode_tok_s"]
                if system == "ours":
                    lane = httpx.get(servers["ours"].url + "/stats", timeout=60).json().get("lane") or {}
                    lane_rates.append((lane.get("decode_tokens_per_s") or {}).get("last"))
                single[system].append(rate)
                log(f"single-stream decode round {i + 1} {system}: {rate and round(rate, 1)} tok/s")
        R["single_stream"] = {"decode_tok_s": {s: summary(v) for s, v in single.items()},
                              "ours_lane_decode_tok_s": summary(lane_rates),
                              "method": "client side: (tokens - 1) / (last text chunk - first chunk); raw: "
                                        "generate_step per token (bench/gpu.py raw_run); alternated, order rotated"}
        raw_med = R["single_stream"]["decode_tok_s"].get("raw", {}).get("median")
        for s in ("ours", "ours_ssd", "mlx_lm"):
            med = R["single_stream"]["decode_tok_s"].get(s, {}).get("median")
            if med and raw_med:
                R["single_stream"][f"{s}_over_raw"] = round(med / raw_med, 3)
        save()

        last_round_s = 0.0
        for rnd in range(args.rounds):
            if rnd and time.monotonic() - T0 + last_round_s > args.time_budget_s:
                R.setdefault("notes", []).append(f"rounds {rnd + 1}-{args.rounds} skipped: --time-budget-s "
                                                 f"{args.time_budget_s:g} (a round took {last_round_s:.0f}s)")
                log(R["notes"][-1])
                break
            t_round = time.monotonic()
            for li, n in enumerate(levels):
                texts, ids = prompts(n)
                shift = (rnd + li) % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    try:
                        m = run(system, args.max_tokens, texts, ids)
                    except Exception as exc:  # recorded; the other systems still run
                        m = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                    m["round"] = rnd + 1
                    R["levels"].setdefault(str(n), {}).setdefault(system, {"rows": []})["rows"].append(m)
                    log(f"round {rnd + 1} N={n:<2} {system:8s} " + (m["error"] if "error" in m else
                        f"{m['tok_s']:8.1f} tok/s  mean TTFT {m['ttft_mean_s']:.3f}s  wall {m['wall_s']:.2f}s"
                        + (f"  errors {len(m['errors'])}" if m.get("errors") else "")))
                save()
            last_round_s = time.monotonic() - t_round
        finish(systems)
        if "ours" in servers:
            R["ours_lane_end"] = httpx.get(servers["ours"].url + "/stats", timeout=60).json().get("lane")
        if "ours_ssd" in servers:  # writes done, writes declined by the cost model, its measured rates
            R["ours_ssd_cache_end"] = httpx.get(servers["ours_ssd"].url + "/stats", timeout=60).json().get("ssd_cache")
    finally:
        for name, p in servers.items():
            rc = p.stop()
            R.setdefault("servers", {}).setdefault(name, {})["exit_code"] = rc
            text = p.proc.log() if name == "ours" and p.proc else (
                p.log_path.read_text(errors="replace") if getattr(p, "log_path", None) else "")
            with open(OUT / "gpu_batch_servers.log", "a") as f:
                f.write(f"\n===== {name} (exit {rc}) =====\n{text[-6000:]}")
        R["meminfo_at_end"] = meminfo()
        R["complete"] = "ratios" in R
        save()
    log("done: " + json.dumps(R.get("ratios")))
    return 0


def finish(systems: list[str]) -> None:
    """Per level and system: median (min-max) over rounds; ours / mlx_lm, ours / raw and ours_ssd / ours ratios of
    the medians."""
    ratios: dict = {}
    for n, per in R["levels"].items():
        for system, d in per.items():
            ok = [r for r in d["rows"] if "error" not in r]
            for key in ("tok_s", "ttft_mean_s", "wall_s"):
                d[key] = summary([r[key] for r in ok])
            d["errors"] = sum(len(r.get("errors") or []) + ("error" in r) for r in d["rows"])
        o = per.get("ours") or {}
        for peer in ("mlx_lm", "raw"):
            p = per.get(peer) or {}
            if o.get("tok_s", {}).get("median") and p.get("tok_s", {}).get("median"):
                ratios.setdefault(n, {})[peer] = {
                    "tok_s_ours_over_peer": round(o["tok_s"]["median"] / p["tok_s"]["median"], 3),
                    "ttft_mean_ours_over_peer": round(o["ttft_mean_s"]["median"] / p["ttft_mean_s"]["median"], 3)}
        q = per.get("ours_ssd") or {}
        if o.get("tok_s", {}).get("median") and q.get("tok_s", {}).get("median"):
            ratios.setdefault(n, {})["ours_ssd_over_ours"] = {
                "tok_s": round(q["tok_s"]["median"] / o["tok_s"]["median"], 3),
                "ttft_mean": round(q["ttft_mean_s"]["median"] / o["ttft_mean_s"]["median"], 3)}
    R["ratios"] = ratios


if __name__ == "__main__":
    sys.exit(main())
