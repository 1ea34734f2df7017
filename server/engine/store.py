"""What a sequence puts in the prefix cache: its prompt-boundary and anchor entries while it prefills, and everything
it computed when it ends.

``CacheWriter.store(tokens, caches, seq, work)``: the caches must cover exactly ``tokens`` (a sequence whose layers
disagree on what they cover is not cached, and the log says so); a speculating sequence's entry holds its draft
model's layers after the target's (the draft is brought to exactly ``tokens`` first); a hit's shared-prefix layers
are made plain (the prefix cache holds plain caches). Caching is an optimisation: a failed put is logged, never a
failed request. Lane thread only.
"""

from __future__ import annotations

import logging
from typing import Sequence

from models.attention.shared_prefix import flatten as flatten_shared
from server.engine.kv_layout import covered_length, state_nbytes
from server.engine.work import SeqWork

__all__ = ["CacheWriter"]

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
            plan.source.prefill(tokens)  # bring the draft's caches to exactly `tokens`
            caches = list(caches) + list(plan.source.caches)
        caches = flatten_shared(caches)  # the prefix cache holds plain KVCache layers
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
