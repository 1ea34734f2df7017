"""What a sequence puts in the prefix cache: its prompt-boundary and anchor entries while it prefills, and everything
it computed when it ends; and the checkpoints of its layers that cannot be cut back.

``CacheWriter.store(tokens, caches, seq, work)``: the caches must cover exactly ``tokens`` (a sequence whose layers
disagree on what they cover is not cached, and the log says so); a speculating sequence's entry holds its draft
model's layers after the target's (the draft is brought to exactly ``tokens`` first; MTP heads that missed some
positions recompute their hidden states first, or, over recurrent state, are left out); a hit's shared-prefix layers
are made plain (the prefix cache holds plain caches). Caching is an optimisation: a failed put is logged, never a
failed request. Lane thread only.

Checkpoints (cache.checkpoints): a model with recurrent state or sliding windows cannot cut an entry back, so while
a sequence prefills ``take_checkpoint`` keeps those layers' state at the end of each chunk (chunks also stop where
the conversation ends before the generation prompt: ``Sequence.checkpoints``), at most ``MAX_CHECKPOINTS`` of them
(the latest chunk ends, and always the positions asked for and the prompt's end). ``store`` wraps each such layer
with the checkpoints below the entry's end, so the entry serves a later prompt that parts from it inside: from the
greatest checkpoint before the parting. They are fresh handles over immutable arrays: a checkpoint costs the
layer's state at that position (a recurrent state's fixed size; a window's buffer), counted in the entry's bytes.
"""

from __future__ import annotations

import logging
from typing import Sequence

from cache.checkpoints import Checkpointed
from cache.copying import fork
from models.attention.shared_prefix import flatten as flatten_shared
from server.engine.kv_layout import covered_length, state_nbytes
from server.engine.work import SeqWork

__all__ = ["CacheWriter", "take_checkpoint", "MAX_CHECKPOINTS"]

# Per sequence: chunk ends beyond these are forgotten, oldest first (the positions asked for and the prompt's end
# are always kept). 4, not 8: a Qwen3.5-9B checkpoint is ~50 MB beside ~190 MB of KV for a 6k-token entry, and
# entries of agents' turns carried the cap of 8 (~640 MB each on the H100, 2026-12-06) while the older ones were
# inherited from the hit, which older entries of the same conversation still hold. On this CPU the same cached tokens
# at caps 8, 4 and 2 (4 agents x 4 turns; bench/hybrid_turns.py's 10 thinking turns at 8 and 4: BENCHMARKS.md)
MAX_CHECKPOINTS = 4

log = logging.getLogger("mlx_lane.engine")


class CacheWriter:
    def __init__(self, prompt_cache):
        self.prompt_cache = prompt_cache  # a cache.protocol.PrefixCache
        self.kv_bytes_per_token = 0.0  # of the last stored entry, all layers (/stats kv_cache)

    def store(self, tokens: Sequence[int], caches: list, seq, work: SeqWork, anchor: bool = False) -> None:
        """Put ``caches`` (covering ``tokens``) under the sequence's namespace and session; ``anchor``: a client's
        cache breakpoint, an entry of its own that a longer one never supersedes."""
        if not tokens:
            return
        plan = work.spec
        if plan is not None and plan.source.caches is not None:
            source = plan.source
            if getattr(source, "hears_hidden", False):  # MTP heads (spec.mtp): hidden states it missed, recomputed
                source.catch_up(work.model, caches, tokens)
            source.prefill(tokens)  # bring the draft's caches to exactly `tokens`
            if covered_length(list(source.caches)) == len(tokens):
                caches = list(caches) + list(source.caches)
            # else (MTP heads that missed positions over recurrent state): the target's layers alone; a hit on them
            # drafts from the new tokens on (spec.mtp: a blind start)
        caches = flatten_shared(caches)  # the prefix cache holds plain KVCache layers
        if work.snapshots:
            caches = _with_checkpoints(caches, len(tokens), work)
        covered = covered_length(caches)
        if covered is not None and covered != len(tokens):
            log.warning("not caching %s: caches cover %d tokens, expected %d", seq.id, covered, len(tokens))
            return
        self.kv_bytes_per_token = state_nbytes(caches) / len(tokens)
        try:
            if self.prompt_cache.put(list(tokens), caches, seq.ns, seq.session, anchor=anchor):
                work.stored = max(work.stored, len(tokens))
        except Exception:  # caching is an optimisation: never fail the request for it
            log.exception("prompt cache put failed")


def take_checkpoint(seq, work: SeqWork, position: int) -> None:
    """Keep the state of the sequence's layers that cannot be cut back at ``position`` (what its caches cover now)."""
    layers = work.slot.facts.checkpointed_layers
    if not layers or work.caches is None or position <= 0:
        return
    work.snapshots[position] = {i: fork([work.caches[i]])[0] for i in layers}
    wanted = {*seq.checkpoints, len(seq.prompt) - 1}
    spare = sorted(p for p in work.snapshots if p not in wanted)
    while len(work.snapshots) > MAX_CHECKPOINTS and spare:
        del work.snapshots[spare.pop(0)]


def _with_checkpoints(caches: list, end: int, work: SeqWork) -> list:
    """The caches with each layer that cannot be cut back wrapped with its checkpoints below ``end``."""
    out = list(caches)
    for i in work.slot.facts.checkpointed_layers:
        if i < len(out) and not out[i].is_trimmable():
            kept = {p: snaps[i] for p, snaps in work.snapshots.items() if p < end and i in snaps}
            if kept:
                out[i] = Checkpointed(out[i], end, kept)
    return out
