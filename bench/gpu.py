"""GPU benchmark (issue 6, item 3): mlx-lane on a random-weight Llama-3-8B-shaped bf16 model.

Runs on the device machine (NVIDIA H200, MLX's CUDA build); `bench/gpu.sh` installs the carried wheels and calls
this. Servers are plain `python -m server.cli serve` processes (tests.serverproc.ServerProc) sharing one
MLX_LANE_HOME under OUT, so measured cache rates persist from server to server as across a user's restarts.
Phases (--phases), in this order:

  0. build the model on the spot (mlx_lm.models.llama, random normal weights * 0.02, bf16), save it as an mlx-lm
     directory (config.json + safetensors + the default model's tokenizer files) on tmpfs when there is room;
  decode: server A (RAM tier only): served decode tok/s (HTTP streaming) vs raw mlx_lm generate_step in this
     process, alternated for --rounds rounds, same prompt length and token count, EOS suppressed on both sides;
  ttft: raw mlx_lm cold prefill for each --lengths in this process, then server A: cold vs RAM-hit TTFT
     (fresh random token-id prompt, then it + 1 token);
  quant: `mlx-lane quantize`'s code path to 4-bit (group 64); raw decode bf16 vs 4-bit alternated; 4-bit served;
  ssd / ssd_kv8 (bf16 KV / --kv-bits 8): server B writes each length's KV (timed POST /admin/cache/flush) ->
     write GB/s, bytes per token; page cache dropped; server C restarts with --ssd-restore always -> restore
     TTFT and GB/s, fresh process and warm; server D restarts with --ssd-restore auto on the rates B and C
     persisted -> what the cost model chose on the first request after a restart. Target: restart TTFT <=
     min(cold, restore).

Results go to OUT/gpu.json (written after every phase), a log to OUT/gpu.log, server log tails to OUT/servers.log.

    bench/gpu.sh                                       # the H200 run (installs the carried wheels first)
    python bench/gpu.py --out /tmp/g --shape tiny --lengths 256,1024 --dtype float32 --decode-tokens 16 \
        --rounds 2 --quant-rounds 2                    # logic check on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
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
    # gpt-oss-20b's config (openai/gpt-oss-20b): 24 layers alternating 128-token sliding windows (with attention
    # sinks) and full attention, 32 experts (4 per token); 20.9e9 parameters, ~42 GB in bf16 (issue 35)
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, rope_theta=150000, rms_norm_eps=1e-5,
                        layer_types=["sliding_attention", "full_attention"] * 12, vocab_size=201088,
                        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "original_max_position_embeddings": 4096, "truncate": False}),
}
# Qwen3.5-9B's text config (Qwen/Qwen3.5-9B): 32 layers, 3 gated delta-net (linear attention) to 1 full attention,
# 8.95e9 parameters with its 248,320-token vocabulary (~18 GB bf16): the hybrid of issue 35's agents row
SHAPES["qwen3.5-9b"] = dict(model_type="qwen3_5", hidden_size=4096, num_hidden_layers=32, intermediate_size=12288,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_value_heads=32,
                            linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                            linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                            rope_parameters={"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 1e7,
                                             "partial_rotary_factor": 0.25}, vocab_size=248320)
SHAPES["qwen3.5-tiny"] = {**SHAPES["qwen3.5-9b"], "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                          "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
                          "linear_value_head_dim": 64}
# the same architecture at a size this CPU runs (logic checks, CPU comparisons of its batch path)
SHAPES["gpt-oss-tiny"] = {**SHAPES["gpt-oss-20b"], "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                          "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "num_local_experts": 8,
                          "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"] * 2}
# Nemotron-H-8B's shape (nvidia/Nemotron-H-8B-Base-8K): 52 layers, 24 Mamba-2 mixers, 4 attention layers, 24 MLPs
# (squared ReLU); 128 Mamba heads of 64 (a mixer's in_proj is 18,560 x 4,096: 2 x 8,192 + 2 x 8 groups x 128 state +
# 128 heads); ~8.1e9 parameters, ~16 GB in bf16. Not yet run on the device (its batched prefill: models.mamba_lengths)
SHAPES["nemotron-h-8b"] = dict(model_type="nemotron_h", hidden_size=4096, intermediate_size=21504,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, attention_bias=False,
                               mamba_num_heads=128, mamba_head_dim=64, mamba_proj_bias=False, ssm_state_size=128,
                               conv_kernel=4, n_groups=8, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                               use_conv_bias=True, rope_theta=10000.0, vocab_size=131072,
                               hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
SHAPES["nemotron-h-tiny"] = {**SHAPES["nemotron-h-8b"], "hidden_size": 256, "intermediate_size": 512,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 8,
                             "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2,
                             "hybrid_override_pattern": "M-M*-M-"}
# GLM-4.7-Flash (zai-org/GLM-4.7-Flash, mlx-lm's glm4_moe_lite defaults): DeepSeek's MLA (KV of 512 + 64 a token and
# layer) and MoE (64 routed experts, 4 a token, one shared; the first layer dense), 47 layers; ~31e9 parameters, ~62
# GB in bf16; its checkpoints ship one MTP layer past the last (num_nextn_predict_layers): issue 44's DeepSeek/GLM
# shape. Fits an H100 only with its vocabulary cut (mtp_fit.py --vocab) and little room beside it; an H200 holds it
SHAPES["glm4.7-flash"] = dict(model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048, intermediate_size=10240,
                              moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                              num_key_value_heads=20, n_shared_experts=1, n_routed_experts=64,
                              routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
                              qk_nope_head_dim=192, v_head_dim=256, topk_method="noaux_tc", scoring_func="sigmoid",
                              norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=4,
                              first_k_dense_replace=1, rms_norm_eps=1e-5, rope_theta=1e6,
                              partial_rotary_factor=1.0, num_nextn_predict_layers=0)
# GLM-4.7-Flash's layers at a depth that fits an 80 GB card in float32 (6.0e9 parameters with the vocabulary cut to
# 49,152: 24 GB), for bench/mtp_fit.py's DeepSeek-style head fitted on its own numbers (issue 44): the full 47 layers
# are ~120 GB in float32, and in bfloat16 a fit's text flips at near-ties. The head's share of a step is ~10% here
# (one MoE layer beside ten) against ~2% at full depth, so its speed-ups understate the real model's
SHAPES["glm4.7-flash-10l"] = {**SHAPES["glm4.7-flash"], "num_hidden_layers": 10}
SHAPES["glm4.7-flash-tiny"] = {**SHAPES["glm4.7-flash"], "hidden_size": 256, "intermediate_size": 512,
                               "moe_intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "n_routed_experts": 8, "kv_lora_rank": 64,
                               "q_lora_rank": 96, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}
# A GLM-4.7-Flash-style model 768 wide (2 layers, 8 experts): the narrowest where the head's fit at
# --fit-lr 3e-3 stalls on the CPU as glm4.7-flash-10l's did on the H100, and 1e-3 fits (BENCHMARKS.md, 2026-12-07)
SHAPES["glm4.7-flash-mid"] = {**SHAPES["glm4.7-flash"], "hidden_size": 768, "intermediate_size": 1536,
                              "moe_intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 8,
                              "num_key_value_heads": 8, "n_routed_experts": 8, "kv_lora_rank": 128,
                              "q_lora_rank": 192, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 96}
PROMPT_VOCAB = 49152
REQUEST_TIMEOUT = 120.0  # the SmolLM2 tokenizer's ids: prompts use ids in [3, 49152)
T0 = time.monotonic()
R: dict = {"script": "bench/gpu.py", "started_unix": int(time.time())}
OUT = Path(".")
HOME = Path(".")  # MLX_LANE_HOME shared by this run's servers (set in main)
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


def random_weights(module, dtype: str, seed: int = 0) -> None:
    """Give ``module`` the benchmarks' random weights: normal * 0.02, norms (1-D) 1, in ``dtype``, from ``seed``;
    each evaluated as it is made, so a 20B model never holds two copies."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(seed)
    dt = getattr(mx, dtype)
    params = []
    for name, p in tree_flatten(module.parameters()):
        w = mx.ones(p.shape, dtype=dt) if p.ndim == 1 else mx.random.normal(p.shape, dtype=dt, scale=0.02)
        mx.eval(w)
        params.append((name, w))
    module.update(tree_unflatten(params))
    mx.eval(module.parameters())


