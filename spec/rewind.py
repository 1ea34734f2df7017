"""Taking back the drafted positions a verify forward wrote and the target rejected, for every cache class that can.

mlx-lm's ``trim_prompt_cache`` refuses a whole list of caches as soon as one layer says it cannot be trimmed, and a
sliding-window layer's ``RotatingKVCache`` says so once its window has wrapped. Yet right after a forward of
several tokens it can be rewound exactly: a multi-token update (``_update_concat``) puts the buffer in temporal
order and keeps ``max_size - 1`` positions before the new ones, so dropping the last ``n <= S - 1`` of the ``S``
positions just written leaves every position the next token's window needs; the buffer is cut to its new end so
that the next single-token update rotates over valid keys only. A verify forward always feeds ``1 + drafts``
tokens, so its rejected drafts can always be taken back this way. Recurrent state (``ArraysCache``: linear
attention, SSM, convolutions) has no positions to drop: a model with such layers cannot rewind, and its requests
decode plainly (``can_rewind``).

    can_rewind(caches)        every layer can take back what a verify forward wrote
    rewind(caches, n, fed)    drop the last n of the ``fed`` positions the latest forward wrote, on every layer
"""

from __future__ import annotations

from typing import Sequence

from mlx_lm.models.cache import RotatingKVCache

__all__ = ["can_rewind", "rewind"]


def can_rewind(caches: Sequence) -> bool:
    """Can every layer take back drafted positions: trimmable now, or a sliding window (rewound after a multi-token
    forward, see the module docstring)?"""
    return bool(caches) and all(c.is_trimmable() or isinstance(c, RotatingKVCache) for c in caches)


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
        elif isinstance(c, RotatingKVCache) and fed > 1 and c._idx == c.keys.shape[2]:
            # wrapped, in temporal order after the multi-token update: the window before the kept positions is
            # whole (the update kept max_size - 1 older ones); cut the buffer so no stale position survives
            c.keys = c.keys[..., : c._idx - n, :]
            c.values = c.values[..., : c._idx - n, :]
            c.offset -= n
            c._idx -= n
        else:
            raise ValueError(f"{type(c).__name__} cannot take back drafted positions")
