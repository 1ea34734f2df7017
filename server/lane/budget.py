"""Admission by memory: a sequence joins only when its KV fits beside the running ones, the weights and the RAM tier.

``MemoryBudget`` is policy over numbers only: ``budget_bytes`` (``--memory-budget``; 0 turns the check off), the
model's KV price (``KVPrice``: bytes per token, all layers, and bytes per sequence whatever its length: the
recurrent state of a hybrid's linear-attention / SSM layers), ``fixed_bytes`` (what is not ours to free: the
weights; a callable when models load and unload, server.pool), and two hooks of the RAM prefix cache:
``cache_bytes()`` (what it holds now) and ``make_room(n)`` (evict / spill n bytes; the lane calls it, never the
budget). A sequence reserves the KV of its prompt + ``max_tokens``, plus its model's bytes per sequence. The RAM
tier yields first: a sequence that fits once the cache shrinks is admitted, and the plan asks the cache to make
that room.

``measured_bytes()`` (optional; on a GPU, MLX's active memory) checks the accounting against what is really held:
while sequences run, what it reports beyond fixed + reserved + cache (``unaccounted``: the ragged batch's spare
room, pending snapshots, arrays the accounting does not know of) is not free either. On an H100 MLX held 70.9 GB under
a 64.4 GB budget and prefills ran out of device memory (BENCHMARKS.md, 2026-12-06, third session). With nothing
running it is ignored, so the queue always moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["KVPrice", "MemoryBudget"]


@dataclass(frozen=True)
class KVPrice:
    """What a model's caches cost in memory: ``per_token`` bytes for each token they hold (attention layers' KV) and
    ``per_sequence`` bytes for a sequence whatever its length (recurrent state: a hybrid's gated delta-net / Mamba
    layers keep one state per sequence; pricing it per token refused every long prompt on a Qwen3.5)."""

    per_token: float
    per_sequence: float = 0.0

    def of(self, tokens: int) -> int:
        return int(self.per_token * tokens + self.per_sequence)


class MemoryBudget:
    def __init__(self, budget_bytes: int, price: Union[KVPrice, float], *, fixed_bytes: int | Callable[[], int] = 0,
                 cache_bytes: Callable[[], int] = lambda: 0, make_room: Callable[[int], int] = lambda n: 0,
                 measured_bytes: Optional[Callable[[], int]] = None):
        self.budget_bytes = budget_bytes
        self.price = price if isinstance(price, KVPrice) else KVPrice(float(price))
        self._fixed = fixed_bytes
        self.cache_bytes = cache_bytes
        self.make_room = make_room
        self.measured_bytes = measured_bytes
        self.unaccounted = 0  # the last admission's measured bytes beyond the accounting (0 with nothing running)

    @property
    def fixed_bytes(self) -> int:
        return int(self._fixed()) if callable(self._fixed) else self._fixed

    def need(self, prompt_tokens: int, max_tokens: int, price: Optional[KVPrice] = None) -> int:
        """KV bytes of a sequence; ``price``: its model's when not the base model's."""
        return (price or self.price).of(prompt_tokens + max_tokens)

    def never_fits(self, prompt_tokens: int, max_tokens: int, price: Optional[KVPrice] = None) -> Optional[str]:
        """Why a request can never be admitted (None when it can)."""
        if not self.budget_bytes:
            return None
        room = self.budget_bytes - self.fixed_bytes
        need = self.need(prompt_tokens, max_tokens, price)
        if need > room:
            return (f"this request needs about {need / 2**20:.0f} MiB of KV cache for {prompt_tokens} prompt + "
                    f"{max_tokens} completion tokens, more than the server's --memory-budget leaves beside the "
                    f"model ({room / 2**20:.0f} MiB): lower max_tokens or shorten the prompt")
        return None

    def admissible(self, needs: Iterable[int], reserved: int) -> tuple[int, int]:
        """How many of ``needs`` (bytes of the waiting sequences, in queue order) fit now beside ``reserved`` bytes
        of admitted sequences, stopping at the first that does not (no overtaking), and how many bytes the RAM tier
        must yield for them: ``(count, make_room)``."""
        if not self.budget_bytes:
            return sum(1 for _ in needs), 0
        cache = max(0, int(self.cache_bytes()))
        accounted = self.fixed_bytes + reserved + cache
        self.unaccounted = 0
        if self.measured_bytes is not None and reserved > 0:
            self.unaccounted = max(0, int(self.measured_bytes()) - accounted)
        free = self.budget_bytes - accounted - self.unaccounted  # may be negative: the cache is over
        count = yield_ = 0
        for need in needs:
            if need <= free:
                free -= need
            elif need <= free + cache:  # fits once the RAM tier yields what it lacks
                short = need - free
                yield_ += short
                cache -= short
                free = 0
            else:
                break
            count += 1
        return count, yield_
