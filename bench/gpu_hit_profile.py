"""Where the time of a prefix-cache hit goes (issue 12, "the latency of a hit"), in-process, no HTTP.

For each context length L: prefill a random L-token prompt, then time, each the median of --rounds:
  raw_step      one-token forward + argmax over those caches (mlx-lm, right after the prefill: the floor)
  put           PromptCache.put of the prompt's caches (fork + eval)
  take          PromptCache.take of prompt + 1 new token (find + fork, views)
  first_forward the new token's forward over the taken caches (the first write copies the shared KV buffer:
                copy-on-write, see cache/copying.py)
  engine_first  the lane's whole path for that request: Engine.admit (take) + Engine.prefill + the first
                Engine.step_solo token, on the model with the server's computing paths installed
                (models.loading.load.install_paths: on the CPU and CUDA an attention that reads a hit's cached
                segments where they lie, as served; raw_step and first_forward put mlx-lm's attention back for
                their figures, its attention only: a hybrid's installed kernels stay; --paths mlx: mlx-lm's model
                as loaded throughout)
  http_parse    what the handler does before the lane for a /v1/completions body of L token ids: orjson + pydantic
                + the id check (off the lane, but inside a served TTFT)
Ratios: engine_first / raw_step (target <= 2x on the H200, <= 1.3x on the CPU).

    python bench/gpu_hit_profile.py --model-dir /dev/shm/mlx-lane-bench-model --lengths 8192,32768
    python bench/gpu_hit_profile.py --model-dir ~/.cache/mlx-lane/models/SmolLM2-135M-Instruct --lengths 1024
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, rounds: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(rounds):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--paths", choices=("served", "mlx"), default="served",
                    help="served: engine_first runs on the model with the server's paths installed (as served); "
                         "mlx: on mlx-lm's model as loaded (the copy-on-write first write of a hit's caches)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import mlx.core as mx
    import orjson
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from cache.prompt_cache import PromptCache
    from server.core.prompts import tokenize_completion
    from server.core.request import GenerationRequest
    from models import device_name
    from models.attention import reads_segments
    from models.hook import ATTENTION, restore
    from models.loading.load import install_paths
    from server.engine.batch import Layout
    from server.engine.engine import Engine, EngineConfig
    from server.http.chat.schemas import CompletionRequest
    from server.lane.events import SamplingParams
    from server.lane.sequence import FinishReason, Phase, Sequence
    from server.stats import ServingStats

    model, tokenizer = load(args.model_dir)
    if args.paths == "served":
        install_paths(model)
    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, fingerprint="ns")
    rng = random.Random(0)
    result = {"model_dir": args.model_dir, "device": str(mx.default_device()), "mlx": mx.__version__, "lengths": {},
              "paths": args.paths, "reads_segments": reads_segments(model)}
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        for L in [int(x) for x in args.lengths.split(",")]:
            prompt = [rng.randrange(100, 20000) for _ in range(L)]
            caches = make_prompt_cache(model)
            t = time.perf_counter()
            for i in range(0, L - 1, args.chunk):
                model(mx.array(prompt[i: min(i + args.chunk, L - 1)])[None], cache=caches)
                mx.eval([c.state for c in caches])
            prefill_s = time.perf_counter() - t

            def raw_step():
                y = mx.argmax(model(mx.array([[prompt[-1]]]), cache=caches)[:, -1, :], axis=-1)
                mx.eval(y)
                trim_prompt_cache(caches, 1)
                return y

            undone = restore(model, ATTENTION)  # the raw figures on mlx-lm's own attention
            raw_step()  # warm the shape
            raw_s, _ = timed(raw_step, args.rounds)
            model(mx.array([[prompt[-1]]]), cache=caches)  # caches now cover the whole prompt
            mx.eval([c.state for c in caches])
            pc = PromptCache(1 << 40)
            put_s, _ = timed(lambda: pc.put(prompt, caches, "ns"), 1)
            new = prompt + [123]
            take_s, hit = timed(lambda: pc.take(new, "ns"), args.rounds)

            def first_forward():
                h = pc.take(new, "ns")
                t0 = time.perf_counter()
                mx.eval(mx.argmax(model(mx.array([[123]]), cache=h.caches)[:, -1, :], axis=-1))
                return time.perf_counter() - t0

            fwd = statistics.median(first_forward() for _ in range(args.rounds))
            for module, ours in undone:
                setattr(module, ATTENTION, ours)
            engine = Engine(loaded, pc, ServingStats(),
                            EngineConfig(prefill_chunk=args.chunk, layout=Layout(gpu=device_name() != "cpu")))
            engine.stream = stream

            def engine_first(engine=engine):  # what the lane's executor does for it (server.lane.executor)
                events = []
                params = SamplingParams(max_tokens=2, temperature=0.0)
                target = engine.base_target()
                seq = Sequence(prompt=new, params=params, sink=events.append, target=target,
                               ns=engine.namespace_for(target, params))  # "ns": the loaded fingerprint
                seq.facts = engine.classify(seq)
                admitted = engine.admit(seq)
                seq.start_output(admitted.detokenizer, admitted.eos, admitted.logprob_of)
                seq.cached = seq.covered = admitted.cached
                seq.phase = Phase.PREFILL
                (prefilled,) = engine.prefill([(seq, seq.prefill_left)], store_now=False)
                seq.covered = prefilled.covered
                seq.phase = Phase.SOLO
                engine.step_solo(seq)
                dt = time.perf_counter()
                engine.end([seq])
                seq.finished(FinishReason.CANCELLED)
                return dt, seq.cached

            firsts = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                t_first, cached = engine_first()
                firsts.append(t_first - t0)
            body = orjson.dumps({"prompt": new, "max_tokens": 1})
            parse_s, _ = timed(lambda: tokenize_completion(tokenizer, GenerationRequest(
                prompt=tuple(CompletionRequest.model_validate(orjson.loads(body)).prompt)), 1 << 20), args.rounds)
            row = {"prefill_s": round(prefill_s, 3), "raw_step_ms": raw_s * 1e3, "put_ms": put_s * 1e3,
                   "take_ms": take_s * 1e3, "first_forward_ms": fwd * 1e3,
                   "engine_first_ms": statistics.median(firsts) * 1e3, "cached": cached,
                   "http_parse_ms": parse_s * 1e3}
            row = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}
            row["engine_over_raw"] = round(row["engine_first_ms"] / row["raw_step_ms"], 2)
            result["lengths"][str(L)] = row
            print(L, json.dumps(row), flush=True)
            del caches, pc, hit, engine
            mx.clear_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_hit_profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
