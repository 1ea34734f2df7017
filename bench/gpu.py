"""GPU benchmark (issue 6, item 3): mlx-lane on a random-weight Llama-3-8B-shaped bf16 model.

Runs on the device machine (NVIDIA H200, MLX's CUDA build); `bench/gpu.sh` installs the carried wheels and calls
this. Everything happens in one process run, in this order:

  1. build the model on the spot (mlx_lm.models.llama, random normal weights * 0.02, bf16), save it as an mlx-lm
     directory (config.json + safetensors + the default model's tokenizer files) on tmpfs when there is room;
  2. server A (RAM tier only): served decode tok/s (HTTP streaming) vs raw mlx_lm generate_step in this process,
     alternated for --rounds rounds, same prompt length and token count, EOS suppressed on both sides;
     raw mlx_lm cold prefill (TTFT) for each --lengths in this process (same-run baseline for the served cold);
  3. server A: cold vs RAM-hit TTFT for each length (fresh random token-id prompt, then it + 1 token), alternated;
  4. SSD tier: server B writes each length's KV (POST /admin/cache/flush, timed) -> write GB/s; the page cache of
     the KV files is dropped; server C restarts on the same directory with the cost model on its priors (no
     prefill measured yet) and is sent prompt + 1 token -> what it chose, restore GB/s, restart TTFT; a second pass
     repeats it with this process's kernels warm (RAM cleared, page cache dropped again); server D restarts the same
     way but first serves two unrelated 4k-token prompts (its prefill rate is measured) -> what it chose, restart
     TTFT, and a warm second pass. Target: restart TTFT <= min(cold, restore);
  5. if time is left (--deadline), cold TTFT with the server's default --prefill-chunk (512).

Servers start through this file (`--serve-patched`) with workarounds for three server problems found on CUDA
(see serve_patched; --patches picks them, --no-patch starts `python -m server.cli serve` as is).

Results go to OUT/gpu.json (written after every phase), a log to OUT/gpu.log, server log tails to OUT/servers.log.

    bench/gpu.sh                                       # the H200 run (installs the carried wheels first)
    python bench/gpu.py --out /tmp/g --shape tiny --lengths 256,1024 --dtype float32   # logic check on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    # Llama-3-8B: 8.03e9 parameters, 16.1 GB in bf16; KV 131072 B/token in bf16 (32 layers x 8 heads x 128 x 2 x 2 B)
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=128256),
}
PROMPT_VOCAB = 49152
REQUEST_TIMEOUT = 120.0  # the SmolLM2 tokenizer's ids: prompts use ids in [3, 49152)
T0 = time.monotonic()
R: dict = {"script": "bench/gpu.py", "started_unix": int(time.time())}
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
    tmp = OUT / "gpu.json.tmp"
    tmp.write_text(json.dumps(R, indent=1))
    os.replace(tmp, OUT / "gpu.json")


def sh(cmd: str, timeout: float = 30) -> str:
    try:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except Exception as e:  # facts are best effort
        return f"error: {e}"


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def summary(xs) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None}
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "n": len(xs), "values": [round(x, 4) for x in xs]}


def fs_type(path: str) -> str:
    out = sh(f"findmnt -n -o FSTYPE -T {path}").splitlines()  # stacked mounts print one line each
    return out[-1].strip() if out else "unknown"


def free_gib(path: str) -> float:
    try:
        return shutil.disk_usage(path).free / (1 << 30)
    except OSError:
        return 0.0


def meminfo() -> dict:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable", "Cached", "Shmem"):
                out[k + "_gib"] = round(int(v.split()[0]) / (1 << 20), 1)
    except OSError:
        pass
    return out


# ------------------------------------------------------------------------------------------------- the model

def pick_dirs(args) -> tuple[Path, Path, bool]:
    """(model dir, KV dir, whether dropping the whole page cache is harmless to the model's weights)."""
    need = 20 if args.shape == "llama3-8b" else 1
    model_dir = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        for cand in ("/dev/shm",):
            if os.path.isdir(cand) and fs_type(cand) == "tmpfs" and free_gib(cand) >= need:
                model_dir = Path(cand) / "mlx-lane-bench-model"
                break
        if model_dir is None and os.geteuid() == 0 and sys.platform.startswith("linux"):
            mnt = Path("/mnt/mlx-lane-bench-tmpfs")
            mnt.mkdir(parents=True, exist_ok=True)
            r = sh(f"mount -t tmpfs -o size={need + 20}G tmpfs {mnt}")
            R.setdefault("notes", []).append(f"mounted a tmpfs for the model: {r or 'ok'}")
            if fs_type(str(mnt)) == "tmpfs":
                model_dir = mnt / "model"
        if model_dir is None:
            model_dir = ROOT / ".bench" / "gpu-model"
    kv_dir = None
    if args.kv_dir:
        kv_dir = Path(args.kv_dir)
    else:
        for cand in (str(ROOT / ".bench"), "/var/tmp", "/root", "/tmp"):
            Path(cand).mkdir(parents=True, exist_ok=True)
            if fs_type(cand) not in ("tmpfs", "ramfs") and free_gib(cand) >= (25 if need > 1 else 1):
                kv_dir = Path(cand) / "mlx-lane-gpu-kv"
                break
        if kv_dir is None:
            kv_dir = ROOT / ".bench" / "mlx-lane-gpu-kv"
            R.setdefault("notes", []).append("no disk-backed directory with 25 GiB free found for the KV files")
    shutil.rmtree(kv_dir, ignore_errors=True)
    kv_dir.mkdir(parents=True, exist_ok=True)
    model_on_tmpfs = fs_type(str(model_dir.parent if not model_dir.exists() else model_dir)) == "tmpfs"
    return model_dir, kv_dir, model_on_tmpfs


def build_model(model_dir: Path, shape: str, dtype: str, tok_dir: Path):
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import save_model

    s = SHAPES[shape]
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **s,
           "head_dim": s["hidden_size"] // s["num_attention_heads"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "max_position_embeddings": 131072, "tie_word_embeddings": False, "attention_bias": False,
           "mlp_bias": False, "hidden_act": "silu", "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2}
    t = time.perf_counter()
    model = Model(ModelArgs.from_dict(cfg))
    mx.random.seed(0)
    dt = getattr(mx, dtype)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 1:  # norms
            w = mx.ones(p.shape, dtype=dt)
        else:
            w = mx.random.normal(p.shape, dtype=dt, scale=0.02)
        mx.eval(w)
        params.append((name, w))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    n_params = sum(p.size for _, p in tree_flatten(model.parameters()))
    t_init = time.perf_counter() - t
    shutil.rmtree(model_dir, ignore_errors=True)
    t = time.perf_counter()
    save_model(model_dir, model)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tok_dir / f).is_file():
            shutil.copy(tok_dir / f, model_dir / f)
    t_save = time.perf_counter() - t
    nbytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    R["model"] = {"shape": shape, "config": cfg, "parameters": int(n_params), "safetensors_gb": round(nbytes / 1e9, 2),
                  "dir": str(model_dir), "dir_fs": fs_type(str(model_dir)), "init_s": round(t_init, 1),
                  "save_s": round(t_save, 1), "weights": "random normal * 0.02 (norms 1), seed 0"}
    log(f"model: {n_params / 1e9:.2f}e9 params, {nbytes / 1e9:.1f} GB in {model_dir} "
        f"(init {t_init:.1f}s, save {t_save:.1f}s)")
    return model