def shape_config(shape: str, dtype: str) -> dict:
    """The config.json of a random-weight ``shape``: its own architecture's where it names one (``model_type``), else
    a Llama's with these sizes."""
    s = SHAPES[shape]
    if "model_type" in s:  # another architecture, by its own config (mlx-lm's class for its model_type)
        return {**s, "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": dtype,
                "eos_token_id": 2}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **s,
            "head_dim": s["hidden_size"] // s["num_attention_heads"], "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "torch_dtype": dtype,
            "bos_token_id": 1, "eos_token_id": 2}


def build_model(model_dir: Path, shape: str, dtype: str, tok_dir: Path):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_model

    cfg = shape_config(shape, dtype)
    model_class, args_class = _get_classes(cfg)
    t = time.perf_counter()
    model = model_class(args_class.from_dict(cfg))
    random_weights(model, dtype)
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


def build_model_apart(model_dir: Path, shape: str, dtype: str, tok_dir: Path) -> dict:
    """``build_model`` in a process of its own; returns its ``R["model"]`` record. For scripts that only serve the
    model: built here, its arrays (and MLX's cache of their freed buffers, moved to managed memory by the save) stayed
    on the card in this process beside every server the script started. On an 80 GB H100 that was 17-39 GB
    (BENCHMARKS.md, 2026-12-06, eighth session): the servers ran out of device memory, ours and mlx_lm.server alike.
    ``SHAPES[shape]`` as this process has it (a cut vocabulary) goes with it."""
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import gpu; "
            "gpu.SHAPES[sys.argv[2]] = json.loads(sys.argv[3]); "
            "gpu.build_model(Path(sys.argv[4]), sys.argv[2], sys.argv[5], Path(sys.argv[6])); "
            "print('MODEL ' + json.dumps(gpu.R['model']), flush=True)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), shape,
                          json.dumps(SHAPES[shape]), str(model_dir), dtype, str(tok_dir)],
                         capture_output=True, text=True)
    sys.stderr.write(out.stderr)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("MODEL ")]
    for ln in out.stdout.splitlines():
        if not ln.startswith("MODEL "):
            print(ln, flush=True)
    if out.returncode != 0 or not lines:
        raise SystemExit(f"building the {shape} model failed (exit {out.returncode}); its output is above")
    R["model"] = json.loads(lines[-1][len("MODEL "):])
    return R["model"]


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

