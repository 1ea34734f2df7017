"""The lane's scheduling policy: which waiting jobs join, which prompt gets the next prefill chunk.

The scheduler only decides; the lane executes (vLLM's split between ``Scheduler`` and the model runner). It sees
jobs and sequences as plain objects, so every rule is tested without a model (tests/unit/test_scheduler.py).

Rules, in the order the lane applies them each tick:
1. Admission is FIFO: waiting jobs join while fewer than ``max_batch`` sequences run and the job's KV budget fits
   (see ``MemoryBudget``). The first job that does not fit stops admission (no overtaking: a large request is not
   starved by a stream of small ones). A job whose cache prefix is still being read from SSD (``ready(job)`` is
   False) waits outside and does not block the jobs behind it: its read is not on the lane's clock.
2. At most one chunk's worth of prompt tokens (``prefill_chunk``) per tick, oldest admitted sequence first: a long
   prompt delays the running decodes by at most one chunk per tick; short prompts share the tick's budget (several
   finish their prefill together and join the batch in one step, instead of one join - one extra forward and one
   copy of the batch's KV - per tick). With ``prefill_batch`` B > 1 (a GPU, where one forward over several
   prompts beats one forward each), up to B sequences get up to one chunk each, and the lane prefills them in one
   batched forward: the tick's stall is one chunk's duration of a B-row forward, as in mlx-lm's BatchGenerator.
3. Then one decode step for every decoding sequence (the lane's business: the batch, plus solo sequences).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence as Seq


@dataclass(frozen=True)
class Limits:
    max_batch: int  # sequences admitted at once (prefilling + decoding)
    prefill_chunk: int  # prompt tokens per prefill step
    prefill_batch: int = 1  # prompts whose chunks one tick may prefill together (one batched forward)


class MemoryBudget:
    """Admission by KV bytes: a sequence joins only when its KV for prompt + max_tokens fits beside the running
    ones, the model's weights and the RAM tier (which yields first: ``make_room`` evicts/spills it down).

    ``budget_bytes`` 0 turns the check off. ``kv_bytes_per_token`` is the model's KV footprint per token (all
    layers). ``fixed_bytes()`` is what is not ours to free (the weights); ``cache_bytes()`` what the RAM tier
    holds now, and ``make_room(n)`` asks it to shrink by n bytes (returns the bytes it freed)."""

    def __init__(self, budget_bytes: int, kv_bytes_per_token: float, *, fixed_bytes: int = 0,
                 cache_bytes: Callable[[], int] = lambda: 0, make_room: Callable[[int], int] = lambda n: 0):
        self.budget_bytes = budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.fixed_bytes = fixed_bytes
        self.cache_bytes = cache_bytes
        self.make_room = make_room

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        return int(self.kv_bytes_per_token * (prompt_tokens + max_tokens))

    def never_fits(self, prompt_tokens: int, max_tokens: int) -> Optional[str]:
        """Why a request can never be admitted (None when it can)."""
        if not self.budget_bytes:
            return None
        room = self.budget_bytes - self.fixed_bytes
        need = self.need(prompt_tokens, max_tokens)
        if need > room:
            return (f"this request needs about {need / 2**20:.0f} MiB of KV cache for {prompt_tokens} prompt + "
                    f"{max_tokens} completion tokens, more than the server's --memory-budget leaves beside the "
                    f"model ({room / 2**20:.0f} MiB): lower max_tokens or shorten the prompt")
        return None

    def fits(self, need: int, running: int) -> bool:
        """True when ``need`` more bytes fit beside ``running`` bytes of admitted sequences; the RAM tier is asked to
        make room first when that alone would make it fit."""
        if not self.budget_bytes:
            return True
        free = self.budget_bytes - self.fixed_bytes - running - self.cache_bytes()
        if need <= free:
            return True
        if need <= self.budget_bytes - self.fixed_bytes - running:  # fits once the RAM tier yields
            self.make_room(need - free)
            return need <= self.budget_bytes - self.fixed_bytes - running - self.cache_bytes()
        return False


class Scheduler:
    def __init__(self, limits: Limits, budget: Optional[MemoryBudget] = None):
        self.limits = limits
        self.budget = budget or MemoryBudget(0, 0.0)

    def admit(self, waiting: collections.deque, running: Seq, ready: Callable[[object], bool] = lambda j: True,
              need_of: Optional[Callable[[object], int]] = None) -> list:
        """Pop and return the jobs that join now, FIFO (see the module docstring). ``running`` are the admitted
        sequences; ``need_of(x)`` the KV bytes a job or sequence reserves (default: from prompt + max_tokens)."""
        need_of = need_of or (lambda j: self.budget.need(len(j.prompt), j.params.max_tokens))
        room = self.limits.max_batch - len(running)
        reserved = sum(need_of(s.job if hasattr(s, "job") else s) for s in running)
        admitted, skipped = [], []
        while waiting and room > 0:
            job = waiting[0]
            if job.cancel.is_set():  # the lane ends it without admitting it
                admitted.append(waiting.popleft())
                continue
            if not ready(job):
                skipped.append(waiting.popleft())
                continue
            need = need_of(job)
            if not self.budget.fits(need, reserved):
                break
            admitted.append(waiting.popleft())
            reserved += need
            room -= 1
        waiting.extendleft(reversed(skipped))  # they keep their place at the head
        return admitted

    def prefill_plan(self, prefilling: Iterable, remaining: Callable[[object], int]) -> list:
        """``[(seq, tokens), ...]`` to prefill this tick: admission order, at most ``prefill_chunk`` tokens in all
        (``prefill_batch`` > 1: at most that many sequences, each at most ``prefill_chunk`` tokens).
        ``remaining(seq)`` is how many prompt tokens a sequence still has to compute (0: only its last token, which
        the decode step computes; it is planned with 0 so it moves on to decoding this tick)."""
        chunk, rows = self.limits.prefill_chunk, max(1, self.limits.prefill_batch)
        budget = chunk * rows
        plan, computing = [], 0
        for seq in prefilling:
            left = remaining(seq)
            if left and (budget <= 0 or (rows > 1 and computing == rows)):
                break
            computing += bool(left)
            n = min(left, budget, chunk)
            plan.append((seq, n))
            budget -= n
            if n < left and rows == 1:
                break  # one sequence at a time: the rest of its prompt comes first next tick
        return plan
