"""The agent workload on the H200 (issue 22): K coding agents at once x T turns, mlx-lane at its defaults (SSD tier
on) vs mlx_lm.server with a prompt cache big enough for every agent.

Runs on the device machine: `bash bench/gpu.sh bench/gpu_agents.py [flags]` installs the carried wheels first. The
model is a random-weight Llama-3-8B shape in bf16 built on the spot (bench/gpu.py's build_model) with the vocabulary
cut to SmolLM2's tokenizer (`--vocab 49152`: 7.5e9 parameters instead of 8.0e9), so that every generated token
is a token the tokenizer can write out and read back: the replies travel back into the next turn as text, exactly
as an agent's do (random weights, so the text is noise, the same noise for both servers only where they agree).

Every conversation = a shared system prompt of ~--system-tokens tokens (agent_workload.SYSTEM_PROMPT plus
deterministic repository notes) + its own task and a first tool output of ~--first-tokens tokens; every later turn
adds a tool output of --chunk-min..--chunk-max tokens; --max-tokens tokens per reply, greedy, streamed. The agents
are bench/concurrent_agents.py's threads (each turn right after its previous reply, the first requests --stagger-ms
apart). For each --plan entry KxT, each server is started fresh, answers one warm-up request, runs the workload and
stops; servers one after the other, their order rotated per round and entry.

  ours    `mlx-lane serve --model DIR` at its defaults: SSD tier on (a folder of the run), RAM tier sized from the
          GPU's memory, prefill chunk and batch from the device
  mlx_lm  `mlx_lm.server --decode-concurrency 32 --prompt-concurrency 8 --prompt-cache-size 64
          --prompt-cache-bytes 60000000000` (the fair peer: its LRU of prompt caches holds every agent)
  ours_mlx_attention, ours_ragged, ours_mlx_layout, ours_unroll1, ours_mlx_kernels, ours_no_ssd
          `ours` with mlx-lm's masked attention instead of models.attention.gpu's kernel (`--attention mlx`), with
          a batch layout forced (`--batch-layout ragged|mlx`), with the kernel's first form
          (`--debug-gpu-attention-unroll 1`), with mlx-lm's gated delta rule (`--kernels mlx`), or without the SSD
          tier (`--no-ssd-cache`): A/B runs of one change (OURS_VARIANTS)
  ours_alone_after_hits
          `ours` with `--prefill-together-max 0`: a chunk past a long cache hit prefills in a forward of its own
          (the rule before 2026-12-05; hybrids gather anyway)
  ours_no_cudnn_sdpa
          `ours` with MLX_CUDA_USE_CUDNN_SDPA=0: prefill attention in MLX's unfused ops instead of a cuDNN graph built
          per new (query, key) shape
  ours_no_cuda_graphs
          `ours` with MLX_USE_CUDA_GRAPHS=0: MLX launches its kernels one by one instead of in CUDA graphs (whose
          own memory is outside MLX's counters and its memory pool)
  ours_no_composed
          `ours` with `--debug-gpu-attention-composed-max 0`: chunks past a cache hit and verify steps attend through
          cuDNN (the rule before 2026-12-05) instead of models.attention.composed's plain ops
  ours_moe_sort8, ours_moe_sort_mlx, ours_moe_dense16
          `ours` with `--debug-moe-sort-min 8` / `64`: a mixture-of-experts layer sorts its (token, expert) pairs by
          expert from 8 pairs on (each expert's weights read once a step) / from 64 (mlx-lm's rule); with
          `--debug-moe-dense-max 16`: a call of up to 16 tokens computes every expert for every token, no gather
  ours_ssd_host_copies
          `ours` with `--debug-ssd-host-copies`: the SSD writer reads copies made on the device, not the RAM tier's
          own arrays (which mlx 0.32 moves to managed memory at the host's first read)
  ours_ssd_idle
          `ours` with `--ssd-write-when idle`: entries reach the disk only while no request is queued or running
          (the default since 2026-12-06: then the same as `ours`)
  ours_ssd_always
          `ours` with `--ssd-write-when always`: entries reach the disk as soon as they are due (the default before)

`--prime-peer` starts mlx_lm.server once before the measured runs for an unmeasured 4 x 2 workload of other
conversations: MLX compiles its CUDA kernels at first use into a folder that outlives the process, so the measured
peer starts with them compiled, as ours does after its warm-up (which the run waits for). Without it, whether the
peer pays its compiles in the workload depends on what ran on the machine before (`kernel_cache_files_at_start`).

Measured per server and entry: wall (first request sent -> last reply done), mean / p95 TTFT, generated tok/s,
cached prompt tokens (usage.prompt_tokens_details.cached_tokens; mlx_lm.server reports it too), and for ours the
/stats lane, prompt_cache and ssd_cache blocks after the run. Issue 22's target: ours' wall <= 0.4x mlx_lm.server's.

Writes OUT/gpu_agents.json after every run (copy it to bench/results/).

    bash bench/gpu.sh bench/gpu_agents.py                       # 16x4 and 32x3, one round (~8 min of device time)
    python bench/gpu_agents.py --out /tmp/ga --shape tiny --dtype float32 --model-dir /tmp/ga/m --plan 2x2 \\
        --tokenizer-dir ~/.cache/mlx-lane/models/SmolLM2-135M-Instruct --system-tokens 300 --first-tokens 100 \\
        --chunk-min 20 --chunk-max 40 --max-tokens 8                     # logic check on a CPU (~10 s)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu  # noqa: E402  (build_model, SHAPES, machine facts)
import gpu_kernel_times as gkt  # noqa: E402  (ncu: --ncu-ours)
import peers as peer_servers  # noqa: E402
from agent_workload import SYSTEM_PROMPT, TASKS, stream_chat, tool_chunk  # noqa: E402
from concurrent_agents import PROBE, lane_block, probe_metrics, run_agents, run_metrics  # noqa: E402

TARGET_WALL = 0.4  # issues 22, 43: ours / mlx_lm.server wall on this workload (16 x 4, llama3-8b, gpt-oss-20b)


def target_wall(shape: str, turns: int) -> float:
    """Issue 43's target for ours / mlx_lm.server's wall: 16 cold prompts at once (one turn) <= 0.9 on every shape;
    the agents' turns <= 0.45 on a Qwen3.5 hybrid, <= 0.40 elsewhere."""
    if turns == 1:
        return 0.9
    return 0.45 if shape.startswith("qwen3.5") else TARGET_WALL
