"""What the SSD write-behind costs a batched decode, part by part (issue 22, item 5), in-process, no HTTP.

A random model of the bench shape decodes N rows of ~`--context` tokens (one forward per step, plain mlx-lm
KVCache with a batch dimension); every `--leave-every` steps one row "finishes": its KV is copied out of the batch
as the lane's `leave_rows` does (slice + eval: the same in every condition). Then, per condition, for
`--seconds` of steps, the median and mean step time:

  none          nothing more (the floor)
  encode_only   kvfile.encode of the row on the decode thread (what `schedule` does on the lane), nothing written
  current       DurabilityCoordinator.schedule + SSDStore (the product's write-behind, debounce 1 s)
  read_only     a thread copies each snapshot to host memory (numpy copy of the MLX buffer), writes nothing
  disk_only     a thread writes a host buffer of the row's size to a file + fsync per leave (no MLX memory read)
  gil_spin      a thread spinning pure Python (how much a GIL-holding neighbour costs this loop)
  <any>_si      the same under sys.setswitchinterval(--switch-interval) (Python's default is 5 ms)

Ratios are step times over `none` in the same run. Each condition runs twice, interleaved (ABAB), so drift shows.

    python bench/gpu_write_cost.py --rows 16 --context 1024 --seconds 12 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

CONDITIONS = ("none", "encode_only", "current", "read_only", "disk_only", "gil_spin")
_KEYS = [0]  # a counter that keeps every scheduled entry's tokens unique across conditions and repeats



def build(shape: str, dtype: str):
    from mlx_lm.models.llama import Model, ModelArgs

    from gpu import SHAPES, random_weights

    s = SHAPES[shape]
    cfg = {"model_type": "llama", **s, "head_dim": s["hidden_size"] // s["num_attention_heads"], "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
           "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    model = Model(ModelArgs.from_dict(cfg))
    random_weights(model, dtype)
    return model, cfg


def row_caches(cache, r: int):
    """Row r's own caches, copied out of the batch (what the lane's leave_rows does), evaluated."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        k = mx.contiguous(c.keys[r:r + 1, :, : c.offset, :])
        v = mx.contiguous(c.values[r:r + 1, :, : c.offset, :])
        row = KVCache()
        row.keys, row.values, row.offset = k, v, c.offset
        out.append(row)
    mx.eval([x for c in out for x in (c.keys, c.values)])
    return out


