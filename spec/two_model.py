"""Drafts from a second, smaller mlx-lm model that shares the target's tokenizer.

``TwoModelProvider`` checks the pair once at start-up (same vocabulary size, same tokenizer
mapping, caches that can be rewound) and opens a ``TwoModelSource`` per request. The source
drafts greedily (argmax of the draft's logits; the target's acceptance walk decides what is
kept, whatever the request's sampler) and keeps its own KV caches, built by mlx-lm's
``make_prompt_cache``.

Cache bookkeeping, as in mlx-lm's ``speculative_generate_step``: drafting n tokens feeds the
draft model ``feed + d1..d(n-1)``; ``d_n`` is proposed but never fed. ``commit(drafted, a)``
trims the ``n-1-a`` fed-but-rejected tokens, or, after a full accept, remembers ``d_n`` as
known-but-unfed and feeds it first next round. ``tokens`` is always exactly what the caches
cover.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache, trim_prompt_cache

from spec.errors import DraftMismatch, UnsupportedDraft
from spec.rewind import can_rewind
from spec.source import DraftProvider

__all__ = ["TwoModelProvider", "TwoModelSource", "vocab_size", "tokenizer_digest", "check_pair"]

PREFILL_CHUNK = 512


def vocab_size(model) -> int:
    """The size of the model's output vocabulary (from its args, else by a one-token forward)."""
    args = getattr(model, "args", None)
    n = getattr(args, "vocab_size", None)
    if isinstance(n, int) and n > 0:
        return n
    logits = model(mx.array([[0]]), cache=make_prompt_cache(model))
    return int(logits.shape[-1])


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id mapping (special tokens included) and its EOS ids."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\0{tok}\0".encode("utf-8", "surrogatepass"))
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [])
    h.update(("eos:" + ",".join(map(str, eos))).encode())
    return h.hexdigest()


def _check_rewindable(model, role: str) -> None:
    caches = make_prompt_cache(model)
    bad = sorted({type(c).__name__ for c in caches if isinstance(c, RotatingKVCache) or not c.is_trimmable()})
    if bad:
        raise UnsupportedDraft(
            f"the {role} model's KV caches cannot be rewound ({', '.join(bad)}: sliding-window or recurrent "
            "layers), so rejected draft tokens could not be rolled back; use --draft-kind ngram, or no draft"
        )


