"""Where a hybrid's decode step and prompt chunks go on the device, in-process (issue 43).

The served Qwen3.5-9B shape decodes 16 rows in ~30 ms a step (in-process 18 ms) where its bytes allow ~3.9 ms, and
prefills the agents' later turns at ~1.5k tok/s where one long prompt runs at 22k. This takes the --shape model
(random weights) apart, in one process:

  conv      the short depthwise convolution every gated-delta layer runs: ``models.kernels.conv.depthwise`` vs
            ``mx.conv1d`` (cuDNN on CUDA, a plan per input shape): max |diff| on random inputs, and the time of one
            call at a shape already seen and at shapes never seen (each rep a new length), decode and prompt shapes
  decode    a --rows decode step (mlx-lm's caches after a --decode-context-token prompt), the convolution kernel on
            vs off, alternated, and the host time of building a step's graph (the Python of the model's call, before
            any evaluation: a pipelined step hides it only while it is shorter than the device's work); then the
            server's decode batch (``RaggedBatch``, pipelined, with models.attention's fused CUDA kernel installed as
            the server does) over the same rows, on vs off; then each part of a step alone at that shape (one
            linear-attention layer's mixer, one full attention layer's, one MLP, the final norm + head),
            --parts-reps calls queued and evaluated once, times the model's count of each: what the step would cost
            if those parts were all it ran
  prefill   one --chunk-token chunk after a --context-token cache (each rep a length this process has not seen, as
            agents' turns are), alone and --together rows at once in mlx-lm's ``PromptProcessingBatch`` (what the
            lane's gathered prefill runs), models.attention installed as the server does: the convolution kernel
            on vs off, ``mx.clear_cache()`` after each forward (what the lane does on a GPU) vs not, composed
            attention for chunks up to 512 queries (``--debug-gpu-attention-composed-max 512``) vs the default 8,
            and the same lengths every rep (a shape seen) vs new ones

    bash bench/gpu.sh bench/gpu_hybrid_parts.py                       # the H200 (~3 min after the wheels)
    python bench/gpu_hybrid_parts.py --shape qwen3.5-tiny --dtype float32 --context 64 --chunk 16 --rows 4 \\
        --decode-context 32 --together 3 --reps 2                   # the CPU: the script's logic only

Writes OUT/gpu_hybrid_parts.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu  # noqa: E402

R: dict = {"script": "bench/gpu_hybrid_parts.py"}


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def clock(fn, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (which evaluates what it computes), synchronised around each."""
    import mlx.core as mx

    out = []
    for r in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        fn(r)
        mx.synchronize()
        out.append(time.perf_counter() - t)
    return out


def conv_part(on_cuda: bool, channels: int, taps: int, reps: int) -> dict:
    import mlx.core as mx

    from models.kernels import conv

    res: dict = {"channels": channels, "taps": taps, "check": [], "ms": {}}
    mx.random.seed(0)
    for dtype in (mx.float32, mx.bfloat16):
        w = (0.3 * mx.random.normal((channels, taps, 1))).astype(dtype)
        for B, L in ((16, taps), (3, taps + 7), (8, 333 + taps - 1)):
            x = mx.random.normal((B, L, channels)).astype(dtype)
            ref = mx.conv1d(x, w, groups=channels).astype(mx.float32)
            row = {"dtype": str(dtype), "B": B, "L": L}
            if on_cuda:
                ours = conv.depthwise(x, w).astype(mx.float32)
                row["max_abs_diff"] = mx.abs(ours - ref).max().item()
                row["ok"] = row["max_abs_diff"] <= (1e-5 if dtype == mx.float32 else 2e-2)
            res["check"].append(row)
    if not on_cuda:
        return res
    w = (0.3 * mx.random.normal((channels, taps, 1))).astype(mx.bfloat16)
    for name, shape_of in (("decode 16 rows", lambda r: (16, taps)),
                           ("decode, rows 1-16 new", lambda r: (1 + r % 16, taps)),
                           ("chunk 330", lambda r: (1, 330 + taps - 1)),
                           ("chunk, new lengths", lambda r: (1, 301 + 7 * r)),
                           ("8 rows x chunk, new lengths", lambda r: (8, 301 + 7 * r))):
        xs = [mx.random.normal((*shape_of(r), channels)).astype(mx.bfloat16) for r in range(reps)]
        mx.eval(xs)
        cudnn = clock(lambda r: mx.eval(mx.conv1d(xs[r], w, groups=channels)), reps)
        ours = clock(lambda r: mx.eval(conv.depthwise(xs[r], w)), reps)
        res["ms"][name] = {"cudnn": ms(statistics.median(cudnn)), "cudnn_max": ms(max(cudnn)),
                           "kernel": ms(statistics.median(ours)), "kernel_max": ms(max(ours))}
        print(f"conv {name}: {res['ms'][name]}", flush=True)
    return res


