"""The accept walk of speculative decoding, one rule for the solo verifier (spec.verify) and the batched one
(server.engine.batch.speculating).

After one target forward over ``[pending] + drafts``, the target's token at every fed position is drawn from its
(processed) distribution given the accepted prefix: ``target[i]`` follows ``drafts[:i]``. A draft is kept while it
equals the target's token at its position; the first that differs is rejected with everything after it, and the
target's token there is the correction (after a fully accepted draft, ``target[len(drafts)]`` is the bonus token).
For greedy rows this is plain greedy decoding token for token; for sampled rows with a deterministic draft it is
the standard rule ("draw and compare": a draft survives with probability p(draft), and a rejection yields a draw
from p without it), so the output is distributed as plain sampling.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["accept", "emitted"]


def accept(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many drafts the target confirms: the longest prefix where ``target[i] == drafts[i]``. ``target`` has
    one token per fed position (``len(drafts) + 1``)."""
    if len(target) < len(drafts) + 1:
        raise ValueError(f"{len(target)} target tokens for {len(drafts)} drafts: need one per fed position")
    a = 0
    while a < len(drafts) and int(target[a]) == int(drafts[a]):
        a += 1
    return a


def emitted(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a verify step yields: the accepted drafts, then the target's correction or bonus token."""
    a = accept(drafts, target)
    return [int(t) for t in drafts[:a]] + [int(target[a])]