def eos_ids(model_dir: Path) -> list[int]:
    from mlx_lm.utils import load_tokenizer

    try:
        tok = load_tokenizer(model_dir)
        return sorted(int(e) for e in (tok.eos_token_ids or []))
    except Exception as e:  # only used to suppress EOS in the decode comparison
        log(f"could not load the tokenizer for EOS ids ({e}); assuming [2]")
        return [2]


# ------------------------------------------------------------------------------------------------ raw mlx-lm

def raw_run(model, prompt: list[int], max_tokens: int, eos: list[int]) -> dict:
    """mlx_lm generate_step (2048-token prefill steps, greedy): TTFT and decode tok/s (first to last token)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors

    procs = make_logits_processors(logit_bias={e: -100.0 for e in eos}) if eos else None
    cache = make_prompt_cache(model)
    stamps = []
    t0 = time.perf_counter()
    for _tok, _lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                   sampler=lambda x: mx.argmax(x, axis=-1), logits_processors=procs,
                                   prompt_cache=cache, prefill_step_size=2048):
        stamps.append(time.perf_counter())
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    del cache
    return {"ttft_s": stamps[0] - t0, "decode_tok_s": rate, "tokens": len(stamps)}


# ------------------------------------------------------------------------------------------------- served

# Workaround for a server bug seen on CUDA (bench run of 2026-11-29): with the SSD tier on, the durability writer
# thread enters `with mx.stream(<cpu stream>)` for its whole life before the lane starts, and MLX's default device
# is process-wide, so `Engine.bind_stream` (`mx.new_stream(mx.default_device())` on the lane thread) gets a CPU
# stream and the whole model runs on the CPU ("device cpu" in the start-up log line). The bench does not edit the
# server: it starts it through this file (`--serve-patched`), which makes bind_stream pick the GPU when there is
# one, and reports the same device in the start-up line and /stats. --no-patch runs the server unpatched.
PATCH = True


def _gpu_available() -> bool:
    import mlx.core as mx

    try:
        return bool(mx.is_available(mx.gpu))
    except Exception:
        return mx.default_device().type == mx.DeviceType.gpu


class _NoStreamSwitch:
    """`mlx.core` for the SSD-tier modules, except that `mx.stream(s)` does nothing. MLX's default stream is
    process-wide: the writer's life-long `with mx.stream(cpu)` and every prefetch/restore/demotion `with` flip the
    lane's default device to the CPU (at start, and mid-request when an I/O thread leaves its `with` after the lane
    entered its own). With this, those threads no longer touch the default: kvfile.load still reads on the explicit
    CPU stream it is given; writes run on the default (GPU) stream."""

    def __init__(self, mx):
        self._mx = mx

    def stream(self, s):
        import contextlib

        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(self._mx, name)


def serve_patched(argv: list[str]) -> int:
    import mlx.core as mx

    import models
    import server.engine

    patches = set(filter(None, os.environ.get("MLX_LANE_BENCH_PATCHES", "lane_stream").split(",")))
    if "lane_stream" in patches and _gpu_available():
        def bind_stream(self) -> None:
            self.stream = mx.new_stream(mx.gpu)

        server.engine.Engine.bind_stream = bind_stream
        models.device_name = lambda: "gpu"
    if "ssd_threads" in patches:
        import cache.durability
        import cache.ssd_store
        import cache.tiered

        for mod in (cache.durability, cache.ssd_store, cache.tiered):
            mod.mx = _NoStreamSwitch(mx)
    if "pending_bytes" in patches:
        import cache.durability

        dc = cache.durability.DurabilityCoordinator
        orig_init = dc.__init__
        budget = int(os.environ.get("MLX_LANE_BENCH_PENDING_BYTES", str(12 << 30)))

        def init(self, store, **kw):
            kw.setdefault("max_pending_bytes", budget)
            orig_init(self, store, **kw)

        dc.__init__ = init
    from server.cli import main as cli_main

    return cli_main(argv)


class PatchedServerProc:
    """Like tests.serverproc.ServerProc, but the server runs through `serve_patched` (see above)."""

    def __init__(self, *args: str, startup_timeout: float = 600.0):
        import tempfile

        from tests.serverproc import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="mlx-lane-", suffix=".log")[1])
        # no OpenBLAS re-exec: it would restart `-m server.cli` without the patch (BLAS is unused on the GPU)
        env = dict(os.environ, PYTHONUNBUFFERED="1", MLX_LANE_BLAS_REEXEC="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-patched", "serve", "--port", str(self.port),
               *args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError(f"server did not become ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]

    def kill(self) -> int:
        self.proc.kill()
        self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def stop(self, timeout: float = 60.0) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _plain_proc(*args: str):
    from tests.serverproc import ServerProc

    return ServerProc(*args, startup_timeout=600)


class Server:
    """One `python -m server.cli serve` (via tests.serverproc.ServerProc), with its start time and log."""

    def __init__(self, name: str, *args: str):
        self.name = name
        t = time.perf_counter()
        self.proc = PatchedServerProc(*args, startup_timeout=600) if PATCH else _plain_proc(*args)
        self.start_s = time.perf_counter() - t
        self.url = self.proc.url
        log(f"server {name} up in {self.start_s:.1f}s: {' '.join(args)}")
        R.setdefault("servers", {})[name] = {"args": list(args), "start_s": round(self.start_s, 1),
                                             "lane_stream_patch": PATCH}

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/stats", timeout=60).json()

    def post(self, path: str, timeout: float = 600):
        import httpx

        return httpx.post(self.url + path, timeout=timeout)

    def complete(self, prompt: list[int], max_tokens: int, *, logit_bias: dict | None = None) -> dict:
        """Streamed /v1/completions: TTFT (first chunk with choices), decode tok/s, usage."""
        import httpx

        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if logit_bias:
            body["logit_bias"] = logit_bias
        token_stamps, usage, finish = [], None, None
        t0 = time.perf_counter()
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
            if r.status_code != 200:
                raise RuntimeError(f"server {self.name}: HTTP {r.status_code}: {r.read()[:800]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("choices"):
                    ch = obj["choices"][0]
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
                        if not token_stamps:
                            token_stamps.append(time.perf_counter())
                    else:
                        token_stamps.append(time.perf_counter())
                if obj.get("usage"):
                    usage = obj["usage"]
        t_end = time.perf_counter()
        n = (usage or {}).get("completion_tokens", 0)
        rate = None
        if n > 1 and len(token_stamps) > 1 and token_stamps[-1] > token_stamps[0]:
            rate = (n - 1) / (token_stamps[-1] - token_stamps[0])
        cached = (((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"))
        return {"ttft_s": token_stamps[0] - t0 if token_stamps else None, "total_s": t_end - t0,
                "decode_tok_s": rate, "completion_tokens": n, "cached_tokens": cached, "finish_reason": finish}

    def stop(self, kill: bool = False) -> None:
        t = time.perf_counter()
        rc = self.proc.kill() if kill else self.proc.stop(timeout=300)
        R["servers"][self.name].update(stop="SIGKILL" if kill else "SIGTERM", rc=rc,
                                       stop_s=round(time.perf_counter() - t, 1))
        with open(OUT / "servers.log", "a") as f:
            f.write(f"\n===== server {self.name} (rc {rc}) =====\n")
            f.write(self.proc.log()[-6000:])
        log(f"server {self.name} stopped ({'SIGKILL' if kill else 'SIGTERM'}, rc {rc})")


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, PROMPT_VOCAB) for _ in range(n)]


def evict_kv(kv_dir: Path, drop_all: bool) -> dict:
    """Drop the KV files from the page cache: `echo 3 > drop_caches` when that spares the model's weights (tmpfs),
    and posix_fadvise(DONTNEED) on every KV file in any case."""
    out: dict = {}
    os.sync()
    if drop_all:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            out["drop_caches"] = "ok"
        except OSError as e:
            out["drop_caches"] = f"refused: {e}"
    n = 0
    for p in kv_dir.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    out["fadvise_dontneed_files"] = n
    if shutil.which("fincore"):
        out["fincore"] = sh(f"find {kv_dir} -type f -exec fincore -b {{}} +")[-1500:]
    return out


def ssd_block(st: dict) -> dict:
    s = st.get("ssd_cache") or {}
    keys = ("entries", "bytes", "writes", "dropped", "pending_bytes", "write_retries", "write_ms_last", "restores", "restore_ms_last", "restore_mb_s", "ssd_hits",
            "ssd_tokens_hit", "prefetches", "prefetch_skipped", "prefetch_coalesced", "restores_on_lane",
            "restores_failed", "failed", "pending", "errors", "cost_model")
    return {k: s.get(k) for k in keys if k in s}


# --------------------------------------------------------------------------------------------------- phases

def phase_decode(srv: Server, model, args, rng, eos) -> None:
    bias = {str(e): -100 for e in eos}
    log("decode: warm-up (served + raw)")
    for _ in range(2):
        srv.complete(rand_prompt(rng, args.decode_prompt), 128, logit_bias=bias)
        raw_run(model, rand_prompt(rng, args.decode_prompt), 128, eos)
    served, raw, server_side, rows = [], [], [], []
    for i in range(args.rounds):
        order = ("served", "raw") if i % 2 == 0 else ("raw", "served")
        for who in order:
            p = rand_prompt(rng, args.decode_prompt)
            if who == "served":
                r = srv.complete(p, args.decode_tokens, logit_bias=bias)
                served.append(r["decode_tok_s"])
                lane = srv.stats()["lane"]["decode_tokens_per_s"]["last"]
                server_side.append(lane)
                rows.append({"round": i, "who": who, **r, "lane_decode_tok_s": lane})
            else:
                r = raw_run(model, p, args.decode_tokens, eos)
                raw.append(r["decode_tok_s"])
                rows.append({"round": i, "who": who, **r})
            log(f"decode round {i} {who}: {r['decode_tok_s']:.1f} tok/s ({r.get('completion_tokens', r.get('tokens'))} tokens)")
    ratio = med(served) / med(raw) if med(served) and med(raw) else None
    ratios = [s / r for s, r in zip(served, raw) if s and r]
    R["decode"] = {"prompt_tokens": args.decode_prompt, "max_tokens": args.decode_tokens, "rounds": args.rounds,
                   "served_tok_s": summary(served), "raw_mlx_lm_tok_s": summary(raw),
                   "served_lane_tok_s": summary(server_side), "ratio_of_medians": round(ratio, 4) if ratio else None,
                   "per_round_ratio": summary(ratios), "target": 0.95, "rows": rows,
                   "method": "HTTP streaming /v1/completions vs mlx_lm generate_step in the bench process, greedy, "
                             "EOS logit_bias -100 on both sides, alternated (order flipped every round); "
                             "rate = (tokens - 1) / (last token time - first token time)"}
    log(f"decode: served {med(served)} vs raw {med(raw)} tok/s -> ratio {R['decode']['ratio_of_medians']}")
    save()


def phase_raw_prefill(model, args, rng) -> None:
    out = {}
    for L in args.lengths:
        raw_run(model, rand_prompt(rng, L), 1, [])  # warm-up (JIT for this shape)
        ts = [raw_run(model, rand_prompt(rng, L), 1, [])["ttft_s"] for _ in range(args.raw_reps)]
        out[str(L)] = summary(ts)
        log(f"raw mlx_lm cold TTFT {L}: {out[str(L)]['median']:.3f}s {ts}")
    R["raw_cold_ttft_s"] = out
    save()


def phase_ttft(srv: Server, args, rng) -> None:
    out = {}
    for L in args.lengths:
        log(f"ttft {L}: warm-up")
        p = rand_prompt(rng, L)
        srv.complete(p, 1)
        srv.complete(p + [rng.randrange(3, PROMPT_VOCAB)], 1)
        cold, hit, rows = [], [], []
        for i in range(args.ttft_reps):
            p = rand_prompt(rng, L)
            c = srv.complete(p, 1)
            h = srv.complete(p + [rng.randrange(3, PROMPT_VOCAB)], 1)
            cold.append(c["ttft_s"])
            hit.append(h["ttft_s"])
            rows.append({"cold": c, "ram_hit": h})
            log(f"ttft {L} rep {i}: cold {c['ttft_s']:.3f}s (cached {c['cached_tokens']}), "
                f"RAM hit {h['ttft_s']:.3f}s (cached {h['cached_tokens']})")
        srv.post("/admin/cache/clear")
        out[str(L)] = {"cold_s": summary(cold), "ram_hit_s": summary(hit), "rows": rows,
                       "cold_prefill_tok_s": round(L / med(cold), 1) if med(cold) else None}
        R["ttft"] = out
        save()


def phase_ssd(args, model_dir: Path, kv_dir: Path, drop_all: bool, rng) -> None:
    common = ["--model", str(model_dir), "--dtype", args.dtype, "--cache-bytes", args.cache_bytes,
              "--ssd-cache", str(kv_dir), "--ssd-cache-bytes", "24G", "--write-behind-debounce", "3600",
              "--demote-idle", "0", "--prefill-chunk", str(args.prefill_chunk)]
    S: dict = {"kv_dir": str(kv_dir), "kv_dir_fs": fs_type(str(kv_dir)), "lengths": {},
               "patches": os.environ.get("MLX_LANE_BENCH_PATCHES", "lane_stream")}
    R["ssd"] = S
    prompts = {L: rand_prompt(rng, L) for L in args.lengths}

    # B: write each length's KV, timed through the flush endpoint
    b = Server("B_write", *common)
    try:
        b.complete(rand_prompt(rng, min(4096, max(args.lengths))), 1)  # JIT warm-up
        b.post("/admin/cache/flush?timeout=300")
        for L in args.lengths:
            c = b.complete(prompts[L], 1)
            before = ssd_block(b.stats())
            t = time.perf_counter()
            r = b.post("/admin/cache/flush?timeout=300")
            dt = time.perf_counter() - t
            after = ssd_block(b.stats())
            nbytes = (after.get("bytes") or 0) - (before.get("bytes") or 0)
            wms = after.get("write_ms_last") or 0
            row = {"cold_ttft_s": c["ttft_s"], "flush_status": r.status_code, "flush_s": round(dt, 3),
                   "file_bytes": nbytes, "writes_delta": (after.get("writes") or 0) - (before.get("writes") or 0),
                   "write_ms_last": wms,
                   "write_gb_s_flush": round(nbytes / dt / 1e9, 3) if dt > 0 else None,
                   "write_gb_s_server": round(nbytes / (wms / 1e3) / 1e9, 3) if wms else None}
            S["lengths"].setdefault(str(L), {})["write"] = row
            log(f"ssd write {L}: {nbytes / 1e9:.2f} GB, flush {dt:.2f}s, server write {wms:.0f} ms "
                f"-> {row['write_gb_s_server']} GB/s")
        S["after_write"] = ssd_block(b.stats())
        save()
    finally:
        b.stop()

    # C: restart, cost model on its priors (nothing measured yet in this process)
    S["evict_before_C"] = evict_kv(kv_dir, drop_all)
    c_srv = Server("C_restart_priors", *common)
    try:
        c_srv.complete([5, 6, 7, 8, 9, 10, 11, 12], 2)  # generation path warm-up, too short to feed the cost model
        S["C_cost_model_at_start"] = ssd_block(c_srv.stats()).get("cost_model")
        for tag in ("restart_priors", "restart_priors_pass2"):
            if tag.endswith("pass2"):  # same files again, this process's kernels warm: RAM emptied, page cache dropped
                c_srv.post("/admin/cache/clear")
                S["evict_before_C_pass2"] = evict_kv(kv_dir, drop_all)
            for L in args.lengths:
                r = c_srv.complete(prompts[L] + [rng.randrange(3, PROMPT_VOCAB)], 1)
                st = ssd_block(c_srv.stats())
                S["lengths"][str(L)][tag] = {**r, "ssd_after": st}
                log(f"{tag} {L}: TTFT {r['ttft_s']:.3f}s cached {r['cached_tokens']} | restores "
                    f"{st.get('restores')} restore_ms_last {st.get('restore_ms_last')} {st.get('restore_mb_s')} MB/s"
                    f" | cost {st.get('cost_model')}")
            save()
    finally:
        c_srv.stop(kill=True)  # nothing new to write (debounce 3600): a kill keeps the directory as B left it

    # D: restart, two unrelated 4k prompts first so the cost model has measured this machine's prefill rate
    S["evict_before_D"] = evict_kv(kv_dir, drop_all)
    d = Server("D_restart_measured", *common)
    try:
        d.complete([5, 6, 7, 8, 9, 10, 11, 12], 2)
        for _ in range(2):
            d.complete(rand_prompt(rng, min(4096, max(args.lengths))), 1)
        S["D_cost_model_before"] = ssd_block(d.stats()).get("cost_model")
        for tag in ("restart_measured", "restart_measured_pass2"):
            if tag.endswith("pass2"):
                d.post("/admin/cache/clear")
                S["evict_before_D_pass2"] = evict_kv(kv_dir, drop_all)
            for L in args.lengths:
                r = d.complete(prompts[L] + [rng.randrange(3, PROMPT_VOCAB)], 1)
                st = ssd_block(d.stats())
                S["lengths"][str(L)][tag] = {**r, "ssd_after": st}
                log(f"{tag} {L}: TTFT {r['ttft_s']:.3f}s cached {r['cached_tokens']} | cost {st.get('cost_model')}")
            save()
    finally:
        d.stop(kill=True)


def phase_default_chunk(args, model_dir: Path, rng) -> None:
    """Cold TTFT with the server's default --prefill-chunk (512), RAM tier only: what plain flags give."""
    e = Server("E_default_chunk", "--model", str(model_dir), "--dtype", args.dtype, "--cache-bytes", args.cache_bytes,
               "--no-ssd-cache")
    out = {}
    try:
        for L in args.lengths:
            e.complete(rand_prompt(rng, L), 1)  # warm-up
            ts = [e.complete(rand_prompt(rng, L), 1)["ttft_s"] for _ in range(2)]
            out[str(L)] = summary(ts)
            log(f"default --prefill-chunk 512, cold {L}: {ts}")
            R["default_chunk_cold_ttft_s"] = out
            save()
    finally:
        e.stop(kill=True)