class Server:
    """One `python -m server.cli serve` (tests.serverproc.ServerProc, unpatched), with its start time and log.
    Every server of a run shares one MLX_LANE_HOME, so measured cache rates persist from one to the next exactly
    as they would across a user's restarts."""

    def __init__(self, name: str, *args: str):
        import httpx
        from tests.serverproc import ServerProc

        self.name = name
        t = time.perf_counter()
        self.proc = ServerProc(*args, env={"MLX_LANE_HOME": str(HOME), "MLX_LANE_EMBEDDING_MODEL": "none"},
                               startup_timeout=600)
        self.start_s = time.perf_counter() - t
        self.url = self.proc.url
        self.requests = 0  # completions sent (the first one meets a fresh process)
        # one client for every request of this server: a new httpx client per request builds an SSL context
        # (~28 ms on the 2-core dev CPU), which a TTFT would count as the server's
        t = time.perf_counter()
        self.client = httpx.Client(timeout=REQUEST_TIMEOUT)
        R.setdefault("client_construct_ms", round((time.perf_counter() - t) * 1000, 2))
        first = next((ln for ln in self.proc.log().splitlines() if "| device " in ln), "")
        log(f"server {name} up in {self.start_s:.1f}s: {' '.join(args)}\n    {first.strip()}")
        R.setdefault("servers", {})[name] = {"args": list(args), "start_s": round(self.start_s, 1),
                                             "startup_line": first.strip()[-300:],
                                             "startup": self.stats().get("startup")}  # server.startup's timeline

    def stats(self) -> dict:
        return self.client.get(self.url + "/stats", timeout=60).json()

    def post(self, path: str, timeout: float = 600):
        return self.client.post(self.url + path, timeout=timeout)

    def complete(self, prompt: list[int], max_tokens: int, *, logit_bias: dict | None = None) -> dict:
        """Streamed /v1/completions: TTFT (first chunk with choices), decode tok/s, usage."""
        self.requests += 1
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if logit_bias:
            body["logit_bias"] = logit_bias
        token_stamps, usage, finish = [], None, None
        t0 = time.perf_counter()
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
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
        self.client.close()
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


