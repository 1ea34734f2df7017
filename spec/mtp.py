"""Drafts from the checkpoint's own multi-token-prediction heads (``--draft-kind mtp``), fed the target's hidden states.

An MTP head (models.mtp.heads) computes, at each position q of the sequence S, an "entry" from the embedding of S[q]
and the target's hidden state H[q-1] at the position before: its attention layers keep the entry in a KV cache of
their own, and its output predicts S[q+1]. Fed its own output in place of H and its own prediction in place of the
next token, it drafts further. So a source needs the target's hidden state at every position the target computes;
``heard`` takes them from the target's tap (models.mtp.tap) right after each forward that fed this sequence: a prompt
chunk (server.engine.prefill), a verify step (spec.verify, server.engine.batch.speculating), the last token fed at
the end. State, in absolute positions (``origin``: the first position this source has seen, 0 unless it started
on a cached prefix whose entry kept no MTP layers, "blind"):

    hidden   H[origin..h-1]            a KVCache of one head: keys the hidden states, values one zero column, so every
                                       mechanism that holds, trims, forks, batches and stores KV holds them too
    entries  E[origin..m-1]            the heads' KV caches; E[q] needs H[q-1] (a zero vector at ``origin``: that entry
                                       is masked for every later query, as the reference has no such position)

A stored entry therefore covers its tokens exactly like the target's layers (h = m = len(tokens)): a cache hit (RAM,
SSD) drafts at once. E[q] depends on H[q-1], S[q] and the entries before it only: the entries a draft appends past
the sequence (computed from the heads' own outputs) are dropped at ``commit`` and computed again from the target's
hidden states when they are heard, so the caches are a function of the sequence, whatever was drafted (a hit
drafts what a cold request drafts).

A source that missed positions (a row that went on in the plain batch) is "behind": it drafts nothing until it is
caught up. ``catch_up`` recomputes the missing hidden states on a copy of the target's plain KV caches (one forward
over the missing tokens) before the caches are stored; over recurrent state nothing can be recomputed, and the entry
is stored without the MTP layers (the next turn starts blind).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from models.facts import DraftHeads
from spec.source import DraftProvider

__all__ = ["MtpProvider", "MtpSource", "entry_mask", "PREFILL_CHUNK"]

PREFILL_CHUNK = 512  # tokens per catch-up forward


def entry_mask(start: int, width: int) -> mx.array:
    """(1, 1, width, start + width) bool: queries at cache columns start.. see the columns up to their own, never
    column 0 (the entry without a hidden state) unless they are column 0."""
    cols = mx.arange(start + width)[None, :]
    q = (start + mx.arange(width))[:, None]
    return ((cols <= q) & ((cols > 0) | (q == 0)))[None, None]


class MtpSource:
    """One request's MTP drafting (see the module docstring); a ``spec.source.DraftSource`` that hears hidden states."""

    drafts_in_batch = False
    hears_hidden = True

    def __init__(self, head, tap, caches: Optional[list] = None, tokens: Sequence[int] = ()):
        self.head, self._tap = head, tap
        self._seq: list[int] = [int(t) for t in tokens]
        n = len(self._seq)
        if caches is not None and len(caches) == head.layers + 1 and all(
                int(c.offset) == n for c in caches):
            self._kv, self._hid, self.origin = list(caches[:-1]), caches[-1], 0
        else:  # nothing of the prefix: entries from here on
            self._kv, self._hid, self.origin = head.make_caches(), KVCache(), n
        self.blind = self.origin > 0
        self._spec = 0  # entries the open draft appended past the sequence
        self._open: Optional[list[int] | mx.array] = None  # the open draft's tokens (an array until read)
        self._lent: Optional[int] = None  # while a batch holds the heads' KV caches: the entries they hold
        self._drop = 0  # entries the batch must drop from them (what the bookkeeping here took back while lent)

    # -- what it holds ------------------------------------------------------------------------------
    @property
    def caches(self) -> list:
        """The heads' KV caches, then the hidden states (a cache entry stores them after the target's layers)."""
        return self._kv + [self._hid]

    @property
    def tokens(self) -> list[int]:
        """The tokens the caches cover from position 0 (none for a blind source: it never covers a prefix)."""
        return [] if self.origin else self._seq[: min(self._h, self._m)]

    @property
    def behind(self) -> bool:
        """Some position before the last token has no hidden state: nothing can be drafted until it is heard."""
        return self._h < len(self._seq) - 1

    @property
    def _h(self) -> int:
        return self.origin + int(self._hid.offset)

    @property
    def _entries(self) -> int:
        """Entries the heads' caches hold (the open draft's too)."""
        if self._lent is not None:
            return self._lent
        return self.origin + int(self._kv[0].offset) if self._kv else self._h

    @property
    def _m(self) -> int:
        return self._entries - self._spec

    def _trim_entries(self, n: int) -> None:
        if n <= 0:
            return
        if self._lent is not None:
            self._lent -= n
            self._drop += n
        else:
            for c in self._kv:
                c.trim(n)

    # -- hearing the target -------------------------------------------------------------------------
    def heard(self, start: int, tokens: Sequence[int], row: int = 0) -> None:
        """The target's latest forward fed ``tokens`` at positions ``start``.. of this sequence, in row ``row`` of its
        batch: their hidden states are read from the tap now (call it right after that forward)."""
        last = self._tap.last
        if last is None or not tokens or last.shape[0] <= row or last.shape[1] < len(tokens):
            return  # not a forward of this sequence: it stays behind (drafts nothing) rather than hear another's
        self.hear(start, tokens, last[row, : len(tokens)])

    def hear(self, start: int, tokens: Sequence[int], hidden: mx.array) -> None:
        """``hidden`` (len(tokens), H): the target's hidden states at positions ``start``.. where it fed ``tokens``.
        A gap (``start`` past what was heard) is not bridged: the source stays behind."""
        if self._open is not None:
            raise RuntimeError("hidden states heard with a draft still open: commit() first")
        tokens = [int(t) for t in tokens]
        if start > self._h or start < self.origin:
            return
        if start < self._h:
            self._hid.trim(self._h - start)
        if self._seq[start: start + len(tokens)] != tokens:
            self._seq = self._seq[:start] + tokens
        if self._m > start + 1:  # entries past ``start`` read hidden states heard again
            self._trim_entries(self._m - start - 1)
        k = len(tokens)
        self._hid.update_and_fetch(hidden.reshape(1, 1, k, -1), mx.zeros((1, 1, k, 1), hidden.dtype))

    # -- the DraftSource protocol -------------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> None:
        """The sequence is now ``ids``: what was computed past their common prefix is dropped; entries are computed
        as far as hidden states allow (a stored entry then covers ``ids`` exactly)."""
        ids = [int(t) for t in ids]
        self._drop_open()
        p = 0
        limit = min(len(ids), len(self._seq))
        while p < limit and ids[p] == self._seq[p]:
            p += 1
        if self._lent is not None:
            raise RuntimeError("prefill() while a batch holds the heads' caches: take them back first")
        if p < self.origin:  # parts before anything this source computed: start over, blind from there
            self._kv, self._hid, self.origin, self.blind = self.head.make_caches(), KVCache(), p, p > 0
        if self._h > p:
            self._hid.trim(self._h - p)
        if self._m > p:
            self._trim_entries(self._m - p)
        self._seq = ids
        self._fill()

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        proposed = self.draft_lazy(feed, n)
        if proposed is None:
            return []
        row: Any = proposed.tolist()
        drafts = [int(t) for t in row]
        self._open = drafts
        return drafts

    def draft_lazy(self, feed: Sequence[int], n: int) -> Optional[mx.array]:
        """``draft`` without waiting for the device: the drafts as an (n,) uint32 array it has been asked for
        (``mx.async_eval``), not read. A verifier builds its forward over them at once and reads drafts and verdict in
        one wait (spec.verify), where ``draft`` waits for the entries, then for the drafts, then the verify forward
        waits again, the device idle while the host builds each next graph. ``commit`` takes the array back (or its
        tokens). None: nothing drafted (``n`` 0, or behind)."""
        if not self.plan(feed, n):
            return None
        out = self._fill(wait=False)
        assert out is not None
        g = out[:, -1:, :]
        tok = mx.argmax(self.head.logits(g), axis=-1)  # (1, 1)
        ys = [tok]
        mx.async_eval(tok)
        for i in range(1, n):  # past the sequence: its own output stands in for the target's hidden state
            col = len(self._seq) - self.origin + i - 1
            g = self.head.forward(tok, g, self._kv, entry_mask(col, 1))
            tok = mx.argmax(self.head.logits(g), axis=-1)
            ys.append(tok)
            mx.async_eval(tok)
        proposed = mx.concatenate(ys, axis=1)[0].astype(mx.uint32)
        mx.async_eval(proposed)
        self.record_draft(proposed)
        return proposed

    def commit(self, drafted: Sequence[int] | mx.array, accepted: int) -> None:
        """The first ``accepted`` drafts joined the sequence; the entries past it go (their hidden states arrive with
        ``heard``, after the verify forward). ``drafted``: what ``draft`` returned, or the array of ``draft_lazy``."""
        opened = self._open if self._open is not None else []
        if drafted is not opened:  # the very array draft_lazy returned is not read again
            mine = opened.tolist() if isinstance(opened, mx.array) else list(opened)
            theirs = drafted.tolist() if isinstance(drafted, mx.array) else [int(t) for t in drafted]
            if theirs != mine:
                raise RuntimeError("commit() of tokens this source did not draft")
        if not 0 <= accepted <= len(opened):
            raise ValueError(f"accepted={accepted} outside 0..{len(opened)}")
        kept: Any = [] if not accepted else (
            opened[:accepted].tolist() if isinstance(opened, mx.array) else list(opened[:accepted]))
        self._drop_open()
        self._seq.extend(int(t) for t in kept)

    # -- the bookkeeping shared with a batch that drafts for several sources (server.engine.batch.mtp_drafts) ----
    def plan(self, feed: Sequence[int], n: int) -> bool:
        """The sequence took ``feed``; True when it is to draft ``n`` > 0 tokens now: the entries from ``_m`` to the
        last token are then to be computed (``entries_input``), the last one again when it was (its output is the
        first draft)."""
        if self._open is not None:
            raise RuntimeError("draft() called twice without commit()")
        self._seq.extend(int(t) for t in feed)
        if n <= 0 or self.behind or not self._seq:
            return False
        if self._m >= len(self._seq):
            self._trim_entries(self._m - len(self._seq) + 1)
        return True

    def entries_input(self) -> tuple[list[int], mx.array]:
        """The tokens of the entries still to compute (from ``_m`` up to what hidden states allow) and the hidden
        states before them, (width, H): a zero row for the entry at ``origin``, which has none."""
        m, end = self._m, min(self._h + 1, len(self._seq))
        keys = self._hid.keys
        lo = max(m - 1, self.origin) - self.origin
        prev = keys[0, 0, lo: end - 1 - self.origin, :] if end - 1 > max(m - 1, self.origin) else None
        if m == self.origin:
            dim = self.head.hidden_size if keys is None else keys.shape[-1]
            zero = mx.zeros((1, dim), mx.float32 if keys is None else keys.dtype)
            prev = zero if prev is None else mx.concatenate([zero, prev], axis=0)
        assert prev is not None
        return self._seq[m:end], prev

    def record_draft(self, drafts: list[int] | mx.array) -> None:
        """Every entry up to the last token was computed, then one per draft but the last: ``drafts`` await
        ``commit``."""
        if self._lent is not None:
            self._lent = len(self._seq) + len(drafts) - 1
        self._spec = len(drafts) - 1
        self._open = drafts

    def lend_caches(self) -> list:
        """The heads' KV caches, for a batch to hold (the hidden states stay here); refused while a draft is open."""
        if self._open is not None or self._lent is not None:
            raise RuntimeError("caches lent with a draft open, or lent already")
        self._lent, self._drop = self._entries, 0
        kv, self._kv = self._kv, []
        return kv

    def take_drop(self) -> int:
        """The entries the batch must drop now from this source's row (what ``commit``/``hear`` took back)."""
        drop, self._drop = self._drop, 0
        return drop

    def take_back(self, caches: list) -> None:
        """The heads' KV caches again (their row, the drops taken: holding exactly ``_entries``)."""
        if self._drop:
            raise RuntimeError("caches handed back before their drops were applied")
        self._kv, self._lent = caches, None

    # -- catching up --------------------------------------------------------------------------------
    @staticmethod
    def can_catch_up(target_caches: list) -> bool:
        """Can missed hidden states be recomputed later over these caches (plain KVCache layers: cut back a copy)?"""
        return bool(target_caches) and all(type(c) is KVCache for c in target_caches)

    def catch_up(self, model, target_caches: list, tokens: Sequence[int]) -> bool:
        """The sequence is ``tokens``, which ``target_caches`` cover: recompute the hidden states of the positions it
        missed on a copy of those caches cut back to where it stopped hearing (plain KVCache layers only: recurrent
        state cannot be cut back), then its entries. True when its caches cover ``tokens`` afterwards."""
        self.prefill(tokens)
        h, n = self._h, len(self._seq)
        if h < n and h >= self.origin and self.can_catch_up(target_caches):
            fork = []
            for c in target_caches:
                f = KVCache()
                if h:
                    f.keys, f.values, f.offset = c.keys[..., :h, :], c.values[..., :h, :], h
                fork.append(f)
            for s in range(h, n, PREFILL_CHUNK):
                chunk = self._seq[s: min(n, s + PREFILL_CHUNK)]
                model(mx.array(chunk)[None], cache=fork)
                self.heard(s, chunk)
            self._fill()
        return not self.origin and self._h == self._m == n

    # -- inner parts --------------------------------------------------------------------------------
    def _drop_open(self) -> None:
        if self._spec:
            self._trim_entries(self._spec)
            self._spec = 0
        self._open = None

    def _fill(self, wait: bool = True) -> Optional[mx.array]:
        """Compute the entries the sequence and the hidden states allow (up to S[h], H[h-1]) in one forward of the
        heads, on its own caches; their output (1, L, H), or None when there was nothing to compute. ``wait``
        False: the caches are only asked for (a draft built on them waits for them)."""
        m = self._m
        ids, prev = self.entries_input() if min(self._h + 1, len(self._seq)) > m else ([], None)
        if not ids or prev is None:
            return None
        tokens = mx.array(ids, dtype=mx.uint32)[None]
        out = self.head.forward(tokens, prev[None], self._kv, entry_mask(m - self.origin, len(ids)))
        (mx.eval if wait else mx.async_eval)([c.state for c in self._kv])
        return out