class Neighbour:
    """A background thread fed one job per leave (read_only, disk_only) or spinning (gil_spin)."""

    def __init__(self, kind: str, nbytes: int, folder: str):
        self.kind, self.nbytes, self.folder = kind, nbytes, folder
        self.jobs: queue.Queue = queue.Queue(maxsize=64)
        self.done = 0
        self.stop = threading.Event()
        self.host = np.ones(nbytes, dtype=np.uint8) if kind == "disk_only" else None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def feed(self, caches) -> None:
        if self.kind in ("read_only", "disk_only"):
            try:
                self.jobs.put_nowait(caches)
            except queue.Full:
                pass

    def run(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            while not self.stop.is_set():
                if self.kind == "gil_spin":
                    x = 0
                    for i in range(10000):
                        x += i
                    continue
                try:
                    caches = self.jobs.get(timeout=0.05)
                except queue.Empty:
                    continue
                if self.kind == "read_only":
                    for c in caches:
                        for a in (c.keys, c.values):
                            u = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
                            mx.eval(u)
                            np.array(u, copy=True)
                else:
                    path = os.path.join(self.folder, "disk_only.bin")
                    with open(path, "wb") as f:
                        f.write(memoryview(self.host))
                        f.flush()
                        os.fsync(f.fileno())
                self.done += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def run_condition(model, args, name: str, folder: str) -> dict:
    kind = name.removesuffix("_si")
    interval = sys.getswitchinterval()
    if name.endswith("_si"):
        sys.setswitchinterval(args.switch_interval)
    try:
        out = _run(model, args, kind, folder)
    finally:
        sys.setswitchinterval(interval)
    out["condition"] = name
    return out


def _run(model, args, kind: str, folder: str) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    from cache import kvfile
    from cache.durability import DurabilityCoordinator
    from cache.ssd_store import SSDStore

    n, ctx = args.rows, args.context
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 1000, (n, ctx))
    for i in range(0, ctx, 512):  # prefill in chunks (attention memory)
        model(prompt[:, i:i + 512], cache=cache)
        mx.eval([c.state for c in cache])
    tok = mx.argmax(model(prompt[:, -1:], cache=cache)[:, -1, :], axis=-1)
    mx.eval(tok)
    probe = row_caches(cache, 0)
    nbytes = sum(c.keys.nbytes + c.values.nbytes for c in probe)
    del probe
    store = coord = neighbour = None
    if kind == "current":
        store = SSDStore(os.path.join(folder, "kv"), "ab" * 16, 200 << 30)
        coord = DurabilityCoordinator(store, debounce_s=1.0)
    elif kind in ("read_only", "disk_only", "gil_spin"):
        neighbour = Neighbour(kind, nbytes, folder)
    times, leaves, step = [], 0, 0
    t_end = time.perf_counter() + args.seconds
    warm = 10
    while time.perf_counter() < t_end or step < warm + 20:
        t0 = time.perf_counter()
        logits = model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(tok)
        step += 1
        if step % args.leave_every == 0:
            caches = row_caches(cache, step // args.leave_every % n)
            leaves += 1
            if kind == "encode_only":
                kvfile.encode(caches)
            elif kind == "current":
                _KEYS[0] += 1
                coord.schedule([_KEYS[0]] + list(range(caches[0].offset - 1)), caches, "bench")
            elif neighbour is not None:
                neighbour.feed(caches)
            del caches
        if step > warm:
            times.append(time.perf_counter() - t0)
        if cache[0].offset >= ctx + args.max_growth:  # keep the context near --context: trim back
            for c in cache:
                c.offset -= args.max_growth
    out = {"condition": kind, "steps": len(times), "step_ms_median": round(statistics.median(times) * 1e3, 3),
           "step_ms_mean": round(statistics.mean(times) * 1e3, 3),
           "step_ms_p90": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3), "leaves": leaves,
           "row_mb": round(nbytes / 1e6, 1)}
    if coord is not None:
        out["written_during"] = coord.stats()["written"]
        t = time.perf_counter()
        coord.close(timeout=300)
        out["flush_s"] = round(time.perf_counter() - t, 2)
        out["durability"] = coord.stats()
        out["ssd_write_ms_last"] = store.stats().get("write_ms_last")
    if neighbour is not None:
        neighbour.close()
        out["neighbour_jobs"] = neighbour.done
    del cache
    mx.clear_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench" / "gpu-out")))
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-growth", type=int, default=128)
    ap.add_argument("--leave-every", type=int, default=8, help="steps between row leaves (128 tokens / 16 rows)")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--switch-interval", type=float, default=0.0005, help="seconds, for the *_si conditions")
    ap.add_argument("--dir", default=None, help="folder for the files (default: a temp folder)")
    args = ap.parse_args()
    model, cfg = build(args.shape, args.dtype)
    folder = tempfile.mkdtemp(prefix="write-cost-", dir=args.dir)
    results = []
    kinds = [k for k in args.conditions.split(",") if k]
    for rep in range(args.repeats):
        for kind in kinds:
            r = run_condition(model, args, kind, folder)
            r["repeat"] = rep
            results.append(r)
            print(json.dumps(r), flush=True)
    base = [r["step_ms_median"] for r in results if r["condition"] == "none"]
    summary = {}
    for kind in kinds:
        meds = [r["step_ms_median"] for r in results if r["condition"] == kind]
        summary[kind] = {"step_ms_median": meds, "over_none": [round(m / statistics.mean(base), 3) for m in meds]}
    rec = {"script": "bench/gpu_write_cost.py", "argv": sys.argv[1:], "mlx": mx.__version__,
           "device": str(mx.default_device()), "folder": folder, "results": results, "summary": summary}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_write_cost.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
