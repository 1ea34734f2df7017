"""Every architecture of the zoo through the server's CUDA attention, against mlx-lm's own, on the device (issue 43).

The CPU suite checks where the wrapper (models.attention.gpu) sends each attention call, the fused kernel stood in for
by its reference; `bench/gpu_attention.py --parts check` checks the kernel's arithmetic alone. This runs both
together on real models, where a routing that the zoo's CPU tests never meet shows up as a crash or a wrong logit (as
latent attention's did on 2026-12-07). Each zoo architecture (tests.fixtures.zoo; head size 64, which the kernel takes,
where its config names one) with the server's wrapper switched in, against mlx-lm's attention, in the forwards an
agent's turn makes:

    chunk    a lone 30-token prompt, then a 5-token chunk past it (a verify step; a short turn after a hit): composed
    verify   three rows of 30, 9 and 21 cached tokens verifying 3 tokens together (mlx-lm's batch caches): the kernel
    decode   the same rows' next token, one step: the kernel
    hit_verify / hit_decode   a RAM hit on the lone 30-token prompt (its caches read where they lie:
             models.attention.shared_prefix, where every layer is plain KV), 4 tokens verified past it, then one:
             segments

Per architecture and forward: the largest logit difference, the share of positions whose argmax agrees, the largest
logit error of ours and of mlx-lm's own against mlx-lm's forward in float32 (the noise floor of the dtype), and which
path each attention call took (kernel / composed / segments / mlx-lm's). A forward agrees when every argmax does or
its error is within the noise (``NOISE_FACTOR``). An architecture that fails is reported with its error, and the run
goes on.

    bash bench/gpu.sh bench/gpu_zoo.py                                  # the device: bf16, the real kernel
    python bench/gpu_zoo.py --dtype float32 --reference-kernel          # this CPU: the script itself, the kernel's
                                                                        # reference standing in
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from common import machine_facts, write_result  # noqa: E402
from models import hook  # noqa: E402
from models.attention import composed  # noqa: E402
from models.attention import gpu as gpu_attention  # noqa: E402
from models.attention.shared_prefix import share_prefix  # noqa: E402
from cache.copying import fork  # noqa: E402
from tests.fixtures import zoo  # noqa: E402

PROMPT = [(13 * i + 7) % 250 + 3 for i in range(40)]
CACHED = [30, 9, 21]  # the three rows' cached tokens; each verifies the 3 tokens after them
FORWARDS = ("chunk", "verify", "decode", "hit_verify", "hit_decode")
# A forward agrees when every argmax does, or when its largest logit error against mlx-lm's float32 forward is at most
# NOISE_FACTOR x mlx-lm's own 16-bit error + NOISE_SLACK: a tiny random model's logits have near-ties that 16-bit
# rounding flips either way (on the H200, 2026-12-07: qwen3 and glm4_moe lost one argmax of 4-5 with logit differences
# the size of every other architecture's)
NOISE_FACTOR, NOISE_SLACK = 2.0, 0.05


def forwards(model) -> dict[str, mx.array]:
    """The three forwards' logits (float32), in order, on fresh caches."""
    lone = make_prompt_cache(model)
    model(mx.array([PROMPT[:30]]), cache=lone)
    out = {"chunk": model(mx.array([PROMPT[30:35]]), cache=lone)}
    rows = []
    for n in CACHED:
        row = make_prompt_cache(model)
        model(mx.array([PROMPT[:n]]), cache=row)
        rows.append(row)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]
    out["verify"] = model(mx.array([PROMPT[n: n + 3] for n in CACHED]), cache=batch)
    out["decode"] = model(mx.array([[PROMPT[n + 3]] for n in CACHED]), cache=batch)
    entry = make_prompt_cache(model)
    model(mx.array([PROMPT[:30]]), cache=entry)
    mx.eval([c.state for c in entry])
    hit = share_prefix(fork(entry))  # mlx-lm's attention reads the segments' concatenation; the server's, the segments
    out["hit_verify"] = model(mx.array([PROMPT[30:34]]), cache=hit)
    out["hit_decode"] = model(mx.array([[PROMPT[34]]]), cache=hit)
    out = {k: v.astype(mx.float32) for k, v in out.items()}
    mx.eval(out)
    return out