# mlx-lane at its defaults, and variants of it to compare with (each is started as `ours` is, plus these)
OURS_VARIANTS = {
    "ours": ((), {}),
    # the defaults again in a home and SSD folder of their own (a second "ours" would reuse the first's folder: its
    # kernels and SSD entries): the machine's drift within a call, e.g. --servers ours,VARIANT,ours_again
    "ours_again": ((), {}),
    "ours_mlx_attention": (("--attention", "mlx"), {}),  # MLX's masked attention, not models.attention.gpu's
    "ours_ragged": (("--batch-layout", "ragged"), {}),
    "ours_mlx_layout": (("--batch-layout", "mlx"), {}),
    "ours_unroll1": (("--debug-gpu-attention-unroll", "1"), {}),  # the kernel's first form (one key group a round)
    "ours_mlx_kernels": (("--kernels", "mlx"), {}),  # mlx-lm's gated delta rule / Mamba-2 step, not models.kernels
    "ours_no_ssd": (("--no-ssd-cache",), {}),  # the write-behind's share of the wall (hybrid entries carry checkpoints)
    "ours_alone_after_hits": (("--prefill-together-max", "0"), {}),  # short chunks past a long hit: one forward each
    # every chunk may join a batched forward, a long cold prompt's second and later chunks too (at the default only
    # its first does: the rest are "past a cached prefix longer than a chunk", its own first chunk), as
    # mlx_lm.server's --prompt-concurrency batches every chunk of the prompts it prefills together
    "ours_together_all": (("--prefill-together-max", "65536"), {}),
    # MLX's CUDA backend builds a cuDNN attention graph for every new (query, key) shape of a prefill forward;
    # off, prefill attention takes MLX's unfused ops (no graph to build, more memory traffic)
    "ours_no_cudnn_sdpa": ((), {"MLX_CUDA_USE_CUDNN_SDPA": "0"}),
    "ours_no_conv_kernel": (("--debug-no-conv-kernel",), {}),
    # a mixture-of-experts layer sorts its (token, expert) pairs from 8 on (mlx-lm: from 64): each expert's weights
    # read once a decode step instead of once per row routed to it (models.kernels.moe)
    "ours_moe_sort8": (("--debug-moe-sort-min", "8"), {}),
    "ours_moe_sort_mlx": (("--debug-moe-sort-min", "64"), {}),
    "ours_moe_dense16": (("--debug-moe-dense-max", "16"), {}),  # up to 16 tokens: every expert, no gather
    "ours_no_cuda_graphs": ((), {"MLX_USE_CUDA_GRAPHS": "0"}),  # MLX launches kernels one by one, no CUDA graphs
    # MLX's compiled kernels in one folder these variants share: the first started compiles what the workload's
    # shapes need (each new batch size, chunk length), the ones after start with them, as a restarted server does
    "ours_ptx_a": ((), {"MLX_PTX_CACHE_DIR": "/tmp/mlx-lane-agents-ptx"}),
    "ours_ptx_b": ((), {"MLX_PTX_CACHE_DIR": "/tmp/mlx-lane-agents-ptx"}),
    "ours_no_ssd_ptx": (("--no-ssd-cache",), {"MLX_PTX_CACHE_DIR": "/tmp/mlx-lane-agents-ptx"}),  # hybrids' convolutions through cuDNN (a plan a shape)
    "ours_ssd_host_copies": (("--debug-ssd-host-copies",), {}),  # the SSD writer reads device copies (cache.host_copies)
    "ours_ssd_idle": (("--ssd-write-when", "idle"), {}),  # the SSD writer waits for an idle lane (the default since 12-06)
    "ours_ssd_always": (("--ssd-write-when", "always"), {}),  # the SSD writer writes as soon as an entry is due
    # MLX's CUDA backend closes a CUDA graph every 100 operations or 1,000 MB of inputs on an H100/H200
    # (MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER; a step reading 15-19 GB of weights and KV is ~20 graphs) and an
    # eval waits once more than 10 graphs are in flight (mlx/transforms.cpp MAX_ACTIVE_TASKS): a decode step cannot
    # be queued whole while the host builds the next one. Bigger graphs: a step in 4-5 or 1-2 of them
    "ours_graph_4g": ((), {"MLX_MAX_OPS_PER_BUFFER": "400", "MLX_MAX_MB_PER_BUFFER": "4000"}),
    "ours_graph_16g": ((), {"MLX_MAX_OPS_PER_BUFFER": "1600", "MLX_MAX_MB_PER_BUFFER": "16000"}),
    "ours_no_composed": (("--debug-gpu-attention-composed-max", "0"), {}),  # every chunk past a hit through cuDNN
    # prompt chunks of 9..512 (2048) tokens in the fused kernel (width at run time), not cuDNN's per-shape plans: the
    # kernel takes 4 queries a block on CUDA cores, so long chunks may cost it more than a plan saves
    "ours_ranged_prefill": (("--debug-gpu-attention-prefill-max", "512"), {}),
    "ours_ranged_prefill_2k": (("--debug-gpu-attention-prefill-max", "2048"), {}),
    # prompt chunks for cuDNN padded up to multiples of 64 queries and 1,024 (256) keys: turns of nearby lengths meet
    # a plan already built (models.attention.buckets)
    "ours_cudnn_buckets": (("--debug-cudnn-buckets", "64,1024"), {}),
    "ours_cudnn_buckets_256": (("--debug-cudnn-buckets", "64,256"), {}),
    # MLX's freed buffers stay cached after prefill forwards (no mx.clear_cache): what handing them back costs
    "ours_keep_buffers": (("--debug-keep-prefill-buffers",), {}),
    "ours_prefill_wait": (("--debug-prefill-wait",), {}),  # each prefill forward's wait for the queued steps apart
    # the CUDA pool keeps 8 GiB of freed memory mapped (its release threshold; the driver's default is 0)
    "ours_pool_keep": (("--cuda-pool-keep", "8G"), {}),
    "ours_pool_keep_buffers": (("--cuda-pool-keep", "8G", "--debug-keep-prefill-buffers"), {}),
}
MLX_LM_ARGS = ("--decode-concurrency", "32", "--prompt-concurrency", "8", "--prompt-cache-size", "64",
               "--prompt-cache-bytes", "60000000000")


