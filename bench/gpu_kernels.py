"""models.kernels on the device (issue 43): each CUDA kernel against mlx-lm's reference, then their speed, then a
hybrid model's prefill and decode with them vs with mlx-lm's functions, in one process.

1. check: ``gated_delta.recurrent`` vs mlx-lm's ``gated_delta_ops`` (float32 inputs: max |diff| <= 1e-4; bf16
   inputs: <= 2e-2 on outputs of unit scale), scalar and vector gates, with and without a padding mask, T = 1, 3, 300;
   ``gated_delta.chunked`` the same way (on a CUDA GPU <= 2e-3: its float32 products run in TF32 there);
   ``ssm.step`` vs mlx-lm's ``ssm_attn`` for one token (relative to the output's scale).
2. speed of the gated delta rule at Qwen3.5-9B's head sizes (16 key / 32 value heads of 128): a decode step of 16
   rows (ops vs recurrent) and a prompt of --prompt-tokens (ops on a 256-token slice, recurrent, chunked).
3. the --shape model (random bf16 weights): one prompt of --prompt-tokens prefilled, then --decode-tokens decode steps
   of a 16-row batch, with mlx-lm's functions and with ours (``models.kernels.mlx_lm_kernels`` switches between
   them), alternated.

    bash bench/gpu.sh bench/gpu_kernels.py                         # the H200 (~3 min after the wheels)
    python bench/gpu_kernels.py --shape qwen3.5-tiny --dtype float32 --prompt-tokens 128 --decode-tokens 4 \\
        --check-only                                               # the CPU: logic only (no CUDA kernel runs)

Writes OUT/gpu_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu  # noqa: E402

R: dict = {"script": "bench/gpu_kernels.py"}


def timed(fn, reps: int = 3) -> float:
    """Median seconds of ``fn()`` (which evaluates its outputs) after one warm-up call (common.median_seconds)."""
    from common import median_seconds

    return median_seconds(fn, reps)


def gd_inputs(B, T, Hk, Hv, Dk, Dv, dtype, vector=False, seed=0):
    import mlx.core as mx
    from mlx_lm.models.gated_delta import compute_g, normalize_qk

    mx.random.seed(seed)
    q, k = normalize_qk(mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk)), inv_scale=Dk ** -0.5,
                        eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    if vector:
        g = compute_g(0.5 * mx.random.normal((Hv, 1)), mx.random.normal((B, T, Hv, Dk)),
                      mx.random.normal((Hv, Dk)))
    else:
        g = compute_g(0.5 * mx.random.normal((Hv,)), mx.random.normal((B, T, Hv)), mx.random.normal((Hv,)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    return [x.astype(dtype) for x in (q, k, v)] + [g, beta.astype(dtype), state]


def check(on_cuda: bool) -> dict:
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops
    from mlx_lm.models.ssm import compute_dt, ssm_attn

    from models.kernels import gated_delta, ssm

    rows = []
    for dtype, tol in ((mx.float32, 1e-4), (mx.bfloat16, 2e-2)):
        for vector in (False, True):
            for masked in (False, True):
                for T in (1, 3, 300):
                    B, Hk, Hv, D = 2, 2, 4, 128
                    q, k, v, g, beta, state = gd_inputs(B, T, Hk, Hv, D, D, dtype, vector)
                    mask = (mx.arange(T)[None, :] >= mx.array([[0], [min(2, T - 1)]])) if masked else None
                    y0, s0 = gated_delta_ops(q, k, v, g, beta, state, mask)
                    valid = mx.ones(y0.shape[:2], dtype=mx.bool_) if mask is None else mask
                    paths = {}
                    if on_cuda:
                        paths["recurrent"] = gated_delta.recurrent(q, k, v, g, beta, state, mask)
                    if not vector:
                        paths["chunked"] = gated_delta.chunked(q, k, v, g, beta, state, mask)
                    for name, (y1, s1) in paths.items():
                        # the chunked form's float32 products run in TF32 on a CUDA GPU (~1e-3 relative)
                        limit = 2e-3 if name == "chunked" and on_cuda else tol
                        dy = mx.where(valid[:, :, None, None], mx.abs(y1.astype(mx.float32) - y0.astype(mx.float32)),
                                      0.0).max().item()
                        ds = mx.abs(s1 - s0).max().item()
                        rows.append({"kernel": name, "dtype": str(dtype), "vector": vector, "masked": masked, "T": T,
                                     "y_diff": dy, "state_diff": ds, "ok": dy <= limit and ds <= limit})
    if on_cuda:
        for dtype, tol in ((mx.float32, 1e-4), (mx.bfloat16, 2e-2)):
            mx.random.seed(3)
            n, h, d, groups, ds_ = 4, 8, 64, 2, 128
            x = mx.random.normal((n, 1, h, d)).astype(dtype)
            A_log = mx.random.normal((h,))
            Bm = mx.random.normal((n, 1, groups, ds_)).astype(dtype)
            Cm = mx.random.normal((n, 1, groups, ds_)).astype(dtype)
            D = mx.random.normal((h,)).astype(dtype)
            dt = mx.random.normal((n, 1, h))
            dt_bias = mx.random.normal((h,))
            state = mx.random.normal((n, h, d, ds_))
            y0, s0 = ssm_attn(x, A_log, Bm, Cm, D, dt, dt_bias, state, (0.001, 100.0))
            y1, s1 = ssm.step(x, A_log, Bm, Cm, D, compute_dt(dt, dt_bias, (0.001, 100.0)), state)
            # relative to the output's scale: |y| reaches ~50 here, where one bf16 ulp is 0.25
            scale = max(1.0, mx.abs(y0.astype(mx.float32)).max().item())
            dy = mx.abs(y1.astype(mx.float32) - y0.astype(mx.float32)).max().item() / scale
            dst = mx.abs(s1 - s0).max().item() / max(1.0, mx.abs(s0).max().item())
            rows.append({"kernel": "ssm.step", "dtype": str(dtype), "y_rel_diff": dy, "state_rel_diff": dst,
                         "ok": dy <= tol and dst <= tol})
    for r in rows:
        print(("ok  " if r["ok"] else "BAD ") + json.dumps(r), flush=True)
    return {"rows": rows, "all_ok": all(r["ok"] for r in rows)}


def speed(on_cuda: bool, prompt_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    from models.kernels import gated_delta

    res: dict = {}
    Hk, Hv, D = 16, 32, 128
    q, k, v, g, beta, state = gd_inputs(16, 1, Hk, Hv, D, D, mx.bfloat16)
    res["decode_16_rows_ms"] = {"ops": 1e3 * timed(lambda: mx.eval(gated_delta_ops(q, k, v, g, beta, state)))}
    if on_cuda:
        res["decode_16_rows_ms"]["recurrent"] = 1e3 * timed(
            lambda: mx.eval(gated_delta.recurrent(q, k, v, g, beta, state)))
    T = prompt_tokens
    q, k, v, g, beta, state = gd_inputs(1, T, Hk, Hv, D, D, mx.bfloat16)
    s = min(T, 256)
    ops_s = timed(lambda: mx.eval(gated_delta_ops(q[:, :s], k[:, :s], v[:, :s], g[:, :s], beta[:, :s], state)), 1)
    res["prompt_tok_s"] = {"tokens": T, "ops (on a 256-token slice)": s / ops_s,
                           "chunked": T / timed(lambda: mx.eval(gated_delta.chunked(q, k, v, g, beta, state)))}
    if on_cuda:
        res["prompt_tok_s"]["recurrent"] = T / timed(lambda: mx.eval(gated_delta.recurrent(q, k, v, g, beta, state)))
    print(json.dumps(res), flush=True)
    return res


def model_speed(shape: str, dtype: str, prompt_tokens: int, decode_tokens: int, rounds: int) -> dict:
    """A prompt prefilled and a 16-row decode batch, mlx-lm's functions vs ours, alternated."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gpu_window_solo import build
    from models import kernels

    t0 = time.perf_counter()
    model, _ = build(shape, dtype)
    installed = kernels.install(model)
    print(f"built {shape} in {time.perf_counter() - t0:.1f}s; {installed} modules switched "
          f"({kernels.kernel_path(model)})", flush=True)
    prompt = mx.array([[(7 * i + 3) % 40000 + 100 for i in range(prompt_tokens)]])
    rows = 16

    def prefill() -> float:
        caches = make_prompt_cache(model)
        t = time.perf_counter()
        for i in range(0, prompt_tokens, 2048):
            model(prompt[:, i:i + 2048], cache=caches)
            mx.eval([c.state for c in caches])
        return prompt_tokens / (time.perf_counter() - t)

    def decode() -> float:
        caches = make_prompt_cache(model)
        model(mx.broadcast_to(prompt[:, :64], (rows, 64)), cache=caches)
        mx.eval([c.state for c in caches])
        tok = mx.zeros((rows, 1), dtype=mx.int32) + 5
        t = time.perf_counter()
        for _ in range(decode_tokens):
            logits = model(tok, cache=caches)
            tok = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(tok)
        return rows * decode_tokens / (time.perf_counter() - t)

    def under(which: str, fn):
        if which == "ours":
            return fn()
        with kernels.mlx_lm_kernels(model):
            return fn()

    out: dict = {"prefill_tok_s": {"mlx_lm": [], "ours": []}, "decode16_tok_s": {"mlx_lm": [], "ours": []}}
    for which in ("mlx_lm", "ours"):  # warm-up (compiles)
        under(which, prefill)
        under(which, decode)
    for r in range(rounds):
        for which in (("mlx_lm", "ours") if r % 2 == 0 else ("ours", "mlx_lm")):
            out["prefill_tok_s"][which].append(round(under(which, prefill), 1))
            out["decode16_tok_s"][which].append(round(under(which, decode), 1))
        print(f"round {r + 1}: " + json.dumps(out), flush=True)
    out["median"] = {k: {w: statistics.median(v) for w, v in d.items()} for k, d in out.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(gpu.SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--check-only", action="store_true", help="the reference checks alone")
    args = ap.parse_args()

    import mlx.core as mx

    from models.kernels import _device

    on_cuda = _device() == "cuda"
    R.update({"device": str(mx.default_device()), "cuda": on_cuda, "argv": sys.argv[1:]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    R["check"] = check(on_cuda)
    (out / "gpu_kernels.json").write_text(json.dumps(R, indent=1))
    if not args.check_only:
        R["speed"] = speed(on_cuda, args.prompt_tokens)
        (out / "gpu_kernels.json").write_text(json.dumps(R, indent=1))
        R["model"] = model_speed(args.shape, args.dtype, args.prompt_tokens, args.decode_tokens, args.rounds)
        (out / "gpu_kernels.json").write_text(json.dumps(R, indent=1))
    print(json.dumps({"all_ok": R["check"]["all_ok"], "model": R.get("model", {}).get("median")}))
    return 0 if R["check"]["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