def _clone(caches: list) -> list:
    """New cache objects over the same (immutable) arrays: a batch that takes a row's caches takes these."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    out = []
    for c in caches:
        if isinstance(c, ArraysCache):
            n = ArraysCache(len(c.cache))
            n.cache = list(c.cache)
        else:
            n = KVCache()
            n.keys, n.values, n.offset = c.keys, c.values, c.offset
        out.append(n)
    return out


def decode_part(model, rows: int, context: int, steps: int, rounds: int, parts_reps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from models.kernels import conv
    from server.engine.batch.protocol import Row
    from server.engine.batch.ragged import RaggedBatch

    prompt = mx.array([[(7 * i + 3) % 40000 + 100 for i in range(context)]])

    def fresh():
        caches = make_prompt_cache(model)
        for i in range(0, context, 1024):  # in chunks: 16 rows of 5k at once held 80k tokens' activations
            model(mx.broadcast_to(prompt[:, i:i + 1024], (rows, min(1024, context - i))), cache=caches)
            mx.eval([c.state for c in caches])
        return caches

    built: list[float] = []  # per round: the Python of building one step's graph (model() returning, lazy), ms

    def step_ms(kernel_on: bool) -> float:
        conv.ENABLED = kernel_on and kernel_was  # the kernel runs on CUDA only (install enabled it there)
        caches = fresh()
        tok = mx.zeros((rows, 1), dtype=mx.int32) + 5
        mx.synchronize()
        t = time.perf_counter()
        building = 0.0
        for _ in range(steps):
            b = time.perf_counter()
            tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
            building += time.perf_counter() - b
            mx.eval(tok)
        built.append(building * 1e3 / steps)
        return (time.perf_counter() - t) * 1e3 / steps

    one = make_prompt_cache(model)  # one row's caches of the same prompt, the lane batch's rows start from
    model(prompt, cache=one)
    mx.eval([c.state for c in one])

    from models.attention import gpu as lane_attention

    def lane_ms(kernel_on: bool, attention_256: bool = True) -> float:
        """The server's decode batch (RaggedBatch, pipelined as on a GPU) of ``rows`` rows over ``one``'s caches;
        ``attention_256`` False: head size 256 (Qwen3.5's) left out of the fused attention kernel, as before it
        took them (mlx's masked attention then)."""
        conv.ENABLED = kernel_on and kernel_was
        lane_attention._HEAD_SIZES = (64, 128, 256) if attention_256 else (64, 128)
        lane = RaggedBatch(model, pipelined=True)
        lane.add([Row(SimpleNamespace(id=r), _clone(one), list(range(context)) + [5]) for r in range(rows)])
        lane.step(), lane.step()
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            lane.step()
        mx.synchronize()
        return (time.perf_counter() - t) * 1e3 / steps

    out: dict = {"rows": rows, "context": context, "steps": steps, "step_ms": {"conv_kernel": [], "conv_cudnn": []},
                 "lane_step_ms": {"conv_kernel": [], "conv_cudnn": [], "conv_kernel, attention 256 masked": []}}
    kernel_was = conv.ENABLED
    step_ms(True), step_ms(False)  # warm-up: both paths' shapes
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            out["step_ms"]["conv_kernel" if on else "conv_cudnn"].append(round(step_ms(on), 3))
    out["lane_attention_modules"] = lane_attention.install(model)  # as the server does on CUDA: the fused kernel
    lane_variants = {"conv_kernel": (True, True), "conv_cudnn": (False, True),
                     "conv_kernel, attention 256 masked": (True, False)}
    for on, a256 in lane_variants.values():
        lane_ms(on, a256)
    for r in range(rounds):
        for name in (list(lane_variants) if r % 2 == 0 else list(reversed(lane_variants))):
            out["lane_step_ms"][name].append(round(lane_ms(*lane_variants[name]), 3))
    lane_attention._HEAD_SIZES = (64, 128, 256)
    out["lane_median_ms"] = {k: statistics.median(v) for k, v in out["lane_step_ms"].items() if v}
    conv.ENABLED = kernel_was
    R["decode"] = out  # kept if the parts below run out of memory
    del one
    mx.clear_cache()
    out["median_ms"] = {k: statistics.median(v) for k, v in out["step_ms"].items() if v}
    out["graph_build_ms"] = round(statistics.median(built), 3)  # host time of a step's model() call, every round
    print(f"decode {rows} rows: mlx-lm's caches {out['median_ms']}, building a step's graph {out['graph_build_ms']} ms;"
          f" the lane's ragged batch {out['lane_median_ms']}", flush=True)

    try:
        _decode_parts(model, rows, parts_reps, fresh, out)
    except RuntimeError as exc:  # the device's memory: the step timings above stand
        out["parts_error"] = str(exc)[:300]
        print(f"decode parts not measured: {exc}", flush=True)
    return out


def _decode_parts(model, rows: int, parts_reps: int, fresh, out: dict) -> None:
    import mlx.core as mx

    # each part alone at the decode shape, queued parts_reps deep and evaluated once
    inner = getattr(model, "language_model", model)
    inner = getattr(inner, "model", inner)
    layers = inner.layers
    caches = fresh()
    hidden = mx.random.normal((rows, 1, layers[0].input_layernorm.weight.shape[0])).astype(
        layers[0].input_layernorm.weight.dtype)
    mx.eval(hidden)

    def queued(fn) -> float:
        fn()
        mx.synchronize()
        t = time.perf_counter()
        outs = [fn() for _ in range(parts_reps)]
        mx.eval(outs)
        return (time.perf_counter() - t) * 1e3 / parts_reps

    parts: dict = {}
    lin = next((i for i, layer in enumerate(layers) if getattr(layer, "is_linear", False)), None)
    full = next((i for i, layer in enumerate(layers) if not getattr(layer, "is_linear", True)), None)
    counts = {"linear mixer": sum(bool(getattr(x, "is_linear", False)) for x in layers),
              "attention mixer": sum(not getattr(x, "is_linear", True) for x in layers), "mlp": len(layers),
              "norm + head": 1, "whole layer (linear)": 0}
    if lin is not None:  # without a cache: a zero state and window of the same shapes
        parts["linear mixer"] = queued(lambda: layers[lin].linear_attn(hidden, None, None))
        parts["whole layer (linear)"] = queued(lambda: layers[lin](hidden, None, None))
    if full is not None:
        from mlx_lm.models.base import create_attention_mask

        kv = caches[full]

        def attn():
            out = layers[full].self_attn(hidden, create_attention_mask(hidden, kv), kv)
            kv.offset -= 1  # the same cached length every call
            return out
        parts["attention mixer"] = queued(attn)
    parts["mlp"] = queued(lambda: layers[0].mlp(hidden))
    head = getattr(getattr(model, "language_model", model), "lm_head", None)
    if head is not None:
        parts["norm + head"] = queued(lambda: head(inner.norm(hidden)))
    out["parts_ms_each"] = {k: round(v, 4) for k, v in parts.items()}
    out["parts_ms_per_step"] = {k: round(v * counts.get(k, 0), 3) for k, v in parts.items() if counts.get(k)}
    out["parts_ms_per_step_sum"] = round(sum(out["parts_ms_per_step"].values()), 3)
    print(f"decode parts (ms each): {out['parts_ms_each']}; per step: {out['parts_ms_per_step']} "
          f"(sum {out['parts_ms_per_step_sum']})", flush=True)


def prefill_part(model, context: int, chunk: int, together: int, reps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    from models.kernels import conv

    def tokens(n: int, seed: int) -> list[int]:
        return [(7 * i + 13 * seed + 3) % 40000 + 100 for i in range(n)]

    def cache_of(length: int, seed: int) -> list:
        caches = make_prompt_cache(model)
        for s in range(0, length, 2048):
            model(mx.array(tokens(length, seed)[s: s + 2048])[None], cache=caches)
            mx.eval([c.state for c in caches])
        return caches

    shift, fixed = [0], [False]

    def new_shift() -> int:
        if fixed[0]:  # the "shape seen" variant: the same lengths every rep
            return 0
        shift[0] += 1
        return shift[0]

    def solo(clear: bool) -> float:
        s = new_shift()
        caches = cache_of(context + s, s)
        mx.synchronize()
        t = time.perf_counter()
        model(mx.array(tokens(chunk + s, s + 1))[None], cache=caches)
        mx.eval([c.state for c in caches])
        if clear:
            mx.clear_cache()
        return time.perf_counter() - t

    def gathered(clear: bool) -> float:
        s = new_shift()
        rows = [cache_of(context + 37 * i + s, i) for i in range(together)]
        m = chunk + s
        mx.synchronize()
        t = time.perf_counter()
        batch = PromptProcessingBatch(model, list(range(together)), rows, tokens=[[] for _ in rows],
                                      prefill_step_size=m)
        batch.prompt([tokens(m, 50 + i) for i in range(together)])
        caches = [batch.extract_cache(i) for i in range(together)]
        mx.eval([c.state for row in caches for c in row])
        del batch
        if clear:
            mx.clear_cache()
        return time.perf_counter() - t

    from models.attention import composed
    from models.attention import gpu as lane_attention

    lane_attention.install(model)  # as the server does on CUDA (composed attention for 2..8 queries past a cache)
    kernel_was = conv.ENABLED
    # name: (convolution kernel, clear_cache after, composed attention up to N queries, each rep a new shape)
    variants = {"kernel": (True, True, 8, True), "cudnn conv": (False, True, 8, True),
                "kernel, no clear_cache": (True, False, 8, True), "kernel, composed <= 512": (True, True, 512, True),
                "kernel, shape seen": (True, True, 8, False)}
    res: dict = {"context": context, "chunk": chunk, "together": together, "solo_ms": {}, "together_ms": {}}

    def use(name: str) -> tuple[bool, bool]:
        on, clear, composed_max, new = variants[name]
        conv.ENABLED = on and kernel_was
        composed.configure(composed_max)
        fixed[0] = not new
        return clear, new

    for name in variants:  # warm-up: every variant's kernels
        clear, _ = use(name)
        solo(clear), gathered(clear)
    for r in range(reps):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            clear, _ = use(name)
            res["solo_ms"].setdefault(name, []).append(ms(solo(clear)))
            res["together_ms"].setdefault(name, []).append(ms(gathered(clear)))
    composed.configure(8)
    conv.ENABLED = kernel_was
    res["median"] = {part: {k: statistics.median(v) for k, v in res[part].items()}
                     for part in ("solo_ms", "together_ms")}
    res["tok_s"] = {"solo": {k: round(chunk / v * 1e3, 1) for k, v in res["median"]["solo_ms"].items()},
                    "together": {k: round(together * chunk / v * 1e3, 1)
                                 for k, v in res["median"]["together_ms"].items()}}
    print(f"prefill {chunk} after {context}, each a new shape: {json.dumps(res['median'])}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=16, help="decode batch rows")
    ap.add_argument("--decode-context", type=int, default=5000, help="each decode row's cached tokens")
    ap.add_argument("--steps", type=int, default=32, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts-reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--chunk", type=int, default=330)
    ap.add_argument("--together", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: conv, decode, prefill")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    import mlx.core as mx

    from gpu_window_solo import build
    from models import kernels
    from models.kernels import _device

    on_cuda = _device() == "cuda"
    R.update({"device": str(mx.default_device()), "cuda": on_cuda, "argv": sys.argv[1:], "shape": args.shape})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "gpu_hybrid_parts.json").write_text(json.dumps(R, indent=1))

    t0 = time.perf_counter()
    model, cfg = build(args.shape, args.dtype)
    R["installed"] = kernels.install(model)
    mx.eval(model.parameters())
    R["build_s"] = round(time.perf_counter() - t0, 1)
    print(f"built {args.shape} in {R['build_s']}s ({kernels.kernel_path(model)})", flush=True)
    if "conv" not in skip:
        channels = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + \
            cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        R["conv"] = conv_part(on_cuda, channels, cfg.get("linear_conv_kernel_dim", 4), args.reps * 4)
        save()
    if "decode" not in skip:
        R["decode"] = decode_part(model, args.rows, args.decode_context, args.steps, args.rounds, args.parts_reps)
        save()
    if "prefill" not in skip:
        R["prefill"] = prefill_part(model, args.context, args.chunk, args.together, args.reps)
        save()
    ok = all(r.get("ok", True) for r in R.get("conv", {}).get("check", []))
    print(json.dumps({"conv_ok": ok, "decode": R.get("decode", {}).get("median_ms"),
                      "parts": R.get("decode", {}).get("parts_ms_per_step"),
                      "prefill": R.get("prefill", {}).get("tok_s")}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
