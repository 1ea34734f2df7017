"""Where draft tokens come from: ``DraftProvider`` (one per server) and ``DraftSource`` (one per request).

Sequence model. A request's token sequence S is the prompt followed by every token the
generator emitted. A source tracks S as it learns it:

- ``prefill(ids)`` - S is now ``ids`` (the lane passes ``prompt[:-1]``, the tokens the target's
  caches cover before decoding). A source whose caches already cover a prefix of ``ids``
  (a prompt-cache hit) computes only the rest; anything it held beyond the common prefix is
  dropped. Calling it again with ``prompt + generated`` before storing the caches brings a
  stateful source's caches to cover exactly the same tokens as the target's.
- ``draft(feed, n)`` - append ``feed`` (the tokens that joined S since the previous call: the
  first time ``[prompt[-1]]``, afterwards the correction or bonus token of the last round) and
  propose up to ``n`` tokens that might follow. May return fewer, or none.
- ``commit(drafted, accepted)`` - the first ``accepted`` of ``drafted`` (the list ``draft``
  returned) joined S; the source rewinds whatever it computed for the rest. Every ``draft``
  that returned tokens must be followed by exactly one ``commit`` before the next ``draft``.

Ownership: a source owns its caches (``caches``; ``None`` for a stateless source) for the
length of the request; the lane may store them in the prompt-cache entry next to the target's
after a final ``prefill(prompt + generated)``, and hands them back to ``open`` on a hit,
together with the tokens they cover.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

__all__ = ["DraftSource", "BatchableDraftSource", "HearingDraftSource", "DraftProvider"]


@runtime_checkable
class DraftSource(Protocol):
    """Per-request drafting state (see the module docstring for the sequence model)."""

    @property
    def caches(self) -> Optional[list]:
        """The source's own KV caches (None when it keeps none), covering ``tokens``."""
        ...

    @property
    def tokens(self) -> list[int]:
        """The tokens the source's caches cover (for a stateless source: what it has seen)."""
        ...

    def prefill(self, ids: Sequence[int]) -> None: ...

    def draft(self, feed: Sequence[int], n: int) -> list[int]: ...

    def commit(self, drafted: Sequence[int], accepted: int) -> None: ...

    @property
    def drafts_in_batch(self) -> bool:
        """True for a ``BatchableDraftSource``: a batch of speculating rows may run its forwards together with other
        rows' (server.engine.batch.drafts)."""
        ...


class BatchableDraftSource(DraftSource, Protocol):
    """A source whose drafting a batch can take over: its caches are lent to the batch, which feeds and drafts
    for many sources in the same forwards, and the source keeps the token bookkeeping of ``draft`` / ``commit``:

        fed = source.queue_feed(feed)        # the tokens its caches have not seen yet, to feed before drafting
        ... the batch feeds ``fed`` and drafts d1..dn, feeding d1..d(n-1) ...
        source.record_draft([d1, ..., dn])   # what was fed and proposed
        drop = source.record_verdict(drafts, accepted)   # after the target's verify: positions to drop
    """

    model: Any

    def lend_caches(self) -> list:
        """Hand the caches over (the batch holds them until ``take_back``); refused while a draft is open."""
        ...

    def take_back(self, caches: list) -> None:
        """The caches again, covering exactly ``tokens``."""
        ...

    def queue_feed(self, feed: Sequence[int]) -> list[int]: ...

    def record_draft(self, drafts: list[int]) -> None: ...

    def record_verdict(self, drafted: Sequence[int], accepted: int) -> int: ...


@runtime_checkable
class HearingDraftSource(DraftSource, Protocol):
    """A source that reads the target's hidden states (``hears_hidden`` True: spec.mtp.MtpSource). Whoever runs a
    target forward that fed its sequence calls ``heard`` right after it: ``tokens`` were fed at positions ``start``..
    of the sequence, in row ``row`` of the forward's batch; the source reads their hidden states from the target's
    tap. Such a source is told every token through ``draft`` (``n`` 0 when it is not to draft), so that what it
    heard and what it was fed agree."""

    hears_hidden: bool

    def heard(self, start: int, tokens: Sequence[int], row: int = 0) -> None: ...

    def can_catch_up(self, target_caches: list) -> bool:
        """Can it recompute later what it did not hear over these caches (so a decoder it cannot hear may run)?"""
        ...


class DraftProvider:
    """Built once at start-up; opens one ``DraftSource`` per request.

    ``identity`` joins the prompt-cache namespace when the source keeps KV of its own (two
    models); it is ``None`` for a source that keeps none (n-gram lookup), whose requests can
    share cache entries with plain ones. ``cost_ratio`` is the cost of one draft step relative
    to one target step (0 for lookup); the adaptive policy derives its break-even from it.
    """

    kind: str = "base"
    identity: Optional[str] = None
    cost_ratio: float = 0.0

    def open(self, caches: Optional[list] = None, tokens: Sequence[int] = ()) -> DraftSource:
        """A fresh source; ``caches`` (from a prompt-cache hit) cover ``tokens``."""
        raise NotImplementedError

    def trace_caches(self, caches: Optional[list], n: int) -> Optional[list]:
        """What one source's caches hold after ``n`` more tokens (``caches`` None: fresh ones), only traced: MLX
        builds the graph, so the arrays' shapes are known, and nothing runs. The server prices a speculating
        sequence's memory from it (server.engine.slot.traced_price). None: the source keeps no caches."""
        return None

    def policy(self, max_len: int):
        """The default adaptive draft-length policy for one request of this provider."""
        from spec.adaptive import AdaptiveDraftLength, break_even_rate

        return AdaptiveDraftLength(max_len, stop_below=break_even_rate(self.cost_ratio))