def raw_one_token(model, prompt: list[int], reps: int) -> list[float]:
    """Seconds of one one-token forward (logits evaluated) on a warm cache holding ``prompt``: what a RAM hit with
    one new token would cost if taking the cache and serving the request were free (issue 22 item 8's yardstick).
    Each rep trims the token it added, so every rep runs at ``len(prompt)`` tokens of context."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for i in range(0, len(prompt), 2048):
        model(mx.array(prompt[i:i + 2048])[None], cache=cache)
        mx.eval([c.state for c in cache])
    out = []
    for r in range(reps + 1):
        t = time.perf_counter()
        mx.eval(model(mx.array([[prompt[r % len(prompt)]]]), cache=cache))
        dt = time.perf_counter() - t
        for c in cache:
            c.trim(1)
        if r:  # the first one warms this shape up
            out.append(dt)
    del cache
    return out


def phase_raw_prefill(model, args, rng) -> None:
    out, step = {}, {}
    for L in args.lengths:
        raw_run(model, rand_prompt(rng, L), 1, [])  # warm-up (JIT for this shape)
        ts = [raw_run(model, rand_prompt(rng, L), 1, [])["ttft_s"] for _ in range(args.raw_reps)]
        out[str(L)] = summary(ts)
        log(f"raw mlx_lm cold TTFT {L}: {out[str(L)]['median']:.3f}s {ts}")
        one = raw_one_token(model, rand_prompt(rng, L), 5)
        step[str(L)] = summary(one)
        log(f"raw one-token forward at {L}: {step[str(L)]['median'] * 1000:.1f} ms {[round(x * 1000, 1) for x in one]}")
    R["raw_cold_ttft_s"] = out
    R["raw_one_token_s"] = step
    save()


def hit_split(before: dict, after: dict, client_ttft_s: float) -> dict:
    """Where one request's TTFT went, from /stats before and after it (nothing else running): the lane's own
    enqueued -> first token (``lane.ttft_s.last``) and its queue wait, the lane phases' seconds over the request
    (``tick_seconds`` deltas), and the rest of the client's TTFT: HTTP in and out, parsing, the event loop."""
    la, lb = after.get("lane") or {}, before.get("lane") or {}
    lane_ttft = (la.get("ttft_s") or {}).get("last")
    ticks = {k: round((v - (lb.get("tick_seconds") or {}).get(k, 0.0)) * 1000, 2)
             for k, v in (la.get("tick_seconds") or {}).items()}
    return {"client_ms": round(client_ttft_s * 1000, 2),
            "lane_ttft_ms": None if lane_ttft is None else round(lane_ttft * 1000, 2),
            "queue_wait_ms": None if (la.get("queue_wait_s") or {}).get("last") is None
            else round(la["queue_wait_s"]["last"] * 1000, 2),
            "outside_lane_ms": None if lane_ttft is None else round((client_ttft_s - lane_ttft) * 1000, 2),
            "tick_ms": {k: v for k, v in ticks.items() if v}}


def phase_ttft(srv: Server, args, rng) -> None:
    out = {}
    for L in args.lengths:
        log(f"ttft {L}: warm-up")
        p = rand_prompt(rng, L)
        fresh = srv.requests == 0
        w = srv.complete(p, 1)
        srv.complete(p + [rng.randrange(3, PROMPT_VOCAB)], 1)
        if fresh:  # issue 22 item 8: the first request in a fresh process vs the warm cold prefills below
            R["first_request"] = {"length": L, "ttft_s": w["ttft_s"]}
            log(f"first request of a fresh server ({L} tokens, cold): {w['ttft_s']:.3f}s")
        # the steady state: the warm-up behind the requests (server.lane.warm) finished, so that no hit below waits
        # for one of its steps (on the H200 a step compiles for up to ~12 s)
        t = time.perf_counter()
        while (srv.stats().get("lane") or {}).get("warm_up", {}).get("state") in ("pending", "running") \
                and time.perf_counter() - t < 180:
            time.sleep(0.5)
        R.setdefault("warm_up_waits_s", {})[str(L)] = round(time.perf_counter() - t, 2)
        cold, hit, hit_idle, rows = [], [], [], []
        for i in range(args.ttft_reps):
            p = rand_prompt(rng, L)
            c = srv.complete(p, 1)
            before = srv.stats()
            h = srv.complete(p + [rng.randrange(3, PROMPT_VOCAB)], 1)
            h["split"] = hit_split(before, srv.stats(), h["ttft_s"])
            # the same hit once the lane has been idle a moment (the first one follows the cold request's reply
            # at once, as a bench client does, and may meet that request's cache put still on the lane)
            time.sleep(0.5)
            before = srv.stats()
            hi = srv.complete(p + [rng.randrange(3, PROMPT_VOCAB)], 1)
            hi["split"] = hit_split(before, srv.stats(), hi["ttft_s"])
            cold.append(c["ttft_s"])
            hit.append(h["ttft_s"])
            hit_idle.append(hi["ttft_s"])
            rows.append({"cold": c, "ram_hit": h, "ram_hit_idle": hi})
            log(f"ttft {L} rep {i}: cold {c['ttft_s']:.3f}s (cached {c['cached_tokens']}), "
                f"RAM hit {h['ttft_s']:.3f}s (cached {h['cached_tokens']}) split {h['split']}; "
                f"after idle {hi['ttft_s']:.3f}s split {hi['split']}")
        srv.post("/admin/cache/clear")
        # a length this process has not seen yet: does a new shape cost more than a warm one (kernels per shape)?
        odd = srv.complete(rand_prompt(rng, L - 37), 1)
        log(f"ttft {L - 37} (a new length, cold): {odd['ttft_s']:.3f}s")
        if (R.get("first_request") or {}).get("length") == L and med(cold):
            R["first_request"]["over_warm_cold"] = round(R["first_request"]["ttft_s"] / med(cold), 3)
        out[str(L)] = {"cold_s": summary(cold), "ram_hit_s": summary(hit),
                       "ram_hit_after_idle_s": summary(hit_idle), "rows": rows,
                       "cold_new_length": {"length": L - 37, "ttft_s": odd["ttft_s"]},
                       "cold_prefill_tok_s": round(L / med(cold), 1) if med(cold) else None}
        R["ttft"] = out
        save()


