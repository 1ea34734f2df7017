"""Prompt chunks: one forward for one sequence's chunk, or one batched forward for several (mlx-lm's
``PromptProcessingBatch``), and what a completed prompt stores.

``Prefiller.run(chunks, store_now)`` computes ``[(seq, n), ...]`` (each sequence's next ``n`` prompt tokens) and
returns a ``Prefilled`` per chunk. A chunk that ends at one of the sequence's anchors (a client's cache breakpoint)
stores that prefix as an entry of its own. A prompt that is complete (all but its last token, the first decode
step's input) is READY: its computed share feeds the SSD tier's restore-or-recompute rate (the base model's), its
draft source hears it (a source that reads the target's hidden states, spec.mtp, hears every chunk as it is fed),
and a prompt-boundary entry is stored when a layer cannot be trimmed back later (a sliding window, recurrent state:
the next turn needs exactly this boundary) or when ``store_now`` (others may share its prefix now; for trimmable
caches the final put supersedes it). Lane thread only.

A prompt with images (``Sequence.media``, server.core.media) has its cache key as ``prompt``; the chunks that hold
image tokens are fed as input embeddings (``_embeddings``: the vision encoder runs at the first such chunk, for the
images the prefix cache did not serve), the rest as tokens. Such a prompt prefills alone (``SeqFacts``).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch

from server.engine.store import CacheWriter, take_checkpoint
from server.engine.work import SeqWork
from server.lane.seam import Prefilled, SeqView

__all__ = ["Prefiller", "PrefillClock", "forward_together", "configure"]

# On a GPU each prefill forward hands MLX's freed buffers back to the device (mx.clear_cache, as mlx-lm's batch
# prefill does, three times for a gathered forward): the next step allocates them again. --debug-keep-prefill-buffers
# keeps them in MLX's cache instead, to measure what the release costs (the served forwards and steps on an H100 were
# 1.6-2.7x their in-process time, 2026-12-06; BENCHMARKS.md).
KEEP_BUFFERS = False
# --debug-prefill-wait: each prefill forward first waits for what the lane's stream already holds (the decode steps
# queued ahead of it, the lane pipelining them) and times that wait apart: a served 3-token forward took 70 ms on an
# H100 where one in-process took 15-20 ms (2026-12-07, BENCHMARKS.md), and its clock cannot tell its own time from
# that queue's. Costs the overlap of the forward's graph building with the queued work.
WAIT_FIRST = False


def configure(keep_buffers: bool = False, wait_first: bool = False) -> None:
    """--debug-keep-prefill-buffers and --debug-prefill-wait (before the lane starts)."""
    global KEEP_BUFFERS, WAIT_FIRST
    KEEP_BUFFERS = keep_buffers
    WAIT_FIRST = wait_first


@contextmanager
def _buffers_kept():
    """mlx-lm's ``PromptProcessingBatch.prompt`` clears MLX's buffer cache after each of its steps: not while
    KEEP_BUFFERS (lane thread only; no other thread frees buffers meanwhile)."""
    if not KEEP_BUFFERS:
        yield
        return
    clear = mx.clear_cache
    mx.clear_cache = lambda: None
    try:
        yield
    finally:
        mx.clear_cache = clear


RECENT_FORWARDS = 64  # the last forwards /stats lists, each (rows, length, tokens, cached, ms, new shape, parts)
RECENT_KEYS = ("rows", "length", "tokens", "cached", "ms", "new_shape", "build_ms", "clear_ms", "wait_ms")


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1e3, 2)


@dataclass
class PrefillClock:
    """Where the lane's prefill seconds go (/stats ``lane.prefill_parts``): the forwards (alone, or several prompts'
    chunks together), the checkpoints of layers that cannot be cut back, the cache entries stored; and how many
    distinct (rows, chunk length) forward shapes ran, since a GPU backend pays a shape's first forward more (cuDNN
    plans, mlx 0.32's CUDA backend); and the last ``RECENT_FORWARDS`` forwards one by one (``recent``: rows, longest
    chunk, tokens, the longest cached prefix they ran past, milliseconds, whether its shape was new, and of those
    milliseconds: ``build_ms`` the host's building of a lone forward's graph (None for a gathered one, whose
    graph mlx-lm builds and evaluates in one call), ``clear_ms`` MLX's freed buffers handed back to the device after
    it (a GPU; 0 elsewhere). The rest is the device's: the forward, and whatever the stream held before it (a
    pipelined decode step), unless ``wait_ms`` (--debug-prefill-wait; None otherwise) took that wait first, outside
    ``ms``)."""

    alone: int = 0
    together: int = 0
    together_rows: int = 0
    tokens: int = 0
    forward_s: float = 0.0
    checkpoint_s: float = 0.0
    store_s: float = 0.0
    shapes: set = field(default_factory=set)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_FORWARDS))

    def forward(self, rows: int, length: int, tokens: int, seconds: float, cached: int = 0,
                build_s: Optional[float] = None, clear_s: float = 0.0, wait_s: Optional[float] = None) -> None:
        """One forward of ``rows`` chunks, the longest ``length`` tokens, ``tokens`` in all, past at most ``cached``
        tokens of a row's cache; ``build_s`` / ``clear_s``: its parts, ``wait_s`` the wait before it (the class
        says which)."""
        self.recent.append((rows, length, tokens, cached, _ms(seconds), (rows, length) not in self.shapes,
                            _ms(build_s), _ms(clear_s), _ms(wait_s)))
        if rows > 1:
            self.together += 1
            self.together_rows += rows
        else:
            self.alone += 1
        self.tokens += tokens
        self.forward_s += seconds
        if len(self.shapes) < 100_000:  # a count, bounded
            self.shapes.add((rows, length))

    def as_dict(self) -> dict:
        return {"forwards": {"alone": self.alone, "together": self.together, "together_rows": self.together_rows},
                "tokens": self.tokens, "forward_s": round(self.forward_s, 3),
                "checkpoint_s": round(self.checkpoint_s, 3), "store_s": round(self.store_s, 3),
                "forward_shapes": len(self.shapes),
                "recent": [dict(zip(RECENT_KEYS, r)) for r in self.recent]}


class Prefiller:
    def __init__(self, work_of: Callable[[SeqView], SeqWork], writer: CacheWriter, prompt_cache: Any, *, gpu: bool,
                 stream_of: Callable[[], Any]):
        self._work_of = work_of
        self._writer = writer
        self._prompt_cache = prompt_cache
        self._gpu = gpu
        self._stream = stream_of  # the lane's MLX stream (made on the lane thread, after this object)
        self.encode_s = 0.0  # seconds the vision encoder ran (images' embeddings), for /stats
        self.images_encoded = 0
        self.clock = PrefillClock()

    def run(self, chunks: Sequence[tuple[SeqView, int]], store_now: bool) -> list[Prefilled]:
        computing = [(s, n) for s, n in chunks if n > 0 and self._left(s) > 0]
        out = {}
        if len(computing) > 1:
            self._together(computing)
        elif computing:
            self._one(*computing[0])
        t0 = time.monotonic()
        for seq, _ in computing:  # a model whose caches cannot be cut back keeps their state at each chunk's end
            work = self._work_of(seq)
            if work.slot.facts.needs_checkpoints:
                take_checkpoint(seq, work, work.covered)
        self.clock.checkpoint_s += time.monotonic() - t0
        for seq, _ in chunks:
            work = self._work_of(seq)
            ready = work.covered >= len(seq.prompt) - 1 and self._complete(seq, work, store_now)
            if not ready and work.covered in seq.anchors:
                self._store(seq.prompt[: work.covered], seq, work, anchor=True)  # a breakpoint: an entry of its own
            out[id(seq)] = Prefilled(seq, work.covered, ready, work.stored)
        return [out[id(s)] for s, _ in chunks]

    def _left(self, seq) -> int:
        return max(0, len(seq.prompt) - 1 - self._work_of(seq).covered)

    def _one(self, seq, n: int) -> None:
        work = self._work_of(seq)
        n = min(n, self._left(seq))
        cached = work.covered
        wait_s = self._wait_for_the_stream()
        t0 = time.monotonic()
        with mx.stream(self._stream()):
            start, end = work.covered, work.covered + n
            embeds = self._embeddings(seq, work) if seq.media is not None else None
            if embeds is not None and start < embeds[1]:  # image tokens: the model reads their embeddings
                cut = min(end, embeds[1])
                ids = mx.array(seq.media.input_ids[start:cut])[None]
                # a slice is a new array: the model scales its input embeddings in place (``h *= ...``)
                work.model(ids, cache=work.caches, input_embeddings=embeds[2][start - embeds[0]: cut - embeds[0]][None])
                _heard(work, start, seq.prompt[start:cut])
                start = cut
                if cut == embeds[1]:
                    work.embeds = None  # past every image: the embeddings are done with
            if start < end:  # text: past the last image, the cache key's tokens are the prompt's own
                work.model(mx.array(seq.prompt[start:end])[None], cache=work.caches)
                _heard(work, start, seq.prompt[start:end])
            built = time.monotonic()
            mx.eval([c.state for c in _caches(work)])
            clear_s = self._hand_back_buffers()
        work.covered += n
        done = time.monotonic()
        work.prefill_cost_s += done - t0
        self.clock.forward(1, n, n, done - t0, cached, build_s=built - t0, clear_s=clear_s, wait_s=wait_s)

    def _wait_for_the_stream(self) -> Optional[float]:
        """With --debug-prefill-wait: the seconds spent waiting for what the lane's stream held before this forward;
        None (no wait) otherwise."""
        if not WAIT_FIRST:
            return None
        t0 = time.monotonic()
        mx.synchronize(self._stream())
        return time.monotonic() - t0

    def _hand_back_buffers(self) -> float:
        """After a forward on a GPU, MLX's freed activations go back to the device, as mlx-lm's batch prefill does
        (not with --debug-keep-prefill-buffers; on the CPU it would only cost page faults on the next chunk's
        buffers). The seconds it took."""
        if not self._gpu or KEEP_BUFFERS:
            return 0.0
        t0 = time.monotonic()
        mx.clear_cache()
        return time.monotonic() - t0

    def _embeddings(self, seq, work: SeqWork) -> Optional[tuple]:
        """``(start, stop, array)``: the input embeddings of the prompt from ``start`` to the end of its last image
        that the caches do not cover whole (mlx-vlm's ``get_input_embeddings`` over those images: the vision
        encoder runs here, on the lane, once per request and only for images the prefix cache did not serve); None
        when the caches already cover every image. The encoding's time is the prefill's (``encode_s`` counts it)."""
        covered = work.covered
        if work.embeds is not None and work.embeds[0] <= covered:
            return work.embeds
        window = seq.media.window(covered)
        if window is None:
            return None
        lo, hi, first, last = window
        t0 = time.monotonic()
        pixels, grid = seq.media.pixels(first, last)
        array = work.slot.vision.embed(seq.media.input_ids[lo:hi], pixels, grid)[covered - lo:]
        mx.eval(array)
        self.encode_s += time.monotonic() - t0
        self.images_encoded += last - first
        work.embeds = (covered, hi, array)
        return work.embeds

    def _together(self, items: list) -> None:
        """One batched forward: ``PromptProcessingBatch`` merges the rows' caches (left-padded), right-pads the
        chunks, rolls the padding away and each row's own caches are extracted after. One forward for B prompts beats
        B forwards on a GPU (mlx-lm's --prompt-concurrency)."""
        works = [self._work_of(s) for s, _ in items]
        items = [(s, min(n, self._left(s))) for s, n in items]
        cached = max(w.covered for w in works)
        wait_s = self._wait_for_the_stream()
        t0 = time.monotonic()
        with mx.stream(self._stream()):
            caches = forward_together(works[0].model, [_caches(w) for w in works],
                                      [list(s.prompt[w.covered: w.covered + n]) for (s, n), w in zip(items, works)])
            clear_s = self._hand_back_buffers()
        dt = time.monotonic() - t0
        total = sum(n for _, n in items)
        self.clock.forward(len(items), max(n for _, n in items), total, dt, cached, clear_s=clear_s, wait_s=wait_s)
        for (seq, n), work, row in zip(items, works, caches):
            work.caches, work.covered = row, work.covered + n
            work.prefill_cost_s += dt * n / total if total else 0.0  # this machine's rate, not B times less

    def _complete(self, seq, work: SeqWork, store_now: bool) -> bool:
        """The prompt is computed (all but its last token): account, share, and say it is ready to decode."""
        prompt = seq.prompt
        if work.covered > work.cached and work.slot.base:
            # feeds the SSD tier's restore-or-recompute decision, which is the base model's: another model's rate
            # (a tiny one prefills 50x faster) made it decline every write, and the rate is saved across restarts
            self._prompt_cache.observe_prefill(work.covered - work.cached, work.prefill_cost_s)
        if work.spec is not None:
            with mx.stream(self._stream()):
                work.spec.source.prefill(prompt[: work.covered])
        if work.covered in seq.anchors:
            self._store(prompt[:-1], seq, work, anchor=True)
        elif not all(c.is_trimmable() for c in _caches(work)) or (work.covered > work.cached and store_now):
            # a prompt-boundary entry: the next turn of a sliding-window model needs it (its caches cannot be
            # trimmed back to the prompt later), and requests beside this one may share its prefix now; for
            # trimmable caches the final put supersedes it
            self._store(prompt[:-1], seq, work)
        return True

    def _store(self, tokens, seq, work: SeqWork, anchor: bool = False) -> None:
        t0 = time.monotonic()
        with mx.stream(self._stream()):
            self._writer.store(tokens, _caches(work), seq, work, anchor=anchor)
        self.clock.store_s += time.monotonic() - t0


def _heard(work: SeqWork, start: int, tokens) -> None:
    """A draft source that reads the target's hidden states (spec.mtp) hears the chunk just fed (spec.source)."""
    if work.spec is not None and getattr(work.spec.source, "hears_hidden", False):
        work.spec.source.heard(start, list(tokens))


def forward_together(model, caches: list[list], chunks: list[list[int]]) -> list[list]:
    """One batched forward of each row's next chunk over its own caches (any lengths, cached or not): mlx-lm's
    ``PromptProcessingBatch`` merges the rows' caches (left-padded), right-pads the chunks and rolls the padding away;
    returns each row's caches extracted after, evaluated. The lane's prefill and its warm-up run exactly this."""
    batch = PromptProcessingBatch(model, list(range(len(chunks))), caches, tokens=[[] for _ in chunks],
                                  prefill_step_size=max(len(c) for c in chunks))
    with _buffers_kept():
        batch.prompt(chunks)
    out = [batch.extract_cache(i) for i in range(len(chunks))]
    mx.eval([c.state for row in out for c in row])
    return out


def _caches(work: SeqWork) -> list:
    """A prefilling sequence's own caches (it holds them from admission until it joins a batch)."""
    if work.caches is None:
        raise RuntimeError("a sequence prefills on caches of its own: it has none (it decodes already)")
    return work.caches