def system_prompt(tokenizer, n_tokens: int, seed: int) -> str:
    """agent_workload.SYSTEM_PROMPT followed by deterministic repository notes up to ~n_tokens tokens."""
    have = len(tokenizer.encode(SYSTEM_PROMPT))
    if n_tokens <= have:
        return SYSTEM_PROMPT
    notes = tool_chunk(random.Random(seed), tokenizer, n_tokens - have, n_tokens - have)
    return SYSTEM_PROMPT + "\n\nRepository notes (what the last session read):\n" + notes.removeprefix("Tool output:\n")


def conversations(tokenizer, K: int, T: int, args) -> tuple[list[str], list[list[str]]]:
    """(tasks[K], chunks[K][T]): turn 1 carries a ~--first-tokens tool output, later turns shorter ones."""
    rng = random.Random(args.seed + 1)
    tasks = [TASKS[k % len(TASKS)] + ("" if k < len(TASKS) else f" (variant {k // len(TASKS)})") for k in range(K)]
    chunks = [[tool_chunk(rng, tokenizer, args.first_tokens, args.first_tokens + 50) if t == 0
               else tool_chunk(rng, tokenizer, args.chunk_min, args.chunk_max) for t in range(T)] for _ in range(K)]
    return tasks, chunks


def stats_blocks(url: str) -> dict:
    import httpx

    try:
        st = httpx.get(url + "/stats", timeout=30).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": repr(exc)}
    return {k: st.get(k) for k in ("lane", "prompt_cache", "ssd_cache", "device", "sizes", "memory") if k in st}