def phase_ssd(args, model_dir: Path, kv_root: Path, drop_all: bool, rng, kv_bits: int | None = None) -> None:
    """SSD tier for one KV scheme (bf16 KV, or --kv-bits 8): write, restart + forced restore, restart + auto.

    B writes each length's KV (timed flush; B's own cold TTFT recorded). C restarts with `--ssd-restore always`:
    restore TTFT with the page cache dropped, fresh process and again warm. D restarts with `--ssd-restore auto`
    on the rates B and C measured (persisted in MLX_LANE_HOME/rates at their SIGTERM, as for a user): what the
    cost model chose on the first request after a restart, and its TTFT."""
    tag = "bf16_kv" if kv_bits is None else f"kv{kv_bits}"
    kv_dir = kv_root / tag
    shutil.rmtree(kv_dir, ignore_errors=True)
    kv_dir.mkdir(parents=True)
    common = ["--model", str(model_dir), "--dtype", args.dtype, "--cache-bytes", args.cache_bytes,
              "--ssd-cache", str(kv_dir), "--ssd-cache-bytes", "40G", "--write-behind-debounce", "3600",
              "--demote-idle", "0", "--prefill-chunk", str(args.prefill_chunk)]
    if kv_bits:
        common += ["--kv-bits", str(kv_bits)]
    S: dict = {"kv_dir": str(kv_dir), "kv_dir_fs": fs_type(str(kv_dir)), "kv_bits": kv_bits, "lengths": {}}
    R.setdefault("ssd", {})[tag] = S
    prompts = {L: rand_prompt(rng, L) for L in args.lengths}

    b = Server(f"B_write_{tag}", *common)
    try:
        b.complete(rand_prompt(rng, min(4096, max(args.lengths))), 1)  # JIT warm-up
        b.complete(rand_prompt(rng, min(4096, max(args.lengths))), 1)
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
                   "file_bytes": nbytes, "bytes_per_token": round(nbytes / L) if nbytes else None,
                   "writes_delta": (after.get("writes") or 0) - (before.get("writes") or 0),
                   "write_ms_last": wms,
                   "write_gb_s_flush": round(nbytes / dt / 1e9, 3) if dt > 0 else None,
                   "write_gb_s_server": round(nbytes / (wms / 1e3) / 1e9, 3) if wms else None}
            S["lengths"].setdefault(str(L), {})["write"] = row
            log(f"[{tag}] cold {L}: {c['ttft_s']:.3f}s; ssd write {nbytes / 1e9:.2f} GB, flush {dt:.2f}s "
                f"(HTTP {r.status_code}), server write {wms:.0f} ms -> {row['write_gb_s_server']} GB/s")
        S["after_write"] = ssd_block(b.stats())
        S["kv_cache_stats"] = b.stats().get("kv_cache")
        save()
    finally:
        b.stop()  # SIGTERM: persists the measured prefill rate; exit status recorded (0 expected)

    S["evict_before_C"] = evict_kv(kv_dir, drop_all)
    c_srv = Server(f"C_restore_{tag}", *common, "--ssd-restore", "always")
    try:
        c_srv.complete([5, 6, 7, 8, 9, 10, 11, 12], 2)  # generation path warm-up, too short to feed the cost model
        for rtag in ("restore_fresh", "restore_warm"):
            if rtag == "restore_warm":  # same files again, kernels warm: RAM emptied, page cache dropped again
                c_srv.post("/admin/cache/clear")
                S["evict_before_C_warm"] = evict_kv(kv_dir, drop_all)
            for L in args.lengths:
                r = c_srv.complete(prompts[L] + [rng.randrange(3, PROMPT_VOCAB)], 1)
                st = ssd_block(c_srv.stats())
                S["lengths"][str(L)][rtag] = {**r, "restore_ms_last": st.get("restore_ms_last"),
                                              "restore_mb_s": st.get("restore_mb_s"), "ssd_after": st}
                log(f"[{tag}] {rtag} {L}: TTFT {r['ttft_s']:.3f}s cached {r['cached_tokens']} | restore "
                    f"{st.get('restore_ms_last')} ms, {st.get('restore_mb_s')} MB/s")
            save()
    finally:
        c_srv.stop()  # SIGTERM: persists the measured read rate

    S["evict_before_D"] = evict_kv(kv_dir, drop_all)
    d = Server(f"D_auto_{tag}", *common)
    try:
        S["D_cost_model_at_start"] = ssd_block(d.stats()).get("cost_model")
        d.complete([5, 6, 7, 8, 9, 10, 11, 12], 2)
        for L in args.lengths:
            before = ssd_block(d.stats()).get("cost_model") or {}
            r = d.complete(prompts[L] + [rng.randrange(3, PROMPT_VOCAB)], 1)
            cm = ssd_block(d.stats()).get("cost_model") or {}
            chose = ("restore" if cm.get("decisions_restore", 0) > before.get("decisions_restore", 0)
                     else "recompute")
            S["lengths"][str(L)]["auto_fresh"] = {**r, "chose": chose, "cost_model": cm}
            log(f"[{tag}] auto (fresh restart) {L}: chose {chose}, TTFT {r['ttft_s']:.3f}s cached "
                f"{r['cached_tokens']} | cost {cm}")
        save()
    finally:
        d.stop(kill=True)


