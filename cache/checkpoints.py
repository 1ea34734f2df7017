"""Checkpoints: an untrimmable layer's state kept at earlier positions, so its entry can be cut back to them exactly.

A recurrent layer (mlx-lm's ``ArraysCache``: linear attention, SSM, short convolutions) holds a fixed-size summary of
every token it saw, and a sliding window that wrapped holds only its last positions: neither can be trimmed, so an
entry of a hybrid or sliding-window model used to serve only prompts that extend all of its tokens. A turn whose
chat template re-renders the previous reply (a thinking template drops the reasoning; a generation prompt that
opens ``<think>``) parts from that entry inside it, and recomputed everything. SGLang (MambaRadixCache) and vLLM
keep the recurrent state at some positions instead; so does this module.

``Checkpointed(inner, snapshots)`` is one layer of a stored entry: ``inner`` the layer at the entry's end, and
``snapshots`` the same layer's state at earlier positions (cache objects of the inner's class, each covering exactly
that many tokens). ``points`` are the positions it can be cut back to. The entry's reach (cache.prefix) is the
positions every layer reaches: trimmable layers (a KVCache) any, checkpointed ones their points. A taker gets plain
cache objects of the inner's class at one of them (``cache.copying.fork(..., unwrap=True)``: fresh handles over the
immutable arrays, nothing copied), so a model never sees this class. Snapshots are counted in ``nbytes`` (they live in RAM as long as the
entry) and written to SSD with it (cache.kvfile's ``ckpt`` codec).

Only the prefix cache holds ``Checkpointed`` layers: the engine wraps a sequence's untrimmable layers with the
snapshots it took at chunk boundaries and at the prompt's end when it stores them, and every tier unwraps them on
``take`` (cache.copying.fork with ``unwrap``). ``cache`` depends on no package of ours; the inner classes are
mlx-lm's.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["Checkpointed", "reach_of"]


class Checkpointed:
    def __init__(self, inner: Any, offset: int, snapshots: Optional[dict[int, Any]] = None):
        """``inner`` covers ``offset`` tokens; ``snapshots`` {position: a cache object of the inner's class covering
        exactly ``position`` tokens}, each below ``offset``."""
        self.inner = inner
        self.offset = int(offset)
        self.snapshots = {int(p): s for p, s in (snapshots or {}).items() if 0 < int(p) < self.offset}

    @property
    def points(self) -> tuple[int, ...]:
        """The positions the layer can be cut back to, its own end included."""
        return tuple(sorted(self.snapshots)) + (self.offset,)

    def is_trimmable(self) -> bool:
        return False  # in mlx-lm's sense (any number of tokens): only to its points

    def trim(self, n: int) -> int:
        raise ValueError("a checkpointed layer is cut back for a taker, to one of its points: "
                         "cache.copying.fork(caches, trim=n, unwrap=True)")

    @property
    def nbytes(self) -> int:
        return int(self.inner.nbytes) + sum(int(s.nbytes) for s in self.snapshots.values())

    @property
    def state(self):
        """Every array it holds (its inner's and its snapshots'), for evaluation and the durability writer."""
        return [self.inner.state, [s.state for s in self.snapshots.values()]]


def reach_of(caches: list) -> Any:
    """The positions an entry of these layers can be cut back to (cache.prefix's reach): True when every layer is
    trimmable, the points every checkpointed layer shares when the untrimmable ones are all checkpointed, False
    otherwise."""
    points = None
    for c in caches:
        if c.is_trimmable():
            continue
        if not isinstance(c, Checkpointed):
            return False
        mine = set(c.points[:-1])  # below its end: the end itself needs no cut
        points = mine if points is None else points & mine
    if points is None:
        return True
    return tuple(sorted(points)) if points else False
