"""The host's share of a decode step, on this CPU (issue 43): the Python that builds a step, per layout, per shape.

On the H200 a served Qwen3.5-9B step of 15 rows took ~30 ms where the same 16 rows in-process took 18 ms and the
bytes allow ~4: a pipelined step hides the host's work only while it is shorter than the device's. The host's work
does not depend on the layers' widths, only on how many operations a step builds and what the lane does around them,
so this runs each --shapes model with its real layer count and kinds but a few dozen channels (``thin``): a forward's
arithmetic is then microseconds and what a step costs is the host's. Per shape, for --rows rows of --context tokens:

  graph     ``model(tokens, cache)`` returning (the lazy graph built, nothing evaluated), mlx-lm's caches
  raw       the same plus the argmax, evaluated each step (what the graph costs to build and run)
  peer      mlx-lm's ``BatchGenerator`` (mlx_lm.server's decode loop), one ``next()`` per step
  lane      mlx-lane's ragged batch (``RaggedBatch.step``: the forward over its slots, logprobs, sampling, the rows'
            bookkeeping), not pipelined so that each step is timed whole

    python bench/host_step.py --shapes qwen3.5-9b,llama3-8b,gpt-oss-20b --rows 16

Prints one JSON line per shape and writes --out/host_step.json. Quiet machine only (no tests or builds beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

THIN = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "vocab_size": 1024, "moe_intermediate_size": 64, "mamba_head_dim": 16,
        "mamba_num_heads": 8, "ssm_state_size": 32, "n_groups": 2}


def thin(shape: str) -> dict:
    """``shape``'s config (bench/gpu.py) with its layers' kinds and count but few channels."""
    from gpu import SHAPES

    cfg = dict(SHAPES[shape])
    for k, v in THIN.items():
        if k in cfg or k in ("hidden_size", "intermediate_size", "vocab_size"):
            cfg[k] = v
    if shape == "llama3-8b":
        cfg.update(model_type="llama", head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
                   mlp_bias=False, hidden_act="silu")
    return {**cfg, "max_position_embeddings": 131072, "tie_word_embeddings": False}


def build(cfg: dict):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from gpu import random_weights

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    random_weights(model, "float32")
    mx.eval(model.parameters())
    return model


def per_step_ms(fn, steps: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) * 1e3 / steps


def measure(model, rows: int, context: int, steps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from server.engine.batch.protocol import Row
    from server.engine.batch.ragged import RaggedBatch

    prompts = [[(7 * i + 13 * r + 3) % 1000 + 2 for i in range(context)] for r in range(rows)]

    def own_caches(r: int) -> list:
        caches = make_prompt_cache(model)
        model(mx.array(prompts[r][:-1])[None], cache=caches)
        mx.eval([c.state for c in caches])
        return caches

    batch_caches = make_prompt_cache(model)
    model(mx.array([p[:-1] for p in prompts]), cache=batch_caches)
    mx.eval([c.state for c in batch_caches])
    tok = mx.array([[p[-1]] for p in prompts])
    out: dict = {}

    g = make_prompt_cache(model)
    model(mx.array([p[:-1] for p in prompts]), cache=g)
    mx.eval([c.state for c in g])
    out["graph_ms"] = per_step_ms(lambda: model(tok, cache=g), steps)
    del g

    state = {"tok": tok}

    def raw() -> None:
        state["tok"] = mx.argmax(model(state["tok"], cache=batch_caches)[:, -1:], axis=-1)
        mx.eval(state["tok"])
    out["raw_ms"] = per_step_ms(raw, steps)

    gen = BatchGenerator(model, max_tokens=10 * steps + 10, completion_batch_size=rows, prefill_batch_size=rows)
    gen.insert([p[-1:] for p in prompts], caches=[own_caches(r) for r in range(rows)])
    while not gen.next_generated():  # through the prompt phase to the first decode step
        pass
    out["peer_ms"] = per_step_ms(gen.next_generated, steps)
    del gen

    lane = RaggedBatch(model, pipelined=False)
    lane.add([Row(SimpleNamespace(id=r), own_caches(r), prompts[r]) for r in range(rows)])
    out["lane_ms"] = per_step_ms(lane.step, steps)
    del lane
    return {k: round(v, 3) for k, v in out.items()}


def main() -> int:
    from common import ensure_blas_here

    ensure_blas_here()
    import mlx.core as mx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3.5-9b,llama3-8b,gpt-oss-20b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".bench")))
    args = ap.parse_args()
    rec: dict = {"script": "bench/host_step.py", "argv": sys.argv[1:], "mlx": mx.__version__,
                 "device": str(mx.default_device()), "shapes": {}}
    for shape in args.shapes.split(","):
        model = build(thin(shape))
        runs = [measure(model, args.rows, args.context, args.steps) for _ in range(args.rounds)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row = {"layers": len(model.layers), "runs": runs, "median_ms": med,
               "lane_over_raw": round(med["lane_ms"] / med["raw_ms"], 3),
               "lane_over_peer": round(med["lane_ms"] / med["peer_ms"], 3)}
        rec["shapes"][shape] = row
        print(json.dumps({"shape": shape, **{k: v for k, v in row.items() if k != "runs"}}), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "host_step.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