def phase_kv_files(args, kv_root: Path, drop_all: bool) -> None:
    """SSD restore of the KV of an 8B-shaped model, bf16 vs 8-bit (q8, group 64), at the file level: the cache
    classes the server stores (mlx-lm KVCache / QuantizedKVCache, 32 layers x 8 KV heads x 128), written with
    cache.kvfile.save (fsync), page cache dropped, read back with cache.kvfile.load as a restore does (on a CPU
    stream). Measured here because the server cannot serve --kv-bits on this device (see the startup probe in
    server/engine/engine.py): no request-level TTFT, but the read that a restore TTFT consists of."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from cache import kvfile

    out: dict = {}
    R["kv_files"] = out
    d = kv_root / "kvfiles"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cpu = mx.new_stream(mx.cpu)
    for L in args.lengths:
        for scheme in ("bf16", "q8g64"):
            caches = []
            for _ in range(32):
                k = mx.random.normal((1, 8, L, 128), dtype=mx.bfloat16)
                v = mx.random.normal((1, 8, L, 128), dtype=mx.bfloat16)
                c = KVCache() if scheme == "bf16" else QuantizedKVCache(group_size=64, bits=8)
                c.update_and_fetch(k, v)
                mx.eval(c.state)
                caches.append(c)
            path = d / f"{scheme}-{L}.safetensors"
            t = time.perf_counter()
            nbytes = kvfile.save(path, list(range(L)), caches, fingerprint="f" * 64, ns="bench")
            write_s = time.perf_counter() - t
            del caches
            mx.clear_cache()
            reads = []
            for _ in range(2):
                evict_kv(d, drop_all)
                t = time.perf_counter()
                kvfile.load(path, stream=cpu)
                reads.append(time.perf_counter() - t)
            row = {"file_bytes": nbytes, "bytes_per_token": round(nbytes / L), "write_s": round(write_s, 3),
                   "write_gb_s": round(nbytes / write_s / 1e9, 3), "read_s": summary(reads),
                   "read_gb_s": round(nbytes / med(reads) / 1e9, 3)}
            out.setdefault(str(L), {})[scheme] = row
            log(f"kv file {scheme} {L}: {nbytes / 1e9:.2f} GB ({row['bytes_per_token']} B/token), write "
                f"{write_s:.2f}s, read (page cache dropped) {reads}")
            path.unlink()
            save()


def phase_quant_weights(args, model_dir: Path, rng, eos) -> None:
    """Decode tok/s of bf16 vs 4-bit weights (`mlx-lane quantize`'s code path, group 64), raw mlx_lm in this
    process, alternated; then the 4-bit model served (HTTP streaming) for the same prompts."""
    import mlx.core as mx
    from mlx_lm import load

    from models.quant.quantize import QuantSpec, quantize_dir

    qdir = model_dir.parent / (model_dir.name + "-4bit")
    shutil.rmtree(qdir, ignore_errors=True)
    t = time.perf_counter()
    res = quantize_dir(str(model_dir), qdir, QuantSpec(bits=4, group_size=64))
    Q: dict = {"quantize_s": round(time.perf_counter() - t, 1), "bits_per_weight": round(res.bits_per_weight, 3),
               "safetensors_gb": round(sum(f.stat().st_size for f in qdir.glob("*.safetensors")) / 1e9, 2)}
    R["quant_weights"] = Q
    log(f"quantized to 4-bit in {Q['quantize_s']}s: {Q['bits_per_weight']} bpw, {Q['safetensors_gb']} GB")
    models = {"bf16": load(str(model_dir))[0], "q4": load(str(qdir))[0]}
    for m in models.values():
        raw_run(m, rand_prompt(rng, args.decode_prompt), 64, eos)  # JIT warm-up
    rates: dict = {"bf16": [], "q4": []}
    for i in range(args.quant_rounds):
        for who in (("bf16", "q4") if i % 2 == 0 else ("q4", "bf16")):
            r = raw_run(models[who], rand_prompt(rng, args.decode_prompt), args.decode_tokens, eos)
            rates[who].append(r["decode_tok_s"])
            log(f"quant decode round {i} {who}: {r['decode_tok_s']:.1f} tok/s")
    Q["raw_decode_tok_s"] = {k: summary(v) for k, v in rates.items()}
    Q["q4_over_bf16"] = round(med(rates["q4"]) / med(rates["bf16"]), 3)
    save()
    del models
    mx.clear_cache()
    srv = Server("E_q4_served", "--model", str(qdir), "--cache-bytes", "8G", "--no-ssd-cache")
    try:
        bias = {str(e): -100 for e in eos}
        srv.complete(rand_prompt(rng, args.decode_prompt), 64, logit_bias=bias)
        served = [srv.complete(rand_prompt(rng, args.decode_prompt), args.decode_tokens, logit_bias=bias)["decode_tok_s"]
                  for _ in range(max(2, args.quant_rounds // 2))]
        Q["served_q4_decode_tok_s"] = summary(served)
        log(f"served 4-bit decode: {served}")
        save()
    finally:
        srv.stop(kill=True)


def phase_restart(args, model_dir: Path, rng) -> None:
    """Issue 37: a server started twice on one MLX_LANE_HOME (the second start finds the kernels the first one
    compiled, under $MLX_LANE_HOME/ptx) with each one's first request (a cold prompt of the first --lengths)."""
    out = {}
    prompt = rand_prompt(rng, args.lengths[0])
    for name in ("R_first_start", "R_restart"):
        srv = Server(name, "--model", str(model_dir), "--dtype", args.dtype, "--cache-bytes", args.cache_bytes,
                     "--no-ssd-cache", "--prefill-chunk", str(args.prefill_chunk))
        try:
            first = srv.complete(prompt, 1)
            out[name] = {"ready_s": round(srv.start_s, 2), "first_request_ttft_s": round(first["ttft_s"], 3),
                         "startup": R["servers"][name].get("startup")}
            log(f"{name}: ready {srv.start_s:.1f}s, first request ({len(prompt)} tokens, cold) "
                f"{first['ttft_s']:.3f}s")
        finally:
            srv.stop(kill=True)
    R["restart"] = out
    save()


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
    """Per KV scheme and length: cold (recompute) vs forced restore vs what auto chose on a fresh restart."""
    v = {}
    for tag, S in (R.get("ssd") or {}).items():
        for L, row in S.get("lengths", {}).items():
            cold = ((R.get("ttft") or {}).get(L) or {}).get("cold_s", {}).get("median") if tag == "bf16_kv" else None
            cold = cold or (row.get("write") or {}).get("cold_ttft_s")  # B's own cold prefill of that prompt
            fresh = (row.get("restore_fresh") or {}).get("ttft_s")
            warm = (row.get("restore_warm") or {}).get("ttft_s")
            auto = row.get("auto_fresh") or {}
            best = min(x for x in (cold, fresh) if x is not None) if (cold or fresh) else None
            v[f"{tag}/{L}"] = {"cold_s": cold, "restore_fresh_s": fresh, "restore_warm_s": warm,
                               "auto_chose": auto.get("chose"), "auto_ttft_s": auto.get("ttft_s"),
                               "restore_beats_recompute": (fresh < cold) if (fresh and cold) else None,
                               "auto_within_10pct_of_min_cold_restore": (auto["ttft_s"] <= 1.1 * best)
                               if (auto.get("ttft_s") and best) else None}
    R["verdicts"] = v


def main() -> int:
    global OUT, LOG, HOME
    from models.runtime import ensure_blas

    ensure_blas(sys.argv)  # as the servers do: on a CPU the in-process raw mlx-lm runs need OpenBLAS too
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--rounds", type=int, default=8, help="decode comparison rounds")
    ap.add_argument("--quant-rounds", type=int, default=6, help="bf16 vs 4-bit decode rounds")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--raw-reps", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="server --prefill-chunk (2048: the server's GPU default and mlx_lm's prefill step)")
    ap.add_argument("--cache-bytes", default="40G")
    ap.add_argument("--tokenizer-dir", default=str(ROOT / ".whl" / "tok"))
    ap.add_argument("--model-dir")
    ap.add_argument("--kv-dir")
    ap.add_argument("--reuse-model", action="store_true",
                    help="use the model already in --model-dir / the default place when its config.json exists")
    ap.add_argument("--server-args", default="",
                    help="more flags for the decode / ttft phases' server A, one string after '=' (e.g. "
                         "--server-args=--debug-copy-hits: a RAM hit that copies its prefix, to compare with one read "
                         "in place)")
    ap.add_argument("--phases", default="decode,ttft,quant,ssd,ssd_kv8,kv_files",
                    help="comma list, in this order: decode, ttft, quant (4-bit weights), ssd (bf16 KV), "
                         "ssd_kv8 (8-bit KV through the server), kv_files (bf16 vs 8-bit KV file write/read); "
                         "startup (mlx_lm.load of the same weights), restart (a server started twice: "
                         "compiled kernels kept)")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    phases = set(filter(None, args.phases.split(",")))
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    LOG = open(OUT / "gpu.log", "a")
    HOME = OUT / "mlx-lane-home"
    shutil.rmtree(HOME, ignore_errors=True)
    HOME.mkdir(parents=True)

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
        from models.loading.default import ensure_default_model

        tok_dir = Path(ensure_default_model(False))
    model_dir, kv_dir, drop_all = pick_dirs(args)
    R["dirs"] = {"model": str(model_dir), "kv": str(kv_dir), "kv_fs": fs_type(str(kv_dir)),
                 "kv_free_gib": round(free_gib(str(kv_dir)), 1), "drop_caches_spares_model": drop_all}
    save()
    rng = random.Random(1234)
    if args.reuse_model and (model_dir / "config.json").is_file():
        from mlx_lm import load

        model = load(str(model_dir))[0]
        R.setdefault("notes", []).append(f"reused the model already in {model_dir}")
    else:
        model = build_model(model_dir, args.shape, args.dtype, tok_dir)
    eos = eos_ids(model_dir)
    R["eos_ids"] = eos
    if "startup" in phases:  # issue 37: what mlx-lm needs to load the same model (weights in memory, evaluated)
        del model
        mx.clear_cache()
        t = time.perf_counter()
        model = mlx_lm.load(str(model_dir))[0]
        mx.eval(model.parameters())
        R["mlx_lm_load_s"] = round(time.perf_counter() - t, 2)
        log(f"mlx_lm.load + eval of the weights: {R['mlx_lm_load_s']:.2f}s")
    save()
    if "restart" in phases:
        del model
        mx.clear_cache()
        guarded("restart", phase_restart, args, model_dir, rng)
        model = mlx_lm.load(str(model_dir))[0] if phases & {"decode", "ttft"} else None

    if phases & {"decode", "ttft"}:
        R["server_args"] = args.server_args
        # without the decode phase, the raw forwards run before server A starts: its first request then comes right
        # after ready, as a fresh process's first request does, not while its warm-up runs behind (server.lane.warm)
        raw_first = "ttft" in phases and "decode" not in phases
        if raw_first:
            guarded("raw_prefill", phase_raw_prefill, model, args, rng)
            del model
            mx.clear_cache()
        a = Server("A_ram", "--model", str(model_dir), "--dtype", args.dtype, "--cache-bytes", args.cache_bytes,
                   "--no-ssd-cache", "--prefill-chunk", str(args.prefill_chunk), *shlex.split(args.server_args))
        try:
            if "decode" in phases:
                guarded("decode", phase_decode, a, model, args, rng, eos)
            if not raw_first:
                if "ttft" in phases:
                    guarded("raw_prefill", phase_raw_prefill, model, args, rng)
                del model
                mx.clear_cache()
            if "ttft" in phases:
                guarded("ttft", phase_ttft, a, args, rng)
            R["A_stats_end"] = {k: a.stats().get(k) for k in ("lane", "prompt_cache", "device", "dtype")}
        finally:
            a.stop(kill=True)
    else:
        del model
        mx.clear_cache()
    save()
    if "quant" in phases:
        guarded("quant", phase_quant_weights, args, model_dir, rng, eos)
    if "ssd" in phases:
        guarded("ssd", phase_ssd, args, model_dir, kv_dir, drop_all, rng)
    if "ssd_kv8" in phases:
        guarded("ssd_kv8", phase_ssd, args, model_dir, kv_dir, drop_all, rng, 8)
    if "kv_files" in phases:
        guarded("kv_files", phase_kv_files, args, kv_dir, drop_all)
    verdicts()
    R["meminfo_at_end"] = meminfo()
    R["complete"] = True
    save()
    log("done: " + json.dumps(R.get("verdicts")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
