"""Which models stay in memory: the load / evict / idle-unload decisions of the model pool, over numbers only.

``ResidencyPolicy`` decides; ``server.pool.pool.ModelPool`` loads, unloads and counts. The rules:

- A model joins only when, after it, the on-demand models resident number at most ``max_loaded``
  (``--max-loaded-models``; 0: no cap) and their weights fit beside ``fixed_bytes`` (the base model's) under
  ``budget_bytes`` (``--memory-budget``; 0: no cap).
- Room is made by evicting the least recently used models that are neither in use (a running or queued request)
  nor pinned (``--pin``). When that is not enough because models are in use, the load **waits** for one to be
  released (nothing is evicted meanwhile); when it can never be enough (the model is too big beside the base and
  pinned models, or every slot is pinned), it is **refused**, with why.
- ``expired``: models idle (not in use) for ``ttl_s`` (``--model-ttl``; 0: never) are unloaded; pinned never.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

__all__ = ["Resident", "LoadPlan", "ResidencyPolicy"]

GiB = float(1 << 30)


@dataclass(frozen=True)
class Resident:
    """A loaded on-demand model, as the policy sees it."""

    name: str
    nbytes: int  # its weights in memory
    last_used: float  # monotonic seconds of its last lease (acquired or released)
    in_use: int = 0  # requests holding it (queued or running)
    pinned: bool = False


@dataclass(frozen=True)
class LoadPlan:
    evict: tuple[str, ...] = ()  # unload these first, least recently used first
    wait: bool = False  # room comes only when models in use are released: wait, then plan again
    refuse: Optional[str] = None  # it can never fit: why (a 400)

    @property
    def go(self) -> bool:
        return not self.wait and self.refuse is None


class ResidencyPolicy:
    def __init__(self, *, budget_bytes: int = 0, max_loaded: int = 0, ttl_s: float = 0.0, fixed_bytes: int = 0):
        self.budget_bytes = budget_bytes
        self.max_loaded = max_loaded
        self.ttl_s = ttl_s
        self.fixed_bytes = fixed_bytes  # always resident: the base model's weights

    def plan_load(self, name: str, nbytes: int, resident: Iterable[Resident]) -> LoadPlan:
        """How to make room for model ``name`` (``nbytes`` of weights, an estimate before its first load)."""
        resident = [r for r in resident if r.name != name]
        pinned = [r for r in resident if r.pinned]
        if self.max_loaded and len(pinned) >= self.max_loaded:
            return LoadPlan(refuse=f"every one of the {self.max_loaded} slots of --max-loaded-models holds a pinned "
                                   f"model ({', '.join(r.name for r in pinned)}); raise --max-loaded-models or "
                                   f"pin fewer models")
        if self.budget_bytes:
            floor = self.fixed_bytes + sum(r.nbytes for r in pinned)
            if floor + nbytes > self.budget_bytes:
                return LoadPlan(refuse=f"model '{name}' needs about {nbytes / GiB:.2f} GiB of weights, more than the "
                                       f"{(self.budget_bytes - floor) / GiB:.2f} GiB that --memory-budget "
                                       f"({self.budget_bytes / GiB:.2f} GiB) leaves beside the base model and the "
                                       f"pinned ones; raise --memory-budget or serve a smaller (quantized) model")
        kept = list(resident)
        evict: list[str] = []
        for r in sorted((r for r in resident if not r.pinned and not r.in_use), key=lambda r: r.last_used):
            if self._fits(nbytes, kept):
                break
            kept.remove(r)
            evict.append(r.name)
        if not self._fits(nbytes, kept):
            return LoadPlan(wait=True)  # the rest are in use: evict nothing until the whole plan can go through
        return LoadPlan(evict=tuple(evict))

    def _fits(self, nbytes: int, kept: list[Resident]) -> bool:
        if self.max_loaded and len(kept) + 1 > self.max_loaded:
            return False
        return not self.budget_bytes or self.fixed_bytes + sum(r.nbytes for r in kept) + nbytes <= self.budget_bytes

    def expired(self, resident: Iterable[Resident], now: float) -> list[str]:
        """The models idle past ``ttl_s``, to unload now."""
        if not self.ttl_s:
            return []
        return [r.name for r in resident if not r.pinned and not r.in_use and now - r.last_used >= self.ttl_s]
