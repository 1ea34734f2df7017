"""The lane's scheduling policy: ``Scheduler.schedule(waiting, running) -> TickPlan``, every per-tick decision.

The scheduler only decides (vLLM's split between ``Scheduler`` and the model runner); the lane executes the plan
(server.lane.plan). It reads sequences as plain data (phase, prompt, ``covered``, the facts the engine gave when they
arrived: ``facts.group``, ``facts.batchable``, ``facts.prefill_together``, ``migratable`` and ``joinable``), so every rule is tested
without a model (tests/unit/test_scheduler.py). The rules, in plan order:

1. Cancelled sequences end: queued ones without touching the model, running ones after storing what they computed.
2. Admission is FIFO: queued sequences join while fewer than ``max_batch`` run and their KV (prompt + max_tokens)
   fits the memory budget, the RAM tier yielding first (server.lane.budget). The first that does not fit stops
   admission (no overtaking: a large request is not starved by a stream of small ones). One whose cached prefix is
   still being read from SSD (``ready`` says no) waits outside and does not block those behind it: the read is
   not on the lane's clock.
3. Prefill: at most one chunk's worth of prompt tokens (``prefill_chunk``) per tick, so a long prompt delays the
   running decodes by at most one chunk per tick. The leading chunks that complete their sequences' prefills run
   before the tick's decode step (those sequences decode in it), every other chunk after it (``prefill_late``):
   running decodes, then the cheapest remaining prefills, and a turn that needs a short chunk waits for no one
   else's. The cheapest remaining prefills go first (an agent's turn whose
   prompt is almost all cached answers at once instead of waiting behind other requests' long prompts; ties keep
   admission order); a sequence passed over ``STARVE_TICKS`` plans in a row goes first, so a long prompt is never
   starved by a stream of short ones. Short prompts share the tick's budget (they finish together and join the
   batch in one step). A chunk ends at a sequence's anchor (a client's cache
   breakpoint), so the engine can store that prefix as an entry of its own. With ``prefill_batch`` B > 1 (a GPU, where one forward
   over several prompts beats one forward each), up to B sequences get up to one chunk each, gathered into
   batched forwards of those that may prefill together; one that shares at least ``SHARED_PREFIX_MIN`` tokens
   with a prompt gathered before it goes in a later group, so that it takes the shared prefix from the cache
   instead of computing it again. Prompts go into the cache at once (``store_now``) when requests wait or several
   prefill: they may share a prefix.
4. Start: a sequence whose prefill completes decodes solo when it is its group's only plain decoding sequence
   (plain ``generate_step`` beats a batch of one); otherwise it joins its group's batch, and the group's solo
   sequences that may move migrate in with it. Speculative sequences and caches that cannot merge stay solo, but
   one that speculates alone only for want of company (``yields``: its model cannot speculate in a batch) joins the
   batch, drafting no more, once its group has one or other rows start or decode on their own: it migrates in like
   a solo sequence, or, ready now, starts in the batch.
5. Leave: a batch down to one row, with nothing else of its group prefilling or decoding, goes on solo.
6. Decode: one step of every group's batch (each adapter has its own: no group waits for another) and of every
   solo sequence. Then one lane task, if one waits.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Optional

from cache.prefix import common_prefix
from server.lane.budget import MemoryBudget
from server.lane.plan import Chunk, Start, TickPlan
from server.lane.sequence import Phase, Sequence

__all__ = ["Limits", "Scheduler", "SHARED_PREFIX_MIN"]

SHARED_PREFIX_MIN = 64  # tokens of a prompt that another one computing this tick would put in the cache for it
STARVE_TICKS = 8  # plans a prefilling sequence may be passed over before it goes first


@dataclass(frozen=True)
class Limits:
    max_batch: int  # sequences admitted at once (prefilling + decoding)
    prefill_chunk: int  # prompt tokens per prefill step
    prefill_batch: int = 1  # prompts whose chunks one tick may prefill together (one batched forward)
    # a chunk past a cached prefix longer than a chunk joins a batched forward when it is at most this long (0:
    # never but for hybrids): a short chunk's own forward is mostly fixed cost (--prefill-together-max)
    together_max: int = 0


class Scheduler:
    def __init__(self, limits: Limits, budget: Optional[MemoryBudget] = None):
        self.limits = limits
        self.budget = budget or MemoryBudget(0, 0.0)
        self._passed: dict[str, int] = {}  # sequence id -> plans in a row it had prompt left and got no chunk

    def need(self, seq: Sequence) -> int:
        """KV bytes a sequence reserves: its prompt + max_tokens."""
        return self.budget.need(len(seq.prompt), seq.params.max_tokens, seq.kv_price)

    def reserved(self, live: Seq[Sequence], batch_bytes: int = 0) -> int:
        """KV bytes the running sequences hold: each one's need, or for the batched ones together what the batches'
        buffers hold when that is more (free slots and unused positions the ragged layout keeps until its batch
        empties, left-padding in mlx-lm's: room a joining row may use, but not room another request can have)."""
        batched = sum(self.need(s) for s in live if s.phase == Phase.BATCHED)
        return sum(self.need(s) for s in live) + max(0, int(batch_bytes) - batched)

    def schedule(self, waiting: Seq[Sequence], running: Seq[Sequence], *, task: bool = False,
                 ready: Callable[[Sequence], bool] = lambda s: True,
                 lookup: Callable[[Sequence], int] = lambda s: 0, batch_bytes: int = 0) -> TickPlan:
        """This tick's plan (see the module docstring). ``waiting``: the queue, in order; ``running``: the admitted
        sequences, in admission order. ``ready(seq)``: its cached prefix is in RAM (False while an SSD read is in
        flight; asked only of sequences the queue reaches); ``lookup(seq)``: the prompt tokens the prefix cache
        would give it now (index-only), to size its first chunk. ``task``: a lane task waits. ``batch_bytes``: what
        the decode batches' KV buffers hold (``reserved``)."""
        end_waiting = tuple(s for s in waiting if s.cancelled)
        cancel = tuple(s for s in running if s.cancelled)
        live = [s for s in running if not s.cancelled]

        # 2. admission
        admit, io_wait = self._admit([s for s in waiting if not s.cancelled], live, ready)
        needs = [self.need(s) for s in admit]
        count, make_room = self.budget.admissible(needs, self.reserved(live, batch_bytes))
        admit = admit[:count]
        left_queued = len(waiting) - len(end_waiting) - len(admit)
        # an admitted sequence's prefix is taken when the plan runs: size its chunks by what the cache has now
        expected = {id(s): min(max(0, lookup(s)), max(0, len(s.prompt) - 1)) for s in admit}
        done = lambda s: expected.get(id(s), s.covered)  # noqa: E731
        left = lambda s: max(0, len(s.prompt) - 1 - done(s))  # noqa: E731

        # 3. prefill
        prefilling = self._prefill_order([s for s in live if s.phase == Phase.PREFILL] + list(admit), left)
        waiters, anchors = self._shared_waits(prefilling, done, {id(s) for s in admit})
        anchor_at = {id(s): pos for s, pos in anchors}
        chunks = self._chunks([s for s in prefilling if id(s) not in waiters], left, anchor_at)
        self._note_passed([s for s in prefilling if id(s) not in waiters], chunks, left)
        groups = self._gather(chunks, done)
        store_now = bool(left_queued) or len(prefilling) > 1
        early, late = _split_completing(groups, left)

        # 4. start: what completes before this tick's decode, or completed since the last plan (a late chunk, or a
        # retake that finished a prefill early)
        completing = [c.seq for g in early for c in g]
        ready_now = [s for s in live if s.phase == Phase.READY] + completing
        starts, migrating = self._starts(ready_now, live)

        # 5. leave, 6. decode
        rows: dict = {}
        for s in live:
            if s.phase == Phase.BATCHED:
                rows.setdefault(s.group, []).append(s)
        joining = {st.group: len(st.batch) for st in starts if st.batch}
        busy = {s.group for s in [*live, *admit] if s.phase in (Phase.PREFILL, Phase.READY, Phase.WAITING) or
                (s.phase == Phase.SOLO and s not in migrating)}
        busy |= {st.group for st in starts if st.solo}
        leave = tuple(group_rows[0] for group, group_rows in rows.items()
                      if len(group_rows) == 1 and not joining.get(group) and group not in busy
                      and group_rows[0].migratable)
        decode = tuple(g for g in dict.fromkeys([*rows, *joining])
                       if len(rows.get(g, ())) - sum(s.group == g for s in leave) + joining.get(g, 0) > 0)
        started_solo = {id(s) for st in starts for s in st.solo}
        solo = tuple(s for s in [*live, *admit] if (s.phase == Phase.SOLO and s not in migrating)
                     or id(s) in started_solo or s in leave)
        return TickPlan(end_waiting=end_waiting, make_room=make_room, admit=tuple(admit), cancel=cancel,
                        anchor=tuple(anchors), prefill=early, prefill_late=late, store_now=store_now and bool(groups),
                        start=starts, leave=leave, decode=decode, solo=solo, task=task, waiting_io=io_wait)

    # -- the rules -------------------------------------------------------------------------------------------------
    def _admit(self, queue: list, live: list, ready) -> tuple[list, tuple]:
        """Queued sequences that may join by count and readiness (FIFO), and those skipped: their prefix is still
        being read, and they keep their place."""
        room = self.limits.max_batch - len(live)
        admit, io_wait = [], []
        for s in queue:
            if room <= 0:
                break
            if not ready(s):
                io_wait.append(s)
                continue
            admit.append(s)
            room -= 1
        return admit, tuple(io_wait)

    def _prefill_order(self, prefilling: list, left) -> list:
        """Who prefills first (rule 3): those passed over ``STARVE_TICKS`` plans in a row, then the cheapest
        remaining prefills; ties (and the starved among themselves) in admission order."""
        starved = [s for s in prefilling if self._passed.get(s.id, 0) >= STARVE_TICKS]
        rest = sorted((s for s in prefilling if self._passed.get(s.id, 0) < STARVE_TICKS), key=left)
        return starved + rest

    def _note_passed(self, prefilling: list, chunks: list, left) -> None:
        served = {id(c.seq) for c in chunks if c.tokens or not left(c.seq)}
        self._passed = {s.id: 0 if id(s) in served else self._passed.get(s.id, 0) + 1
                        for s in prefilling if left(s)}

    def _shared_waits(self, order: list, done, admitted: set) -> tuple[set, list]:
        """Rule 3's shared prefixes: a sequence that has computed nothing of its own yet (all it covers came from the
        cache) and shares at least ``SHARED_PREFIX_MIN`` more tokens with a sequence before it in ``order`` that has
        not computed them yet, waits: that one gets an anchor where the shared part ends, stores it when its chunk
        gets there, and the waiting one takes it from the cache. Returns the waiting sequences' ids and the new
        ``(sequence, position)`` anchors."""
        waiters: set = set()
        anchors: dict = {}
        for i, s in enumerate(order):
            if id(s) not in admitted and s.covered != s.cached:
                continue  # it computed part of its prompt itself: a take could not replace its caches any more
            for e in order[:i]:
                if id(e) in waiters:
                    continue
                shared = common_prefix(e.prompt, s.prompt, min(len(e.prompt), len(s.prompt)) - 1)
                if shared - done(s) < SHARED_PREFIX_MIN or done(e) >= shared:
                    continue
                waiters.add(id(s))
                if shared not in e.anchors and id(e) not in anchors:
                    anchors[id(e)] = (e, shared)
                break
        return waiters, list(anchors.values())

    def _chunks(self, prefilling: list, left, anchor_at: Optional[dict] = None) -> list[Chunk]:
        """In ``_prefill_order``, at most ``prefill_chunk`` tokens in all (``prefill_batch`` > 1: at most that many
        sequences, each at most ``prefill_chunk``). A sequence with nothing left (its prompt is covered but for
        the last token, which the first decode step computes) gets a chunk of 0 so it moves on to decoding."""
        chunk, rows = self.limits.prefill_chunk, max(1, self.limits.prefill_batch)
        budget = chunk * rows
        plan, computing = [], 0
        for s in prefilling:
            n_left = left(s)
            if n_left and (budget <= 0 or (rows > 1 and computing == rows)):
                break
            computing += bool(n_left)
            n = min(n_left, budget, chunk)
            at = len(s.prompt) - 1 - n_left
            ahead = [a for a in (s.next_anchor(at), (anchor_at or {}).get(id(s))) if a is not None and a > at]
            if ahead and min(ahead) - at < n:
                n = min(ahead) - at  # a chunk ends at an anchor: that prefix is stored
            plan.append(Chunk(s, n))
            budget -= n
            if n < n_left and rows == 1:
                break  # one sequence at a time: the rest of its prompt comes first next tick
        return plan

    def _gather(self, chunks: list[Chunk], done) -> tuple[tuple[Chunk, ...], ...]:
        """Chunks into forwards, in order: with ``prefill_batch`` > 1, those that may prefill together join one
        group (at most ``prefill_batch``; a cached prefix no longer than a chunk: the batched forward copies each
        row's prefix in and out and attends through a mask over its cached keys: worth it for new prompts, not for a
        long cache hit, unless ``facts.together_after_hits``: a hybrid's prompt costs far more per token than that;
        or unless the chunk is at most ``together_max`` tokens: a short chunk's own forward costs about as much as a
        longer one's, mostly the weights' reads, launches and (on CUDA) a per-shape attention plan, so gathered they
        share it: on the H200 eight gpt-oss chunks of 330 tokens over 5.0-5.3k-token caches took 0.35 s in one
        forward vs 0.81 s in eight when the shapes were new, as an agent's turns are, and 0.33 vs 0.37 s once seen);
        one sharing a prefix with a chunk already gathered starts a new group."""
        rows = self.limits.prefill_batch
        groups: list[list[Chunk]] = []
        open_: list[Chunk] = []
        for c in chunks:
            together = (rows > 1 and c.tokens > 0 and c.seq.facts.prefill_together
                        and (done(c.seq) <= self.limits.prefill_chunk or c.seq.facts.together_after_hits
                             or c.tokens <= self.limits.together_max))
            if open_ and (not together or len(open_) >= rows
                          or any(_shares_prefix(g.seq, c.seq, done(c.seq)) for g in open_)):
                groups.append(open_)
                open_ = []
            if together:
                open_.append(c)
            else:
                groups.append([c])
        if open_:
            groups.append(open_)
        return tuple(tuple(g) for g in groups)

    def _starts(self, ready_now: list, live: list) -> tuple[tuple[Start, ...], set]:
        """Where each sequence that begins decoding goes (rule 4), and the solo sequences that migrate."""
        batch_rows: dict = {}
        for s in live:
            if s.phase == Phase.BATCHED:
                batch_rows[s.group] = batch_rows.get(s.group, 0) + 1
        plain: dict = {}
        solo_only: dict = {}
        for s in ready_now:
            (plain if s.facts.batchable else solo_only).setdefault(s.group, []).append(s)
        starts: list = []
        migrating: set = set()
        for group in dict.fromkeys([*plain, *solo_only]):
            new = plain.get(group, [])
            others = [s for s in live if s.phase == Phase.SOLO and s.group == group and (s.joinable or s.yields)]
            if new or batch_rows.get(group) or others:  # company: those that would speculate alone start batched
                yielding = [s for s in solo_only.get(group, []) if s.yields]
                new = new + yielding
                solo_only[group] = [s for s in solo_only.get(group, []) if not s.yields]
            alone = len(new) == 1 and not batch_rows.get(group) and not others
            batch = () if (alone or not new) else tuple(others + new)
            migrating.update(others if batch else ())
            solo = tuple(solo_only.get(group, [])) + (tuple(new) if alone else ())
            starts.append(Start(group, batch, solo))
        return tuple(starts), migrating


def _split_completing(groups: tuple, left) -> tuple[tuple, tuple]:
    """Rule 3's order against the decode step: the leading prefill groups whose every chunk completes its sequence's
    prefill run before the tick's decode (those sequences decode in that same step: an almost fully cached turn
    answers after its own short chunk, not after other prompts' chunks too); the rest run after the decode step
    (their sequences, if they complete, decode first thing next tick). Only a leading run moves, so that the plan
    order that shared prefixes rely on (a prompt computed before one that takes it from the cache) holds."""
    n = 0
    while n < len(groups) and all(c.tokens >= left(c.seq) for c in groups[n]):
        n += 1
    return groups[:n], groups[n:]


def _shares_prefix(before: Sequence, s: Sequence, done: int) -> bool:
    """Does ``before``'s prompt hold at least SHARED_PREFIX_MIN tokens of ``s``'s prompt beyond the ``done`` that
    ``s`` has computed (so that ``s`` would take them from the cache once ``before`` is computed)?"""
    need = done + SHARED_PREFIX_MIN
    if len(before.prompt) < need or len(s.prompt) < need:
        return False
    return before.prompt[:need] == s.prompt[:need]