def lane_parts(stats: dict, before: dict | None = None) -> dict:
    """Where ours' lane spent the run, from /stats after it less its lane block ``before`` it (the warm-up's forwards,
    steps and leaves are in both, so the run's own are the difference): seconds per tick phase, prefill per token and
    its slowest forward (``prefill_parts.recent``: the last 64, the run's own when it ran that many), leaves, the SSD
    writer's backlog, MLX's memory."""
    lane, ssd = stats.get("lane") or {}, stats.get("ssd_cache") or {}
    before = before or {}

    def less(block: str, key: str) -> float:
        after_v = (lane.get(block) or {}).get(key) or 0.0
        before_v = (before.get(block) or {}).get(key) or 0.0
        return round(after_v - before_v, 3)

    parts, leaves = lane.get("prefill_parts") or {}, lane.get("leave_parts") or {}
    recent = parts.get("recent") or []
    tokens = (parts.get("tokens") or 0) - ((before.get("prefill_parts") or {}).get("tokens") or 0)
    rows = less("leave_parts", "rows")
    memory = stats.get("memory") or {}
    card = memory.get("device") or {}  # the CUDA driver's reading (server.device_memory), none on the CPU
    return {"prefill_s": less("tick_seconds", "prefill"), "step_s": less("tick_seconds", "batch_step"),
            "leave_s": less("tick_seconds", "batch_leave"), "ticks": (lane.get("ticks") or 0) - (before.get("ticks") or 0),
            "prefill_ms_per_token": round(1e3 * less("prefill_parts", "forward_s") / tokens, 3) if tokens else None,
            "slowest_forward_ms": max((f["ms"] for f in recent), default=None),
            # of the last forwards' milliseconds: the host building lone forwards' graphs, buffers handed back
            "recent_forwards": len(recent), "recent_ms": round(sum(f["ms"] for f in recent), 1),
            "recent_build_ms": round(sum(f.get("build_ms") or 0 for f in recent), 1),
            "recent_clear_ms": round(sum(f.get("clear_ms") or 0 for f in recent), 1),
            "recent_wait_ms": round(sum(f.get("wait_ms") or 0 for f in recent), 1),
            "leave_rows": rows,
            "leave_ms_per_row": round(1e3 * less("leave_parts", "out_of_batch_s") / rows, 1) if rows else None,
            "leave_store_ms_per_row": round(1e3 * less("leave_parts", "store_s") / rows, 1) if rows else None,
            "ssd_writes": ssd.get("writes"), "ssd_pending_bytes": ssd.get("pending_bytes"),
            "warm_up_s": (lane.get("warm_up") or {}).get("seconds"),
            "peak_gb": round(memory.get("peak_bytes", 0) / 1e9, 1),
            "active_gb": round(memory.get("active_bytes", 0) / 1e9, 1),
            "mlx_limit_gb": round(memory.get("limit_bytes", 0) / 1e9, 1),
            "over_limit": memory.get("over_limit"),  # steps / prefill forwards begun above MLX's limit: unpipelined
            **{f"{name}_gb": round((card.get(f"{name}_bytes") or 0) / 1e9, 1)
               for name in ("pool_reserved_high", "pool_used_high", "pool_keep", "outside_pool", "graph_reserved_high")}}


class CardMemory:
    """The GPU's used memory as nvidia-smi reports it, sampled each second on a thread until ``stop``: everything on
    the card (MLX's arrays and buffer cache, CUDA's pools and graphs, libraries' workspaces), to set beside /stats
    ``memory`` (MLX's own counters). An H100 ran out at 81 GB used while MLX counted 64 (BENCHMARKS.md, 2026-12-06)."""

    def __init__(self, every_s: float = 1.0):
        self._samples: list[int] = []
        self.total_mib: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=10).stdout.split("\n")[0]
                used, self.total_mib = (int(x) for x in out.split(","))
                self._samples.append(used)
            except (OSError, ValueError, subprocess.SubprocessError):
                return  # no nvidia-smi here (a CPU run): nothing to sample
            self._stop.wait(every_s)

    def stop(self) -> dict:
        """``{"max_mib", "total_mib", "samples"}`` (no samples where nvidia-smi is missing)."""
        self._stop.set()
        self._thread.join(15)
        return {"max_mib": max(self._samples, default=None), "total_mib": self.total_mib, "samples": len(self._samples)}


def served_kernels(csv_path: Path, spec: str) -> dict:
    """A served run's kernels of batch steps A..B (``--ncu-ours``), summed by name per step (gpu_kernel_times)."""
    from server.lane.cuda_profile import StepRange

    r = StepRange.parse(spec)
    assert r is not None
    summary = gkt.summarize(gkt.read_ncu_csv(csv_path), r.last - r.first + 1, 0.0)
    print(f"    served {r.noun} {r.first}..{r.last}: {summary['kernels_per_step']} kernels each, "
          f"{summary['kernel_ms_per_step']} ms of kernel time each", flush=True)
    for k in summary["by_kernel"][:25]:
        print(f"      {k['us_per_step']:9.1f} us  {k['share'] * 100:5.1f}%  x{k['launches_per_step']:<6} {k['kernel']}")
    return summary