def guarded(name: str, fn, *a) -> None:
    """Run one phase; an exception is recorded (and the run goes on) instead of ending the run."""
    try:
        fn(*a)
    except Exception as e:
        import traceback

        R.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:3000]
        log(f"phase {name} FAILED: {type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc()
        save()


def verdicts() -> None:
    v = {}
    for L, row in (R.get("ssd") or {}).get("lengths", {}).items():
        cold = ((R.get("ttft") or {}).get(L) or {}).get("cold_s", {}).get("median")
        pri = (row.get("restart_priors") or {})
        restore_ttft = pri.get("ttft_s") if (pri.get("cached_tokens") or 0) > 0 else None
        mea = (row.get("restart_measured") or {}).get("ttft_s")
        best = min(x for x in (cold, restore_ttft) if x is not None) if (cold or restore_ttft) else None
        v[L] = {"cold_median_s": cold, "restore_ttft_s": restore_ttft,
                "restart_ttft_priors_s": pri.get("ttft_s"), "restart_ttft_measured_s": mea,
                "min_cold_restore_s": best,
                "measured_restart_within_10pct_of_min": (mea <= 1.1 * best) if (mea and best) else None,
                "priors_restart_within_10pct_of_min": (pri.get("ttft_s") <= 1.1 * best)
                if (pri.get("ttft_s") and best) else None}
    R["verdicts"] = v


def main() -> int:
    global OUT, LOG, PATCH
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--rounds", type=int, default=8, help="decode comparison rounds")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--raw-reps", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="server --prefill-chunk (2048 = mlx_lm's prefill step, as in the raw figures)")
    ap.add_argument("--cache-bytes", default="40G")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".whl" / "tok"))
    ap.add_argument("--model-dir")
    ap.add_argument("--kv-dir")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: decode,ttft,ssd,default_chunk")
    ap.add_argument("--deadline", type=float, default=420,
                    help="seconds after which the optional last phase (default --prefill-chunk) is skipped")
    ap.add_argument("--no-patch", action="store_true", help="start servers unpatched (see PATCH)")
    ap.add_argument("--patches", default="lane_stream,ssd_threads,pending_bytes",
                    help="server workarounds (see serve_patched): lane_stream, ssd_threads, pending_bytes")
    args = ap.parse_args()
    PATCH = not args.no_patch
    os.environ["MLX_LANE_BENCH_PATCHES"] = args.patches
    args.lengths = [int(x) for x in args.lengths.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    LOG = open(OUT / "gpu.log", "a")

    import mlx.core as mx
    import mlx_lm

    R["facts"] = {
        "nvidia_smi": sh("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"),
        "cuda_driver_version": sh("nvidia-smi | grep -o 'CUDA Version: [0-9.]*'"),
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "mlx_default_device": str(mx.default_device()),
        "python": platform.python_version(), "kernel": platform.release(), "cpus": os.cpu_count(),
        "meminfo_at_start": meminfo(), "git": sh(f"git -C {ROOT} rev-parse --short HEAD 2>/dev/null") or "unknown",
    }
    R["args"] = {k: v for k, v in vars(args).items()}
    log(f"facts: {R['facts']}")
    tok_dir = Path(args.tokenizer_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        from models.default import ensure_default_model

        tok_dir = Path(ensure_default_model(False))
    model_dir, kv_dir, drop_all = pick_dirs(args)
    R["dirs"] = {"model": str(model_dir), "kv": str(kv_dir), "kv_fs": fs_type(str(kv_dir)),
                 "kv_free_gib": round(free_gib(str(kv_dir)), 1), "drop_caches_spares_model": drop_all}
    save()
    rng = random.Random(1234)
    model = build_model(model_dir, args.shape, args.dtype, tok_dir)
    eos = eos_ids(model_dir)
    R["eos_ids"] = eos
    save()

    if not {"decode", "ttft"} <= skip:
        a = Server("A_ram", "--model", str(model_dir), "--dtype", args.dtype, "--cache-bytes", args.cache_bytes,
                   "--no-ssd-cache", "--prefill-chunk", str(args.prefill_chunk))
        try:
            if "decode" not in skip:
                guarded("decode", phase_decode, a, model, args, rng, eos)
            if "ttft" not in skip:
                guarded("raw_prefill", phase_raw_prefill, model, args, rng)
            del model
            mx.clear_cache()
            if "ttft" not in skip:
                guarded("ttft", phase_ttft, a, args, rng)
            R["A_stats_end"] = {k: a.stats().get(k) for k in ("lane", "prompt_cache", "device", "dtype")}
        finally:
            a.stop(kill=True)
    else:
        del model
        mx.clear_cache()
    save()
    if "ssd" not in skip:
        guarded("ssd", phase_ssd, args, model_dir, kv_dir, drop_all, rng)
    if "default_chunk" not in skip and time.monotonic() - T0 < args.deadline:
        guarded("default_chunk", phase_default_chunk, args, model_dir, rng)
    elif "default_chunk" not in skip:
        R.setdefault("notes", []).append("default-chunk phase skipped: past --deadline")
    verdicts()
    R["meminfo_at_end"] = meminfo()
    R["complete"] = True
    save()
    log("done: " + json.dumps(R.get("verdicts")))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-patched":
        sys.exit(serve_patched(sys.argv[2:]))
    sys.exit(main())