def check_pair(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise ``DraftMismatch`` / ``UnsupportedDraft`` unless ``draft`` can draft for ``target``."""
    vt, vd = vocab_size(target), vocab_size(draft)
    if vt != vd:
        raise DraftMismatch(
            f"draft model vocabulary has {vd} entries but the target's has {vt}; a draft must use the "
            "target's tokenizer (pick a smaller model of the same family, or use --draft-kind ngram)"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        dt, dd = tokenizer_digest(target_tokenizer), tokenizer_digest(draft_tokenizer)
        if dt != dd:
            a, b = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
            diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
            what = f"e.g. {diff}" if diff else "the EOS token ids differ"
            raise DraftMismatch(
                f"draft tokenizer differs from the target's ({len(b)} vs {len(a)} tokens; {what}); "
                "a draft must use the target's exact tokenizer (same family and version), or use "
                "--draft-kind ngram"
            )
    # the target's rejected drafts are taken back by spec.rewind (also over sliding windows and recurrent state);
    # the draft's own by trimming its caches (TwoModelSource.commit): a draft must be plain attention
    if not can_rewind(make_prompt_cache(target)):
        _check_rewindable(target, "target")
    _check_rewindable(draft, "draft")


def _param_count(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


class TwoModelSource:
    """A ``spec.source.BatchableDraftSource``: a speculating batch drafts for many of them in the same forwards."""

    drafts_in_batch = True

    def __init__(self, model, caches: Optional[list] = None, tokens: Sequence[int] = ()):
        self.model = model
        self._caches = caches if caches is not None else make_prompt_cache(model)
        self._tokens: list[int] = list(tokens) if caches is not None else []
        self._unfed: list[int] = []  # joined the sequence, not yet in the caches
        self._open: Optional[list[int] | mx.array] = None  # the open draft (an array until read)

    @property
    def caches(self) -> list:
        return self._caches

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def prefill(self, ids: Sequence[int]) -> None:
        ids = [int(t) for t in ids]
        p = 0
        limit = min(len(ids), len(self._tokens))
        while p < limit and ids[p] == self._tokens[p]:
            p += 1
        if p < len(self._tokens):
            trim_prompt_cache(self._caches, len(self._tokens) - p)
            del self._tokens[p:]
        self._unfed, self._open = [], None
        for s in range(p, len(ids), PREFILL_CHUNK):
            chunk = ids[s : s + PREFILL_CHUNK]
            self.model(mx.array(chunk)[None], cache=self._caches)
            mx.eval([c.state for c in self._caches])
            self._tokens.extend(chunk)

    # -- the bookkeeping shared with a batch that drafts for several sources (server.engine.batch.drafts) ---------
    def lend_caches(self) -> list:
        """Hand the caches over (a batch holds them until ``take_back``); refused while a draft is open."""
        if self._open is not None:
            raise RuntimeError("caches lent with a draft still open")
        caches, self._caches = self._caches, None
        return caches

    def take_back(self, caches: list) -> None:
        """The caches again, covering exactly ``tokens``."""
        self._caches = caches

    def queue_feed(self, feed: Sequence[int]) -> list[int]:
        """The sequence took ``feed``: returns everything the caches have not seen yet (to feed before drafting)."""
        if self._open is not None:
            raise RuntimeError("draft() called twice without commit()")
        self._unfed.extend(int(t) for t in feed)
        return list(self._unfed)

    def record_draft(self, drafts: list[int]) -> None:
        """The caches were fed the unfed tokens and ``drafts[:-1]``; ``drafts`` await ``commit``."""
        self._tokens.extend(self._unfed)
        self._tokens.extend(drafts[:-1])
        self._unfed = []
        self._open = drafts

    def record_verdict(self, drafted: Sequence[int] | mx.array, accepted: int) -> int:
        """``commit``'s bookkeeping: returns how many fed positions the caches must drop (the caller drops them).
        ``drafted``: what ``draft`` returned, or the array ``draft_lazy`` did."""
        if drafted is self._open and isinstance(drafted, mx.array) and accepted == 0:
            # the verify forward failed before reading it: nothing of it is kept, so nothing is read
            n, self._open = int(drafted.shape[0]), None
            return n - 1  # fed to the caches, never appended to the tokens
        self._read_open()
        given: Any = drafted.tolist() if isinstance(drafted, mx.array) else drafted
        drafted = [int(t) for t in given]
        if drafted != (self._open or []):
            raise RuntimeError("commit() of tokens this source did not draft")
        n = len(drafted)
        if not 0 <= accepted <= n:
            raise ValueError(f"accepted={accepted} outside 0..{n}")
        self._open = None
        if n == 0:
            return 0
        if accepted == n:
            self._unfed = [drafted[-1]]
            return 0
        rejected = n - 1 - accepted
        if rejected:
            del self._tokens[len(self._tokens) - rejected :]
        return rejected

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        if self.draft_lazy(feed, n) is None:
            return []
        self._read_open()
        return list(self._open or [])

    def draft_lazy(self, feed: Sequence[int], n: int) -> Optional[mx.array]:
        """``draft`` without waiting for the device: the drafts as an (n,) uint32 array it has been asked for, not
        read (spec.verify reads them with the verdict, in one wait); ``commit`` takes the array back or its tokens.
        None: nothing drafted."""
        self.queue_feed(feed)
        if n <= 0 or not self._unfed:
            return None
        y = mx.array(self._unfed, mx.uint32)
        ys: list[mx.array] = []
        for i in range(n):
            if i:
                y = ys[-1]
            logits = self.model(y[None], cache=self._caches)
            ys.append(mx.argmax(logits[0, -1:, :], axis=-1).astype(mx.uint32))
            mx.async_eval(ys[-1])
        proposed = mx.concatenate(ys)
        self._tokens.extend(self._unfed)  # the drafts fed past them are appended once read (``_read_open``)
        self._unfed = []
        self._open = proposed
        return proposed

    def _read_open(self) -> None:
        """An open draft still an array: read it, and the caches' tokens take the drafts they were fed."""
        if isinstance(self._open, mx.array):
            drafts: Any = self._open.tolist()
            self._open = [int(t) for t in drafts]
            self._tokens.extend(self._open[:-1])

    def commit(self, drafted: Sequence[int] | mx.array, accepted: int) -> None:
        rejected = self.record_verdict(drafted, accepted)
        if rejected:
            trim_prompt_cache(self._caches, rejected)


class TwoModelProvider(DraftProvider):
    """A draft model checked against the target once; ``identity`` names it in cache namespaces."""

    kind = "two-model"

    def __init__(
        self,
        target_model,
        draft_model,
        *,
        identity: str,
        target_tokenizer: Any = None,
        draft_tokenizer: Any = None,
    ):
        check_pair(target_model, draft_model, target_tokenizer, draft_tokenizer)
        self.model = draft_model
        self.identity = identity
        self.cost_ratio = _param_count(draft_model) / max(1, _param_count(target_model))

    @classmethod
    def from_loaded(cls, target, draft) -> "TwoModelProvider":
        """From two ``models.LoadedModel``s; the identity is the draft's fingerprint."""
        return cls(
            target.model,
            draft.model,
            identity=f"draft:{draft.fingerprint}",
            target_tokenizer=target.tokenizer,
            draft_tokenizer=draft.tokenizer,
        )

    def trace_caches(self, caches: Optional[list], n: int) -> list:
        """The draft model's caches after ``n`` more tokens, traced (DraftProvider.trace_caches)."""
        caches = make_prompt_cache(self.model) if caches is None else caches
        self.model(mx.array([[1] * n]), cache=caches)
        return caches

    def open(self, caches: Optional[list] = None, tokens: Sequence[int] = ()) -> TwoModelSource:
        if caches is not None and len(caches) != len(make_prompt_cache(self.model)):
            raise ValueError("draft caches do not match the draft model's layers")
        return TwoModelSource(self.model, caches, tokens)
