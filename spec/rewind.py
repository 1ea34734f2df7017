"""Taking back the drafted positions a verify forward wrote and the target rejected, for every cache class that can.

mlx-lm's ``trim_prompt_cache`` refuses a whole list of caches as soon as one layer says it cannot be trimmed, and a
sliding-window layer's ``RotatingKVCache`` says so once its window has wrapped. Yet right after a forward of
several tokens it can be rewound exactly: a multi-token update (``_update_concat``) puts the buffer in temporal
order and keeps ``max_size - 1`` positions before the new ones, so dropping the last ``n <= S - 1`` of the ``S``
positions just written leaves every position the next token's window needs; the buffer is cut to its new end so
that the next single-token update rotates over valid keys only. A verify forward always feeds ``1 + drafts``
tokens, so its rejected drafts can always be taken back this way.

Recurrent state (``ArraysCache``, mlx-lm's or mlx-vlm's: linear attention, SSM, convolutions) has no positions to drop. A hybrid model
(recurrent layers beside trimmable attention) rewinds from a checkpoint instead: ``VerifyRewind.mark`` keeps the
recurrent state before the verify forward (new handles over immutable arrays: nothing is copied), and taking back n
of its positions restores that state, drops all the forward wrote from the attention layers, and feeds again the
positions that were kept: one more forward over the accepted tokens, only in a round that rejected a draft.

    can_rewind(caches)        every layer can take back what a verify forward wrote
    rewind(caches, n, fed)    drop the last n of the ``fed`` positions the latest forward wrote (no recurrent layer)
    VerifyRewind(model, caches).mark(); .take_back(n, fed_tokens)    either way, around one verify forward
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from models.mlx_compat import ring_index, set_ring_index
from models.vlm_caches import is_recurrent as is_vlm_recurrent

__all__ = ["can_rewind", "rewind", "VerifyRewind"]


def can_rewind(caches: Sequence) -> bool:
    """Can every layer take back drafted positions: trimmable now, a sliding window (rewound after a multi-token
    forward), or recurrent state beside attention layers that are all trimmable (rewound from a checkpoint)? See
    the module docstring."""
    if not caches:
        return False
    states = [c for c in caches if _is_state(c)]
    others = [c for c in caches if not _is_state(c)]
    if states:
        return all(c.is_trimmable() for c in others)
    return all(c.is_trimmable() or isinstance(c, RotatingKVCache) for c in caches)


def rewind(caches: Sequence, n: int, fed: int) -> None:
    """Drop the last ``n`` positions of the ``fed`` (> n) that the latest forward wrote into every layer."""
    if n <= 0:
        return
    if n >= fed:
        raise ValueError(f"cannot take back {n} of the {fed} positions the last forward wrote")
    for c in caches:
        if c.is_trimmable():
            if c.trim(n) != n:
                raise ValueError(f"{type(c).__name__} took back fewer than {n} positions")
        elif isinstance(c, RotatingKVCache) and fed > 1 and ring_index(c) == c.keys.shape[2]:
            # wrapped, in temporal order after the multi-token update: the window before the kept positions is
            # whole (the update kept max_size - 1 older ones); cut the buffer so no stale position survives
            end = ring_index(c) - n
            c.keys = c.keys[..., :end, :]
            c.values = c.values[..., :end, :]
            c.offset -= n
            set_ring_index(c, end)
        else:
            raise ValueError(f"{type(c).__name__} cannot take back drafted positions")


def _is_state(cache) -> bool:
    """A recurrent layer: mlx-lm's ``ArraysCache`` (and its subclasses), or mlx-vlm's (models.vlm_caches)."""
    return isinstance(cache, ArraysCache) or is_vlm_recurrent(cache)


class VerifyRewind:
    """Takes back a verify forward's rejected positions, whatever the layers (see the module docstring)."""

    def __init__(self, model, caches: list):
        self.model, self.caches = model, caches
        self._states = [i for i, c in enumerate(caches) if _is_state(c)]
        self._marked: dict = {}

    def mark(self) -> None:
        """Before a verify forward: keep the recurrent layers' state (new lists over the same arrays)."""
        if self._states:
            self._marked = {i: list(self.caches[i].cache) for i in self._states}

    def take_back(self, n: int, fed: Sequence[int]) -> None:
        """Drop the last ``n`` of the tokens ``fed`` (what the latest verify forward fed, in order)."""
        if n <= 0:
            return
        if not self._states:
            rewind(self.caches, n, len(fed))
            return
        if n >= len(fed):
            raise ValueError(f"cannot take back {n} of the {len(fed)} positions the last forward wrote")
        for i, state in self._marked.items():
            self.caches[i].cache = list(state)
        for i, c in enumerate(self.caches):
            if i not in self._marked and c.trim(len(fed)) != len(fed):
                raise ValueError(f"{type(c).__name__} took back fewer than {len(fed)} positions")
        kept = [int(t) for t in fed[: len(fed) - n]]
        self.model(mx.array([kept]), cache=self.caches)  # the kept positions again, from the checkpoint
        mx.eval([c.state for c in self.caches])
