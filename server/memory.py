"""The server's memory, assembled from the command line and the device: the admission budget (server.lane.budget)
with what it counts, and MLX's allocator limits on a CUDA GPU (server.sizes.apply_allocator_limits).

One job: wiring numbers and hooks together. The policy is server.lane.budget's (who is admitted, what the RAM tier
yields); the sizes and defaults are server.sizes'.
"""

from __future__ import annotations

import logging

log = logging.getLogger("mlx_lane")

__all__ = ["build_memory_budget"]


def build_memory_budget(cfg, engine, prompt_cache, extra_weights=lambda: 0):
    """Admission by memory (``MemoryBudget``): --memory-budget, or the device's default; then MLX's allocator
    limits at that budget (a CUDA GPU only). ``extra_weights()``: the weights of the on-demand models loaded now
    (server.pool)."""
    from server.lane.budget import MemoryBudget
    from server.sizes import apply_allocator_limits, default_memory_budget

    if cfg.memory_budget is None:
        budget, why = default_memory_budget()
    else:
        budget, why = cfg.memory_budget, "--memory-budget"
    weights = engine.weights_nbytes()
    price = engine.kv_price_estimate()
    if budget:
        log.info("memory budget %.2f GiB (%s): weights %.2f GiB, KV %.1f KiB per token + %.1f MiB per sequence; a "
                 "request waits until its KV for prompt + max_tokens fits", budget / (1 << 30), why,
                 weights / (1 << 30), price.per_token / 1024, price.per_sequence / (1 << 20))
    # a GPU: MLX's cache of freed buffers yields at the budget; the CUDA pool under it keeps --cuda-pool-keep
    limits = apply_allocator_limits(budget, pool_keep_bytes=cfg.cuda_pool_keep)
    if limits is not None:
        kept = limits["pool_keep_bytes"]
        log.info("MLX allocator: memory limit %.1f GiB, buffer cache at most %.1f GiB, CUDA pool keeps %s",
                 limits["limit_bytes"] / (1 << 30), limits["cache_limit_bytes"] / (1 << 30),
                 "nothing freed (the driver's default)" if kept is None else f"{kept / (1 << 30):.1f} GiB freed")
        if kept is None and cfg.cuda_pool_keep is not None:
            log.warning("--cuda-pool-keep: the CUDA driver did not take the pool's release threshold; ignored")
    return MemoryBudget(budget, price, fixed_bytes=lambda: weights + extra_weights(),
                        cache_bytes=_held_bytes(prompt_cache),
                        make_room=prompt_cache.make_room, measured_bytes=_measured_bytes())


def _measured_bytes():
    """On a GPU, MLX's active memory: admission checks its accounting against it (server.lane.budget); None on the
    CPU, whose RAM the OS shares with everything else (the accounting alone decides there)."""
    from server.sizes import device_memory

    if device_memory()[1] == "physical RAM":
        return None
    import mlx.core as mx

    return lambda: int(mx.get_active_memory())


def _held_bytes(prompt_cache):
    """What the prefix cache holds in memory, for admission: the RAM tier and, with an SSD tier, its pending spills
    (``TieredCache.held_bytes``); a cache without them (no SSD tier, a sharded wrapper) counts its RAM entries."""
    held = getattr(prompt_cache, "held_bytes", None)
    if held is not None:
        return held
    return lambda: int(prompt_cache.stats().get("bytes", 0) or 0)
