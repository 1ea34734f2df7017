"""A speculating batch's verify inputs from drafts read and unread.

Each row feeds its pending token and its drafts, right-padded to the step's width (padding is computed, never kept).
A row whose drafts came from a batched drafter unread (``UnreadDraft``: its place in the drafter's
``server.engine.batch.mtp_drafts.OpenDrafts``) enters as columns of the drafter's array, so building the verify
forward waits for nothing: drafts and verdict are read together after it (spec.verify.READ_DRAFTS_WITH_VERDICT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

__all__ = ["UnreadDraft", "draft_lengths", "read_drafts", "unread_arrays", "verify_inputs"]


@dataclass
class UnreadDraft:
    """A row's draft not read yet: ``open`` (an ``OpenDrafts``) and ``index``, the row's place in what its drafter
    was asked."""

    open: Any
    index: int

    @property
    def length(self) -> int:
        return int(self.open.lengths[self.index])


def draft_lengths(drafts: list) -> list[int]:
    """Each row's draft length (an unread draft's is known before its read)."""
    return [d.length if isinstance(d, UnreadDraft) else len(d) for d in drafts]


def _opened(drafts: list) -> list:
    return list({id(d.open): d.open for d in drafts if isinstance(d, UnreadDraft)}.values())


def verify_inputs(pending: list[int], drafts: list, width: int) -> mx.array:
    """(B, width) uint32: row i's ``pending[i]``, its drafts, then padding."""
    eager = [[p] + (d if isinstance(d, list) else []) for p, d in zip(pending, drafts)]
    inputs = mx.array([x + [x[0]] * (width - len(x)) for x in eager], dtype=mx.uint32)
    for open_ in _opened(drafts):
        if open_.array is None:
            continue
        at = [i for i, d in enumerate(drafts) if isinstance(d, UnreadDraft) and d.open is open_]
        cols = open_.array[mx.array([open_.rows[drafts[i].index] for i in at]), : width - 1]
        if cols.shape[1] < width - 1:  # this drafter's longest draft is shorter than another's
            cols = mx.concatenate([cols, mx.zeros((cols.shape[0], width - 1 - cols.shape[1]), cols.dtype)], axis=1)
        inputs[mx.array(at), 1:] = cols.astype(mx.uint32)
    return inputs


def unread_arrays(drafts: list) -> list:
    """The drafters' arrays still to evaluate (with the verdict, in one ``mx.eval``)."""
    return [o.array for o in _opened(drafts) if o.array is not None]


def read_drafts(drafts: list) -> list[list[int]]:
    """Every row's drafts as tokens (the unread ones read now: their sources learn what they drafted)."""
    return [d.open.read()[d.index] if isinstance(d, UnreadDraft) else d for d in drafts]
