"""Before the first request: the weights paged in and the kernels the first requests use compiled (lane thread), and
the start-up check that this device can attend over a quantized KV cache."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import KVCache

from server.engine.batch import BatchKind, Layout, Row, choose, make
from server.engine.slot import ModelSlot

__all__ = ["warm_up", "check_kv_quantization"]


def warm_up(slot: ModelSlot, layout: Layout, prefill_chunk: int, stream) -> None:
    """A prefill, one-token steps over a cache, a batched step of two rows and (GPU) a batched prefill of two padded
    rows, so the first request pays none of it. On a GPU the prefill is two whole --prefill-chunk chunks, the second
    over the first's cache (MLX compiles a kernel per shape: the first 2048-token chunk of a cold process cost 1.5-2x
    a warm one on the H200); on the CPU, where nothing is compiled, 8 tokens do."""
    gpu, model = layout.gpu, slot.model
    with mx.stream(stream):
        mx.eval(model.parameters())
        caches = slot.new_caches()
        n = prefill_chunk if gpu else 8
        # on a GPU two chunks: a prompt's later chunks attend over the cache the first ones left (a query shorter
        # than its keys: other kernels than the first chunk's)
        for part in range(2 if gpu else 1):
            mx.eval(model(mx.array([[(i % 1000) + 1 + part for i in range(n)]]), cache=caches))
        for _ in range(4 if gpu else 1):
            mx.eval(model(mx.array([[1]]), cache=caches))
        kind = choose(layout, slot.facts.caches, speculating=False)
        if kind != BatchKind.SOLO:
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
        if gpu and all(type(c) is KVCache for c in caches):  # batched prefill (--prefill-batch): padded rows
            # attend through a mask, not the causal fast path: another kernel to compile before the first request
            group = PromptProcessingBatch(model, [0, 1], [slot.new_caches(), slot.new_caches()],
                                          tokens=[[], []], prefill_step_size=prefill_chunk)
            group.prompt([list(range(1, 6)), list(range(1, 10))])
            mx.eval([c.state for c in group.prompt_cache])
            del group
        mx.clear_cache()


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