class MtpProvider(DraftProvider):
    """The checkpoint's MTP heads, bound to the base model and its tap. ``identity`` joins the cache namespace:
    entries hold the heads' layers and the hidden states after the target's."""

    kind = "mtp"

    def __init__(self, head, tap, *, identity: str, target_params: int, facts: Optional[DraftHeads] = None):
        self.head, self.tap = head, tap
        self.identity = identity
        self.cost_ratio = head.params / max(1, target_params)
        self.facts = facts  # models.facts.DraftHeads: what the server records of the heads (ModelFacts.draft_heads)

    @classmethod
    def from_loaded(cls, loaded) -> "MtpProvider":
        """The heads of a ``models.LoadedModel``'s own checkpoint (ModelLoadError when it ships none this server can
        run: models.mtp.load), bound to its model through a tap on its final norm."""
        from mlx.utils import tree_flatten

        from models.mtp import facts_of, load_heads, tap

        head = load_heads(loaded.path, loaded.model, loaded.dtype)
        leaves: Any = tree_flatten(loaded.model.parameters())
        return cls(head, tap(loaded.model), identity=f"mtp:{loaded.fingerprint}",
                   target_params=sum(v.size for _, v in leaves), facts=facts_of(head, loaded.architecture))

    def policy(self, max_len: int, recurrent: bool = False):
        """Adaptive length that stops when drafts stop paying: the request decodes on mlx-lm's pipelined plain steps
        and the heads catch up when it is stored (``catch_up``). Over recurrent state, where they could not, it
        pauses instead: the solo verifier keeps feeding one token per step, which the heads hear."""
        from spec.adaptive import AdaptiveDraftLength, break_even_rate

        return AdaptiveDraftLength(max_len, stop_below=break_even_rate(self.cost_ratio),
                                   pause=16 if recurrent else None)

    def trace_caches(self, caches: Optional[list], n: int) -> list:
        """The heads' KV caches and the hidden-state cache after ``n`` more positions, traced
        (DraftProvider.trace_caches): what a source holds beside the target's caches (``MtpSource.caches``)."""
        caches = self.head.make_caches() + [KVCache()] if caches is None else caches
        *kv, hid = caches
        start = hid.offset
        tokens = mx.array([[1] * n])
        hidden = mx.zeros_like(self.head.embed(tokens))  # (1, n, hidden size) in the model's dtype
        self.head.forward(tokens, hidden, kv, entry_mask(start, n))
        hid.update_and_fetch(hidden.reshape(1, 1, n, -1), mx.zeros((1, 1, n, 1), hidden.dtype))
        return caches

    def open(self, caches: Optional[list] = None, tokens: Sequence[int] = ()) -> MtpSource:
        return MtpSource(self.head, self.tap, caches, tokens)