def check(name: str, dtype: str, reference_kernel: bool) -> dict:
    config = zoo.ZOO[name]
    # a head size the kernel takes; latent attention's prompt side 64 wide too (DeepSeek-V3's is 128: a size the
    # kernel takes, with the rotary scores in its mask)
    zoo.ZOO[name] = ({**config, "qk_nope_head_dim": 64, "v_head_dim": 64} if "kv_lora_rank" in config
                     else {**config, "head_dim": 64})
    try:
        model = zoo.build(name, vocab=256, seed=4)
    finally:
        zoo.ZOO[name] = config
    model.set_dtype(getattr(mx, dtype))
    paths: Counter = Counter()
    kernel, compose, segmented = (gpu_attention.ranged_attention, composed.composed_attention,
                                  gpu_attention.segmented_attention)

    def counted_kernel(*args, **kwargs):
        paths["kernel"] += 1
        if reference_kernel:
            q, k, v, scale, start, last = args[:6]
            return gpu_attention.reference_attention(q, k, v, scale, start, last, kwargs.get("window", 0),
                                                     kwargs.get("sinks"))
        return kernel(*args, **kwargs)

    def counted_composed(*args, **kwargs):
        paths["composed"] += 1
        return compose(*args, **kwargs)

    def counted_segments(*args, **kwargs):
        paths["segments"] += 1
        return segmented(*args, **kwargs)

    def wrap(original):  # the server's wrapper, its calls counted; hook.restore puts ``original`` back
        inner = gpu_attention._wrap(original)

        def counted(*args, **kwargs):
            paths["calls"] += 1
            return inner(*args, **kwargs)

        counted.mlx_lane_original = original  # type: ignore[attr-defined]
        return counted

    switched_before = hook.restore(model, hook.ATTENTION)
    gpu_attention.ranged_attention, composed.composed_attention = counted_kernel, counted_composed
    gpu_attention.segmented_attention = counted_segments
    try:
        theirs = forwards(model)
        paths.clear()
        if hook.switch(model, wrap) == 0:
            return {"name": name, "error": "no module of this model calls mlx-lm's attention"}
        ours = forwards(model)
    finally:
        gpu_attention.ranged_attention, composed.composed_attention = kernel, compose
        gpu_attention.segmented_attention = segmented
        hook.restore(model, hook.ATTENTION)
        # the noise floor: mlx-lm's own forwards in float32, against which both 16-bit runs are measured
        model.set_dtype(mx.float32)
        exact = forwards(model)
        for module, fn in switched_before:
            setattr(module, hook.ATTENTION, fn)
    calls = paths.pop("calls", 0)
    result: dict = {"name": name, "paths": {**paths, "mlx-lm": calls - sum(paths.values())}}
    for k in theirs:
        diff = float(mx.abs(ours[k] - theirs[k]).max().item())
        agree = float((mx.argmax(ours[k], axis=-1) == mx.argmax(theirs[k], axis=-1)).astype(mx.float32).mean().item())
        floor = float(mx.abs(theirs[k] - exact[k]).max().item())  # mlx-lm's own error in this dtype
        error = float(mx.abs(ours[k] - exact[k]).max().item())
        result[k] = {"max_abs_logit_diff": round(diff, 5), "argmax_agree": round(agree, 4),
                     "error_vs_float32": round(error, 5), "mlx_lm_error_vs_float32": round(floor, 5),
                     "within_noise": error <= NOISE_FACTOR * floor + NOISE_SLACK}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", default=",".join(zoo.ZOO), help="zoo architectures (default: all)")
    ap.add_argument("--dtype", default="bfloat16", help="the models' dtype (default bfloat16: what the kernel takes)")
    ap.add_argument("--reference-kernel", action="store_true",
                    help="stand the fused kernel in by its reference (off CUDA; with --dtype float32 the 16-bit "
                         "rule is set aside so the kernel's routes are taken)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.reference_kernel and args.dtype == "float32":  # the CPU's MoE product takes float32 only
        def sized(queries, keys, values, cache) -> bool:
            return queries.shape[-1] == keys.shape[-1] == values.shape[-1] == 64

        gpu_attention._kinds_apply = sized
    gpu_attention.configure(prefill_max=0)
    results, failed = [], 0
    for name in args.names.split(","):
        try:
            r = check(name, args.dtype, args.reference_kernel)
        except Exception as e:  # one architecture's failure is the finding; the rest still run
            r = {"name": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
        ok = "error" not in r and all(r[k]["argmax_agree"] >= 0.98 or r[k]["within_noise"] for k in FORWARDS)
        failed += not ok
        r["ok"] = ok
        results.append(r)
        detail = r.get("error") or "  ".join(f"{k} {r[k]['max_abs_logit_diff']}/{r[k]['argmax_agree']}"
                                             f"/{r[k]['error_vs_float32']}<={r[k]['mlx_lm_error_vs_float32']}"
                                             for k in FORWARDS)
        print(f"{'ok  ' if ok else 'FAIL'} {name:18s} {detail}  paths {r.get('paths')}", flush=True)
    print(f"{len(results) - failed} of {len(results)} architectures agree with mlx-lm's attention", flush=True)
    if args.out:
        write_result({"script": "bench/gpu_zoo.py", "dtype": args.dtype, "reference_kernel": args.reference_kernel,
                      "device": str(mx.default_device()), "machine": machine_facts(), "results": results},
                     Path(args.out) / "gpu_zoo.json")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
