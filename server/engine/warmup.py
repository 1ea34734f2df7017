"""The warm-up: the weights paged in and the kernels the first requests use compiled, as an ordered list of short
steps the lane runs on its thread (server.lane.warm: before ready, or behind the requests while the lane is idle);
and the start-up check that this device can attend over a quantized KV cache."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import mlx.core as mx

from server.engine.batch import BatchKind, Layout, Row, choose, make
from server.engine.prefill import forward_together
from server.engine.sampling import build_sampler, sample_rows
from server.engine.slot import ModelSlot
from server.engine.speculation import Speculation
from server.lane.events import SamplingParams
from server.lane.seam import WarmStep
from spec import FixedDraftLength, speculative_decode

__all__ = ["warm_up_steps", "check_kv_quantization"]


def warm_up_steps(slot: ModelSlot, layout: Layout, prefill_chunk: int, stream,
                  speculation: Optional[Speculation] = None) -> list[WarmStep]:
    """The steps, in order: the weights; a prefill; one-token steps over its cache; a short prompt's tokens drawn by
    each kind of sampler (greedy and mlx-lm's compiled draws, one row and two: three steps); a batched step of two
    rows; on a
    GPU, for a model whose prompts prefill together, a batched prefill of two padded rows, cold and past cached
    prefixes (a chunk, then a tail of a few tokens); on a GPU, when the server speculates, a request's speculative
    rounds on its own (``speculative_rounds``). So the first requests pay none of it. On a GPU the prefill is two whole
    --prefill-chunk chunks, the second over the first's cache (MLX compiles a kernel per shape: the first 2048-token
    chunk of a cold process cost 1.5-2x a warm one on the H200), one step each, so that no step is longer than one
    chunk's forward; on the CPU, where nothing is compiled, 8 tokens do. Each step runs on ``stream`` (the lane's);
    the prefill's cache is held from the first prefill step to the one-token steps, and dropped there."""
    gpu, model = layout.gpu, slot.model
    held: dict = {}  # caches between the steps that grow them (the prefill's; the gathered rows past a cache)

    def on_stream(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with mx.stream(stream):
                fn()
        return run

    def weights() -> None:
        mx.eval(model.parameters())

    def prefill(part: int) -> Callable[[], None]:
        # on a GPU two chunks: a prompt's later chunks attend over the cache the first ones left (a query shorter
        # than its keys: other kernels than the first chunk's)
        def run() -> None:
            caches = held.setdefault("caches", slot.new_caches())
            n = prefill_chunk if gpu else 8
            mx.eval(model(mx.array([[(i % 1000) + 1 + part for i in range(n)]]), cache=caches))
        return run

    def one_token_steps() -> None:
        caches = held.pop("caches")
        for _ in range(4 if gpu else 1):
            mx.eval(model(mx.array([[1]]), cache=caches))

    def sampling(*params: SamplingParams) -> Callable[[], None]:
        # a short prompt's forward, then its tokens drawn: log-probabilities from the last position's logits and the
        # request's sampler (greedy; mlx-lm's compiled draws), alone (a solo decode) and over two rows (a batch draws
        # its rows in one call). No other step did: on an H100 a kernel warmer's sampling chain compiled 9 modules in
        # 33 s (BENCHMARKS.md, 2026-12-07, fifteenth session), so it is three steps, each a few samplers
        def run() -> None:
            logits = model(mx.array([[1, 2, 3]]), cache=slot.new_caches())[:, -1, :]
            rows = mx.concatenate([logits, logits], axis=0)
            one = logits - mx.logsumexp(logits, keepdims=True)
            both = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
            for p in params:
                sampler = build_sampler(p)
                mx.eval(sampler(one), one, sample_rows(both, [sampler, sampler]), both)
        return run

    def batched_step() -> None:
        batch = make(kind, model, layout, stream, slot.facts.caches)
        rows = []
        for n in (3, 5):
            c = slot.new_caches()
            mx.eval(model(mx.array([list(range(1, n))]), cache=c))
            rows.append(Row(object(), c, list(range(1, n + 1))))
        batch.add(rows)
        for _ in range(2):
            batch.step()
        batch.remove(batch.sequences)

    def batched_prefill() -> None:
        # batched prefill (--prefill-batch): padded rows attend through a mask, not the causal fast path: other
        # kernels to compile before the first request
        forward_together(model, [slot.new_caches(), slot.new_caches()], [list(range(1, 6)), list(range(1, 10))])

    def batched_prefill_past_a_cache() -> None:
        # agents' next turns: rows of different cached lengths (merged left-padded) take a chunk together, then the
        # few tokens of a prompt's tail (the generation prompt; a chunk of up to 8 queries attends in
        # models.attention.composed on CUDA). Each is new kernels: on the H100 a Qwen3.5-9B server's first such
        # forwards took 6.1 s and 4.2 s against ~0.1 s later (bench/gpu_agents.py, 2026-12-06)
        rows = []
        for n in (6, 11):
            c = slot.new_caches()
            mx.eval(model(mx.array([list(range(1, n + 1))]), cache=c))
            rows.append(c)
        held["rows"] = forward_together(model, rows, [list(range(20, 32)), list(range(40, 61))])

    def batched_tail_past_a_cache() -> None:
        # a step of its own: each compiles for seconds on a GPU, and a request that comes waits for the step running
        # tails of different lengths (right-padded: masked paths) and of one length (no padding: the unmasked ones;
        # on the H100 a first 2 x 3-token tail past ~5.9k cached tokens still took 3.3 s after the padded one ran)
        rows = forward_together(model, held.pop("rows"), [[7, 8, 9], [7, 8]])
        forward_together(model, rows, [[4, 5, 6], [4, 5, 6]])

    def speculative_rounds() -> None:
        # a request speculating alone (every hybrid's and window model's, and any alone): verify forwards of 1 +
        # drafts tokens, its draft's own forwards (MTP heads, a draft model) and taking rejected drafts back (a hybrid
        # chooses its recorded state: models.kernels.positions). On the H200 the first request of a Qwen3.5-9B server
        # with --draft-kind mtp took 18.5 s against 2.0 s for the plain server's (bench/gpu_mtp.py, 2026-12-07)
        assert speculation is not None
        n = speculation.wanted(None, slot.facts)
        if not n:
            return
        prompt = [3, 4, 5, 6] * 4  # a repeat, so the n-gram draft proposes too
        caches = slot.new_caches()
        plan = speculation.open(None, (), n)
        source = plan.source
        mx.eval(model(mx.array([prompt[:-1]]), cache=caches))
        if getattr(source, "hears_hidden", False):
            source.heard(0, prompt[:-1])
        source.prefill(prompt[:-1])
        for _ in speculative_decode(model, caches, prompt[-1], source, max_tokens=2 * (n + 1), num_draft_tokens=n,
                                    stream=stream, policy=FixedDraftLength(n), pipelined=False):
            pass

    steps = [WarmStep("weights", weights)]
    steps += [WarmStep(f"prefill chunk {part + 1}", prefill(part), "prefill") for part in range(2 if gpu else 1)]
    steps.append(WarmStep("one-token steps", one_token_steps, "prefill"))
    steps += [WarmStep("short prompt, greedy and temperature", sampling(SamplingParams(1, 0.0), SamplingParams(1, 0.7)),
                       "sampling"),
              WarmStep("sampling with top-p", sampling(SamplingParams(1, 0.7, top_p=0.9)), "sampling"),
              WarmStep("sampling with top-k and min-p", sampling(SamplingParams(1, 0.7, top_k=20, min_p=0.05)),
                       "sampling")]
    kind = choose(layout, slot.facts.caches, speculating=False)
    if kind != BatchKind.SOLO:
        steps.append(WarmStep(f"batched step ({kind.value})", batched_step, "batched step"))
    if gpu and slot.facts.prefills_together:  # what the lane gathers into batched forwards (classify)
        steps.append(WarmStep("batched prefill", batched_prefill, "batched prefill"))
        steps.append(WarmStep("batched prefill past a cache", batched_prefill_past_a_cache, "past a cache"))
        steps.append(WarmStep("batched tail past a cache", batched_tail_past_a_cache, "past a cache"))
    if gpu and speculation is not None and speculation.wanted(None, slot.facts):
        steps.append(WarmStep("speculative rounds", speculative_rounds, "speculative rounds"))
    # the warm-up's buffers back to the device: its caches are garbage by now
    steps.append(WarmStep("free buffers", mx.clear_cache))
    return [replace(s, run=on_stream(s.run)) for s in steps]


def check_kv_quantization(slot: ModelSlot) -> None:
    """Refuse to start when this device's MLX, or this model's attention, cannot attend over a quantized KV cache.

    Seen on the H200 (mlx-cuda 0.32.4): `quantized_matmul` has no CUDA kernel for the attention shapes ("No
    implementation for problem shape"), so every request would fail with a 500. A few-token forward (odd lengths, as
    real prompts have) on the default device finds out before the port opens."""
    from models import ModelLoadError

    caches = slot.new_caches()
    try:
        for n in (3, 5):
            mx.eval(slot.model(mx.array([list(range(1, n + 1))]), cache=caches))
    except Exception as exc:  # whatever the forward raised: an MLX kernel missing (RuntimeError, ValueError) or a
        # model whose attention cannot read mlx-lm's quantized cache (MLA: AttributeError on its (data, scales) tuple)
        first = (str(exc).splitlines() or [""])[0][:200].rstrip(".")
        raise ModelLoadError(
            f"--kv-bits {slot.kv_bits} is not supported for this model by mlx {getattr(mx, '__version__', '?')} / "
            f"mlx-lm on this "
            f"device ({mx.default_device()}): {type(exc).__name__}: {first}. Start without --kv-bits "
            "(the KV cache then stays in the model's dtype).") from exc