def card_total_bytes() -> int | None:
    """The first GPU's memory as nvidia-smi reports it; None where there is none (a CPU run)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        return int(out) * 2**20
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


# mlx_lm.server's settings that ran 16 x 4 agents on an 80 GB H100 beside each shape's weights (the are 60 GB of
# prompt cache and 8 prompts prefilled at once): Qwen3.5-9B with 40 GB (2026-12-06; 60 GB ran out of device memory);
# Llama-3-8B with 20 GB (2026-12-07: 40 GB lost its generation thread in the fourth turn, 32 requests failed);
# gpt-oss-20b's 40 GB of weights with 20 GB and 4 prompts at once (2026-12-07: with 8 its first prompt batch ran out
# of device memory and every request failed)
SMALL_CARD_PEER = {"qwen3.5-9b": (40_000_000_000, None), "llama3-8b": (20_000_000_000, None),
                   "gpt-oss-20b": (20_000_000_000, 4)}


def peer_settings_for(card_bytes: int | None, shape: str) -> tuple[int | None, int | None]:
    """mlx_lm.server's (prompt-cache cap, prompts prefilled at once) for ``shape`` on a card of ``card_bytes``: the
    issue's (None, None) on a card of 100 GB or more or without a GPU; on a smaller card what ran there
    (``SMALL_CARD_PEER``), else a 40 GB cap."""
    if card_bytes is None or card_bytes >= 100e9:
        return None, None
    return SMALL_CARD_PEER.get(shape, (40_000_000_000, None))


def kernel_cache_files(ours: bool) -> int:
    """Compiled kernels the server will find at start: MLX's CUDA backend JIT-compiles kernels at first use and keeps
    them in MLX_PTX_CACHE_DIR (default <tmp>/mlx/<version>/ptx), so a peer started after anything that ran the same
    model in this machine (an in-process benchmark, an earlier peer) skips compiles a fresh one pays during its
    workload (mlx_lm.server's gpt-oss-20b wall: 72.6-76.0 s on a fresh machine, 40.9 s after
    bench/gpu_prefill_after_hit.py, BENCHMARKS.md 2026-12-05). Ours starts with a fresh MLX_LANE_HOME (0) and
    compiles in its warm-up, which the run waits for."""
    if ours:
        return 0
    import mlx.core as mx

    root = Path(os.environ.get("MLX_PTX_CACHE_DIR") or Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx")
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


class Profiler:
    """One ``GET /admin/profile`` of ours, ``after`` seconds into the run, for ``seconds``, on a thread of its own."""

    def __init__(self, url: str, after: float, seconds: float):
        import threading

        self.url, self.after, self.seconds = url, after, seconds
        self.body: dict = {}
        self._thread = threading.Thread(target=self._take, daemon=True)
        self._thread.start()

    def _take(self) -> None:
        import httpx

        time.sleep(self.after)
        try:
            r = httpx.get(f"{self.url}/admin/profile", params={"seconds": self.seconds, "interval_ms": 2, "top": 30},
                          timeout=self.seconds + 60)
            self.body = r.json()
        except Exception as exc:
            self.body = {"error": f"{type(exc).__name__}: {exc}"}

    def result(self, folded_path: Path) -> dict:
        """The hottest lines and functions per thread (printed too); the folded stacks go to ``folded_path``."""
        self._thread.join(self.seconds + 90)
        body = dict(self.body)
        threads = body.get("threads") or {}
        lines = []
        for name, t in threads.items():
            lines += [f"{name};{stack}" for stack in t.pop("folded", [])]  # the thread as the outermost frame
            print(f"    profile {name}: {t['samples']} samples", flush=True)
            for row in t["top_total"][:20]:
                print(f"      total {row['share']:6.1%}  {row['function']}", flush=True)
            for row in t["top_self"][:20]:
                print(f"      self  {row['share']:6.1%}  {row['line']}", flush=True)
        if lines:
            folded_path.write_text("\n".join(lines) + "\n")
        return body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(gpu.ROOT / ".bench" / "gpu-out"))
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--vocab", type=int, default=gpu.PROMPT_VOCAB,
                    help="the model's vocabulary (default: the SmolLM2 tokenizer's, so replies read back as text)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model-dir", default="/dev/shm/mlx-lane-agents-model")
    ap.add_argument("--reuse-model", action="store_true", help="use the model in --model-dir if it is there")
    ap.add_argument("--tokenizer-dir", default=str(gpu.ROOT / ".whl" / "tok"))
    ap.add_argument("--plan", default="16x4,32x3", help="comma list of KxT (agents x turns)")
    ap.add_argument("--servers", default="ours,mlx_lm")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--first-tokens", type=int, default=1000)
    ap.add_argument("--chunk-min", type=int, default=120)
    ap.add_argument("--chunk-max", type=int, default=240)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--stagger-ms", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-every-ms", type=float, default=0.0,
                    help="also send a fully cached 2-token request this often during each run and report its TTFT "
                         "against ours' batched decode step (issue 22 item 7; concurrent_agents.run_probe)")
    ap.add_argument("--prime-peer", action="store_true",
                    help="before the measured runs, start mlx_lm.server once for an unmeasured 4 x 2 workload of other "
                         "conversations, so that it starts the measured ones with its kernels compiled, as ours does "
                         "(its warm-up) and as a server that has run before would (kernel_cache_files)")
    ap.add_argument("--profile-ours", type=float, default=0.0, metavar="SECONDS",
                    help="sample where ours' threads spend SECONDS of the run (GET /admin/profile), starting "
                         "--profile-after seconds into it; the hottest lines go into the JSON and the log, the folded "
                         "stacks into OUT/profile_<server>.folded")
    ap.add_argument("--profile-after", type=float, default=3.0)
    ap.add_argument("--ncu-ours", default="", metavar="A:B",
                    help="run ours under Nsight Compute and measure the kernels of its A-th to B-th batch decode "
                         "steps (prefill:A:B: prefill calls; --debug-cuda-profile-steps): a served step kernel by "
                         "kernel, in the JSON (served_kernels) and OUT/ncu_served_<server>.csv")
    ap.add_argument("--ncu-bin", default=None, help="ncu's path (default: on PATH, or under /opt/nvidia, /usr/local)")
    ap.add_argument("--ours-args", default="", help="extra `mlx-lane serve` arguments (one shell-quoted string)")
    ap.add_argument("--peer-cache-bytes", type=int, default=None,
                    help="mlx_lm.server's --prompt-cache-bytes (default: the issue's 60 GB on a card of 100 GB or "
                         "more, else what ran on an 80 GB H100 for the shape, SMALL_CARD_PEER: 40 GB for "
                         "Qwen3.5-9B, 20 GB for Llama-3-8B and gpt-oss-20b)")
    ap.add_argument("--peer-prefill-step", type=int, default=None,
                    help="mlx_lm.server's --prefill-step-size instead of its default 2048 (on an 80 GB H100 the "
                         "Qwen3.5-9B peer ran out of device memory in its first batched prefill, 2026-12-06)")
    ap.add_argument("--peer-prompt-concurrency", type=int, default=None,
                    help="mlx_lm.server's --prompt-concurrency instead of the issue's 8 (prompts it prefills at once; "
                         "default on a card under 100 GB: 4 for gpt-oss-20b, SMALL_CARD_PEER)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [tuple(int(x) for x in p.split("x")) for p in args.plan.split(",") if p.strip()]
    names = [n.strip() for n in args.servers.split(",") if n.strip()]

    from mlx_lm.utils import load_tokenizer

    model_dir = Path(args.model_dir)
    t0 = time.perf_counter()
    gpu.SHAPES[args.shape] = {**gpu.SHAPES[args.shape], "vocab_size": args.vocab}
    if not (args.reuse_model and (model_dir / "config.json").is_file()):
        gpu.build_model_apart(model_dir, args.shape, args.dtype, Path(args.tokenizer_dir))
    tokenizer = load_tokenizer(model_dir)
    system = system_prompt(tokenizer, args.system_tokens, args.seed)
    peer_args = MLX_LM_ARGS
    small_cache, small_concurrency = peer_settings_for(card_total_bytes(), args.shape)
    if args.peer_cache_bytes is None and small_cache is not None:
        args.peer_cache_bytes = small_cache
        print(f"a card under 100 GB: mlx_lm.server gets --prompt-cache-bytes {small_cache} (what ran there)",
              flush=True)
    if args.peer_prompt_concurrency is None and small_concurrency is not None:
        args.peer_prompt_concurrency = small_concurrency
        print(f"a card under 100 GB: mlx_lm.server gets --prompt-concurrency {small_concurrency} (with 8 it ran out "
              "of device memory there)", flush=True)
    if args.peer_cache_bytes is not None:
        i = peer_args.index("--prompt-cache-bytes")
        peer_args = peer_args[:i + 1] + (str(args.peer_cache_bytes),) + peer_args[i + 2:]
    if args.peer_prefill_step is not None:
        peer_args = peer_args + ("--prefill-step-size", str(args.peer_prefill_step))  # its default: 2048
    if args.peer_prompt_concurrency is not None:
        i = peer_args.index("--prompt-concurrency")
        peer_args = peer_args[:i + 1] + (str(args.peer_prompt_concurrency),) + peer_args[i + 2:]
    R: dict = {"script": "bench/gpu_agents.py", "argv": sys.argv[1:], "started_unix": int(time.time()),
               "gpu": gpu.sh("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"),
               "model": gpu.R.get("model", {"dir": str(model_dir), "reused": True}),
               "system_prompt_tokens": len(tokenizer.encode(system)), "mlx_lm_args": list(peer_args),
               "build_s": round(time.perf_counter() - t0, 1), "runs": [],
               # what the card holds before any server starts: this process must hold nothing there (it held the
               # model it built, 17-39 GB, until 2026-12-06's eighth session)
               "card_used_before_servers": gpu.sh("nvidia-smi --query-gpu=memory.used --format=csv,noheader")}

    def save() -> None:
        (out / "gpu_agents.json").write_text(json.dumps(R, indent=1))

    ncu = None
    if args.ncu_ours:
        from server.lane.cuda_profile import StepRange

        StepRange.parse(args.ncu_ours)  # a malformed range stops here, not in a server
        ncu = gkt.find_ncu(args.ncu_bin)
        if ncu is None:
            raise SystemExit("--ncu-ours: ncu not found; pass --ncu-bin")
    workdir = Path(tempfile.mkdtemp(prefix="gpu-agents-"))
    extra = {"ours": tuple(args.ours_args.split()), "mlx_lm": peer_args}
    if "mlx_lm" in names:
        print("mlx_lm.server's arguments: " + " ".join(peer_args), flush=True)
    if args.prime_peer and "mlx_lm" in names:
        primer = peer_servers.MlxLm(workdir, model_dir, extra=extra["mlx_lm"])
        before = kernel_cache_files(False)
        other = argparse.Namespace(**{**vars(args), "seed": args.seed + 977})
        tasks, chunks = conversations(tokenizer, 4, 2, other)
        try:
            primer.start()
            _, wall = run_agents(primer.url, tasks, chunks, 4, 2, 16, args.stagger_ms / 1e3, system=system)
        finally:
            primer.stop()
        R["peer_primed"] = {"wall_s": round(wall, 1), "kernel_cache_files_before": before,
                            "kernel_cache_files_after": kernel_cache_files(False)}
        print(f"peer primed: {R['peer_primed']}", flush=True)
    for rnd in range(args.rounds):
        for pi, (K, T) in enumerate(plan):
            tasks, chunks = conversations(tokenizer, K, T, args)
            shift = (rnd + pi) % len(names)
            for n in names[shift:] + names[:shift]:
                if n in OURS_VARIANTS:  # persistent: the SSD tier on, in a folder of this run (the defaults')
                    more, env = OURS_VARIANTS[n]
                    peer = peer_servers.Ours(workdir / f"{n}-{rnd}-{K}", model_dir, "--no-ssd-cache" not in more,
                                             extra=tuple(a for a in extra["ours"] + more if a != "--no-ssd-cache"),
                                             env={**env, **({"MLX_LANE_DEBUG_CUDA_PROFILE_STEPS": args.ncu_ours}
                                                            if ncu else {})})
                    if ncu:
                        peer.prefix = tuple(gkt.ncu_prefix(ncu, out / f"ncu_served_{n}.csv"))
                else:
                    peer = peer_servers.MlxLm(workdir, model_dir, extra=extra["mlx_lm"])
                run = {"round": rnd + 1, "k": K, "turns": T, "server": n,
                       "kernel_cache_files_at_start": kernel_cache_files(n in OURS_VARIANTS)}
                try:
                    t = time.perf_counter()
                    peer.start()
                    run["start_s"] = round(time.perf_counter() - t, 1)  # ours: until its warm-up is done too
                    if getattr(peer, "healthy_s", None) is not None:  # ours: launch to /health (the port open)
                        run["healthy_s"] = round(peer.healthy_s, 1)
                    import httpx

                    with httpx.Client() as c:
                        stream_chat(c, peer.url, [{"role": "user", "content": "Say hi."}], 2)  # warm-up
                        if args.probe_every_ms > 0:
                            stream_chat(c, peer.url, PROBE, 2)  # the probe's prompt, cached from now on
                    lane_before = lane_block(peer.url) if n in OURS_VARIANTS else None
                    probes: list[dict] = []
                    card = CardMemory()  # the whole card's memory while the agents run (nvidia-smi, each second)
                    profiler = (Profiler(peer.url, args.profile_after, args.profile_ours)
                                if n in OURS_VARIANTS and args.profile_ours > 0 else None)
                    try:
                        records, wall = run_agents(peer.url, tasks, chunks, K, T, args.max_tokens,
                                                   args.stagger_ms / 1e3, system=system,
                                                   probe_every_s=args.probe_every_ms / 1e3, probes=probes)
                    finally:
                        run["card_memory"] = card.stop()
                        if profiler is not None:
                            run["profile"] = profiler.result(out / f"profile_{n}.folded")
                    if n in OURS_VARIANTS:
                        run["stats_after"] = stats_blocks(peer.url)
                        run["lane_parts"] = lane_parts(run["stats_after"], lane_before)
                        print(f"    {n} lane: {run['lane_parts']}; card {run['card_memory']}", flush=True)
                    run["metrics"] = run_metrics(records, wall, K, T)
                    if args.probe_every_ms > 0:
                        run["probe"] = probe_metrics(probes, lane_before, (run.get("stats_after") or {}).get("lane"))
                        run["probe_records"] = probes
                        print(f"    {n} probe: {run['probe']}", flush=True)
                    run["per_turn"] = {str(t + 1): {
                        "ttft_mean_s": round(statistics.mean(r["ttft_s"] for r in records
                                                             if r["ok"] and r["turn"] == t + 1), 4),
                        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in records if r["turn"] == t + 1),
                        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in records if r["turn"] == t + 1)}
                        for t in range(T) if any(r["ok"] and r["turn"] == t + 1 for r in records)}
                    run["records"] = records
                except Exception as exc:  # a server that cannot start or run is a result, not the end of the run
                    run["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                finally:
                    run["exit_code"] = peer.stop() if peer.pid() is not None else peer.exit_code()
                    if ncu and n in OURS_VARIANTS:
                        run["served_kernels"] = served_kernels(out / f"ncu_served_{n}.csv", args.ncu_ours)
                    # warnings and errors (the peer's too: on an H100 it lost its generation thread, 12-06)
                    if n in OURS_VARIANTS and getattr(peer, "proc", None) is not None:
                        run["log_tail"] = peer.proc.log()[-4000:]
                    elif getattr(peer, "log_path", None) is not None and peer.log_path.exists():
                        text = peer.log_path.read_text(errors="replace")
                        run["log_tail"] = text[-4000:]
                        if (first := text.find("Traceback")) >= 0:  # the first failure, not its echoes
                            run["log_first_traceback"] = text[first: first + 6000]
                R["runs"].append(run)
                save()
                m = run.get("metrics")
                if m and m["ttft_mean_s"] is None:  # every request failed (e.g. the peer ran out of memory)
                    print(f"round {rnd + 1} {K}x{T} {n:7s} every request failed ({m['requests_failed']}): see "
                          "the run's log_first_traceback", flush=True)
                    continue
                print(f"round {rnd + 1} {K}x{T} {n:7s} " + (
                    f"wall {m['wall_s']:7.2f}s  mean TTFT {m['ttft_mean_s']:.3f}s  p95 {m['ttft_p95_s']:.3f}s  "
                    f"{m['tok_s']:7.1f} tok/s  cached {m['cached_tokens']}/{m['prompt_tokens']}  failed "
                    f"{m['requests_failed']}" if m else f"FAILED: {run.get('error')}"), flush=True)
    R["ratios"] = {}
    for K, T in plan:
        got = {n: [r["metrics"] for r in R["runs"] if r["k"] == K and r["server"] == n and r.get("metrics")]
               for n in names}
        failed = sum(m["requests_failed"] for n in ("ours", "mlx_lm") for m in got.get(n, []))
        if failed:  # a server that fails requests finishes early: its wall is not comparable
            print(f"{K}x{T}: {failed} requests failed: no ratio (errors in the runs' records)")
            R["ratios"][f"{K}x{T}"] = {"failed_requests": failed}
        elif got.get("ours") and got.get("mlx_lm"):
            o = statistics.median(m["wall_s"] for m in got["ours"])
            p = statistics.median(m["wall_s"] for m in got["mlx_lm"])
            to = statistics.median(m["ttft_mean_s"] for m in got["ours"])
            tp = statistics.median(m["ttft_mean_s"] for m in got["mlx_lm"])
            target = target_wall(args.shape or "", T)
            R["ratios"][f"{K}x{T}"] = {"wall_ours_over_mlx_lm": round(o / p, 3),
                                      "ttft_mean_ours_over_mlx_lm": round(to / tp, 3),
                                      "target_wall": target, "met": o / p <= target}
            print(f"{K}x{T}: wall ours/mlx_lm {o / p:.3f} (target <= {target}), mean TTFT {to / tp:.3f}")
        for v in (n for n in names if n in OURS_VARIANTS and n != "ours"):  # each variant against ours
            if got.get("ours") and got.get(v):
                o = statistics.median(m["wall_s"] for m in got["ours"])
                w = statistics.median(m["wall_s"] for m in got[v])
                R["ratios"].setdefault(f"{K}x{T}", {})[f"wall_ours_over_{v}"] = round(o / w, 3)
                print(f"{K}x{T}: wall ours/{v} {o / w:.3f}")
    R["script_wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
