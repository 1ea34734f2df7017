"""Taking back the drafted positions a verify forward wrote and the target rejected, for every cache class that can.

mlx-lm's ``trim_prompt_cache`` refuses a whole list of caches as soon as one layer says it cannot be trimmed, and a
sliding-window layer's ``RotatingKVCache`` says so once its window has wrapped. Yet right after a forward of
several tokens it can be rewound exactly: a multi-token update (``_update_concat``) puts the buffer in temporal
order and keeps ``max_size - 1`` positions before the new ones, so dropping the last ``n <= S - 1`` of the ``S``
positions just written leaves every position the next token's window needs; the buffer is cut to its new end so
that the next single-token update rotates over valid keys only. A verify forward always feeds ``1 + drafts``
tokens, so its rejected drafts can always be taken back this way.

Recurrent state (``ArraysCache``: linear attention, SSM, convolutions) has no positions to drop. A hybrid model
(recurrent layers beside trimmable attention) takes its state back in one of two ways:

- **chosen**: when the verify forward ran inside ``VerifyRewind.verifying()`` and every recurrent layer is a
  gated-delta layer this process's kernels watch (Qwen3.5, Qwen3-Next: models.kernels.positions), the forward kept
  each layer's state and convolution window at every position; taking back n positions sets each layer to its values
  after the kept ones and trims the attention layers by n. Nothing is computed again.
- **replayed** (every other recurrent layout, and Metal, where mlx-lm's own kernel runs): ``mark`` keeps the recurrent
  state before the verify forward (new handles over immutable arrays: nothing is copied), and taking back restores
  that state, drops all the forward wrote from the attention layers, and feeds again the positions that were kept:
  one more forward over the accepted tokens (as dear as a decode step on a GPU), only in a round that rejected a
  draft. mlx-vlm's layers (models.vlm_caches: the second source's models) that are not plain KV (recurrent state,
  windows, pools, lists of them) are marked the same way, as a snapshot of the whole layer put back in its place.

    can_rewind(caches)        every layer can take back what a verify forward wrote
    rewind(caches, n, fed)    drop the last n of the ``fed`` positions the latest forward wrote (no recurrent layer)
    VerifyRewind(model, caches): with .verifying(): <verify forward>; then .take_back(n, fed_tokens)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from models.kernels import positions
from models.mlx_compat import ring_index, set_ring_index
from models import vlm_caches

__all__ = ["can_rewind", "rewind", "VerifyRewind", "CHOOSE"]

# False: recurrent state is always replayed, never chosen (bench/mtp_fit.py --rewind replay measures the difference)
CHOOSE = True


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
    """A layer put back from a mark: mlx-lm's ``ArraysCache`` (and its subclasses: its list of arrays), or one of
    mlx-vlm's that is not plain KV (models.vlm_caches: a snapshot of the whole layer)."""
    return isinstance(cache, ArraysCache) or vlm_caches.restores(cache)


def _mark(cache):
    """What ``take_back`` puts back: an ArraysCache's list of arrays (new list, same arrays), or a snapshot of an
    mlx-vlm layer (models.vlm_caches.snapshot)."""
    return list(cache.cache) if isinstance(cache, ArraysCache) else vlm_caches.snapshot(cache)


class VerifyRewind:
    """Takes back a verify forward's rejected positions, whatever the layers (see the module docstring)."""

    def __init__(self, model, caches: list, choose: Optional[bool] = None):
        self.model, self.caches = model, caches
        self._states = [i for i, c in enumerate(caches) if _is_state(c)]
        self._marked: dict = {}
        self._choose = CHOOSE if choose is None else choose
        self._recorded: Optional[positions.Recording] = None
        self.replays = 0  # rounds taken back by feeding the kept tokens again (the rest chose a state)

    def mark(self) -> None:
        """Before a verify forward: keep the recurrent layers' state (new lists over the same arrays)."""
        self._recorded = None
        if self._states:
            self._marked = {i: _mark(self.caches[i]) for i in self._states}

    @contextmanager
    def verifying(self) -> Iterator[None]:
        """Around one verify forward: ``mark``, and let watched recurrent layers keep every position's values."""
        self.mark()
        if not self._states or not self._choose:
            yield
            return
        with positions.recording() as rec:
            yield
        self._recorded = rec

    def take_back(self, n: int, fed: Sequence[int]) -> None:
        """Drop the last ``n`` of the tokens ``fed`` (what the latest verify forward fed, in order)."""
        if n <= 0:
            return
        if not self._states:
            rewind(self.caches, n, len(fed))
            return
        if n >= len(fed):
            raise ValueError(f"cannot take back {n} of the {len(fed)} positions the last forward wrote")
        if self._chosen(n, len(fed)):
            return
        self.replays += 1
        for i, state in self._marked.items():
            if isinstance(state, list):
                self.caches[i].cache = list(state)
            else:  # mlx-vlm's layer: its snapshot takes its place in the list the model reads
                self.caches[i] = state
        for i, c in enumerate(self.caches):
            if i not in self._marked and c.trim(len(fed)) != len(fed):
                raise ValueError(f"{type(c).__name__} took back fewer than {len(fed)} positions")
        kept = [int(t) for t in fed[: len(fed) - n]]
        self.model(mx.array([kept]), cache=self.caches)  # the kept positions again, from the checkpoint
        mx.eval([c.state for c in self.caches])

    def _chosen(self, n: int, fed: int) -> bool:
        """Set every recurrent layer to its recorded values after the kept positions and trim the others by n; False
        (nothing changed) unless the recording places every recurrent layer."""
        rec, self._recorded = self._recorded, None
        if rec is None:
            return False
        layers: list[tuple[ArraysCache, list]] = []
        for i in self._states:
            c, marked = self.caches[i], self._marked.get(i)
            if not (isinstance(c, ArraysCache) and isinstance(marked, list)):
                return False
            layers.append((c, marked))
        before = [list(c.cache) for c, _ in layers]
        for j, (c, marked) in enumerate(layers):
            if not rec.select(c, marked, fed, fed - n):
                for (undo, _), arrays in zip(layers[:j], before):
                    undo.cache = arrays
                return False
        for i, c in enumerate(self.caches):
            if i not in self._marked and c.trim(n) != n:
                raise ValueError(f"{type(c).__name__} took back fewer than {n} positions")
        mx.async_eval([c.state for c in self.caches])  # asked for, not waited on: the next round's forward reads them
        return True
