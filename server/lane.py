"""The lane: one thread that owns all model compute and advances every running sequence each tick.

``submit(job)`` appends to a FIFO (or raises ``QueueFull`` beyond ``max_queue`` waiting jobs). Each tick the
thread (policy in server.scheduler, model work in server.engine, the batch in server.batch):

1. admits waiting jobs, FIFO, while there is room (``--max-batch``, ``--memory-budget``): prefix-cache ``take``,
   the sequence's caches; a job cancelled while waiting ends without touching the model;
2. ends the sequences whose cancel flag is set (client gone; shutdown) and stores what they computed;
3. runs ONE prefill chunk (``--prefill-chunk``) of the oldest admitted sequence still prefilling;
4. runs one decode step for every decoding sequence: one batched forward for the batch (mlx-lm's
   ``GenerationBatch``) plus one step of each solo sequence.

Solo sequences: a speculative one (its verify step has its own shape), one whose caches cannot merge into a batch
(``--kv-bits``' QuantizedKVCache), and the only decoding sequence (plain ``generate_step`` beats a batch of one).
When a second plain sequence starts decoding, a solo plain one migrates into the batch; when the batch is down to
one row and nothing else decodes, that row leaves the batch and goes on solo. Nothing ever waits for the batch to
drain.

Shutdown, in three steps (server.serve.GracefulServer drives the first two):
  ``drain()``  refuse new jobs (``ShuttingDown``, a 503); queued and running jobs go on.
  ``abort()``  the drain ran out of time: cancel every queued and running job; each ends within one tick with
               ``Finished("cancelled")``, and ``aborted`` tells the HTTP layer to end its response with a
               shutdown error, not a cut.
  ``stop()``   cancel whatever is left and join the thread (its last cache put is done by then).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from typing import Optional

from server.engine import Active
from server.errors import InvalidRequest, QueueFull, ShuttingDown
from server.jobs import Delta, Finished, Job
from server.scheduler import Limits, MemoryBudget, Scheduler
from server.sequence import SeqState

log = logging.getLogger("mlx_lane.lane")


class LaneState(enum.Enum):
    STARTING = "starting"  # warming up; /health says so
    SERVING = "serving"
    DRAINING = "draining"  # refuses new jobs; running ones go on
    ABORTED = "aborted"  # draining ran out of time: every job was cancelled
    STOPPED = "stopped"


class Lane:
    def __init__(self, engine, *, max_queue: int = 0, token_delay_s: float = 0.0, max_batch: int = 8,
                 budget: Optional[MemoryBudget] = None, replay=None):
        self.engine = engine
        # server.replay.Leader (rank 0) or Follower (other ranks) of a model sharded over processes; None in a
        # single process, where no distributed code runs at all
        self.replay = replay
        self.max_queue = max_queue  # 0 = unbounded
        self.token_delay_s = token_delay_s  # test seam (MLX_LANE_TEST_TOKEN_DELAY): pause after each token
        self.scheduler = Scheduler(Limits(max_batch=max(1, max_batch), prefill_chunk=engine.prefill_chunk), budget)
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Active] = []  # admitted sequences, in admission order (lane thread only)
        self._running_ids: tuple[str, ...] = ()  # a snapshot for readers on other threads
        self._batch = None  # server.batch.DecodeBatch, made on the lane thread (engine.new_batch)
        self._tick_waiting: Optional[bool] = None  # see _tick
        self.follow_failed = False  # a follower's replay raised (server.serve.follow exits non-zero)
        self._cond = threading.Condition()
        self.state = LaneState.STARTING
        self.aborted = False  # set by abort(): a cancelled job was ended by the shutdown, not by its client
        self._thread = threading.Thread(target=self._run, name="mlx-lane", daemon=True)
        self.ready = threading.Event()  # set once the lane has warmed the model up

    # -- control --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def drain(self) -> int:
        """Refuse new jobs from now on; return how many are queued or running (they go on)."""
        with self._cond:
            if self.state in (LaneState.STARTING, LaneState.SERVING):
                self.state = LaneState.DRAINING
            return len(self._waiting) + len(self._running_ids)

    def abort(self) -> int:
        """Cancel every queued and running job (the drain ran out of time); return how many."""
        with self._cond:
            self.state = LaneState.ABORTED
            self.aborted = True
            n = self._cancel_all_locked()
            self._cond.notify_all()
            return n

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self.state = LaneState.STOPPED
            self._cancel_all_locked()
            self._cond.notify_all()
        self._thread.join(timeout)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """400 for a request that the memory budget can never admit (the handler asks before submitting)."""
        why = self.scheduler.budget.never_fits(prompt_tokens, max_tokens)
        if why:
            raise InvalidRequest(why, param="max_tokens", code="memory_budget_exceeded")

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.state not in (LaneState.STARTING, LaneState.SERVING):
                raise ShuttingDown("The server is shutting down and accepts no new requests; retry in a moment.",
                                   retry_after_s=5)
            if self.max_queue and len(self._waiting) >= self.max_queue:
                raise QueueFull(f"too many requests waiting ({len(self._waiting)}); retry later", retry_after_s=1)
            job.enqueued_at = time.monotonic()
            if self.token_delay_s:
                job.sink = _slowed(job.sink, self.token_delay_s)
            self._waiting.append(job)
            self._cond.notify()

    # -- introspection --------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running_ids(self) -> tuple[str, ...]:
        return self._running_ids

    @property
    def active_job_id(self) -> Optional[str]:
        ids = self._running_ids
        return ids[0] if ids else None

    def batch_size(self) -> int:
        batch = self._batch
        return len(batch) if batch is not None else 0

    def _cancel_all_locked(self) -> int:
        origin = getattr(self.replay, "origin", None)  # rank 0 of a group: the handler's job, not the lane's view
        jobs = [*self._waiting, *((origin(a.job) if origin else a.job) for a in list(self._active))]
        for job in jobs:
            job.cancel.set()
        return len(jobs)

    # -- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        self.engine.bind_stream(as_default=self.replay is not None)
        if self.replay is not None:  # the group's collectives run on the stream that runs the model
            self.replay.group.bind(self.engine.stream)
            self.replay.group.same_seed()
        try:
            self.engine.warmup()
        except Exception:
            log.exception("warm-up failed; serving anyway")
        self._batch = self.engine.new_batch()
        if self.replay is not None and not self.replay.group.leader:
            return self._follow()
        with self._cond:
            if self.state == LaneState.STARTING:
                self.state = LaneState.SERVING
        self.ready.set()
        while True:
            with self._cond:
                while not self._waiting and not self._active and self.state != LaneState.STOPPED:
                    self._cond.wait()
                if not self._waiting and not self._active:
                    if self.replay is not None:
                        self.replay.stop()  # the followers stop too
                    return  # stopped and nothing left
            if not self.tick():
                with self._cond:  # only jobs whose SSD prefix is still being read: wait for it, do not spin
                    self._cond.wait(0.005)

    def tick(self) -> bool:
        """One scheduling round (admit, cancel, one prefill chunk, one decode step); False when there was nothing to
        do. The thread calls it in a loop; the model-free tests call it directly, tick by tick, on a lane that was
        never started."""
        if self._batch is None:
            self._batch = self.engine.new_batch()
        with self._cond:
            jobs = self.scheduler.admit(self._waiting, self._active, ready=self._prefix_ready)
            waiting = bool(self._waiting)
        if not jobs and not self._active:
            return False
        if self.replay is not None:  # rank 0 of a group: every rank runs this tick on the same inputs
            jobs = self.replay.lead(jobs, self._active, waiting)
        else:
            waiting = None  # a single process reads the queue live (Lane._others_need_prefill)
        try:
            self._tick(jobs, waiting)
        except Exception:  # each step reports its own failures; this is a last resort
            log.exception("lane tick failed")
        self._running_ids = tuple(a.job.id for a in self._active)
        return True

    def _prefix_ready(self, job: Job) -> bool:
        ready = getattr(self.engine.prompt_cache, "ready", None)
        return ready is None or ready(job.prompt, self.engine.namespace_for(job.params), job.session)

    # -- a follower of a sharded model (server.replay) ------------------------------------
    def _follow(self) -> None:
        with self._cond:
            if self.state == LaneState.STARTING:
                self.state = LaneState.SERVING
        self.ready.set()
        try:
            self.replay.follow(self)
        except BaseException:  # the group cannot go on without this rank: the process exits non-zero
            log.exception("rank %d stopped following rank 0", self.replay.group.rank)
            self.follow_failed = True
        with self._cond:
            self.state = LaneState.STOPPED

    def running(self) -> list[Active]:
        """The admitted sequences (lane thread only)."""
        return list(self._active)

    def replay_tick(self, jobs: list, waiting: bool) -> None:
        """A follower runs rank 0's tick: the same admissions, cancellations and queue state (server.replay)."""
        if not jobs and not self._active:
            return
        try:
            self._tick(jobs, waiting)
        except Exception:
            log.exception("lane tick failed")
        self._running_ids = tuple(a.job.id for a in self._active)

    def _tick(self, jobs: list, waiting: Optional[bool] = None) -> None:
        """``waiting``: whether requests wait for admission, as rank 0 saw it at the tick start (a group); None
        reads the queue when asked (a single process)."""
        self._tick_waiting = waiting
        stats = self.engine.stats
        for job in jobs:
            stats.on_started(job.id)
            if job.cancel.is_set():
                finished = _cancelled_before_start(job)
                stats.on_finished(finished)
                job.sink(finished)
                continue
            try:
                self._active.append(self.engine.admit(job))
            except Exception as exc:
                log.exception("admitting %s failed", job.id)
                self.engine.fail_job(job, exc)
        for a in [a for a in self._active if a.job.cancel.is_set()]:
            self._end(a, "cancelled")
        plan = self.scheduler.prefill_plan((a for a in self._active if a.seq.state == SeqState.PREFILL),
                                           self.engine.prefill_left)
        prefilled, ready = 0, []
        for a, n in plan:
            before = a.done
            try:
                if self.engine.retake(a):  # an entry put this tick (or since admission) covers more of its prompt
                    n = min(n, self.engine.prefill_left(a))
                    before = a.done
                if self.engine.prefill_step(a, n, share=self._others_need_prefill):
                    ready.append(a)
                prefilled += a.done - before
            except Exception as exc:
                log.exception("prefill of %s failed", a.job.id)
                self._drop(a)
                self.engine.fail(a, exc)
        if ready:
            self._start_decode(ready)
        decoded = self._decode_step()
        stats.on_tick(batch=len(self._batch), prefill_tokens=prefilled, decode_tokens=decoded,
                      running=len(self._active))

    def _others_need_prefill(self) -> bool:
        """Requests wait, or more than one prefills: a prompt just prefilled may serve them (Engine.retake)."""
        waiting = self._tick_waiting if self._tick_waiting is not None else bool(self._waiting)
        return waiting or sum(a.seq.state == SeqState.PREFILL for a in self._active) > 1

    # -- decode ---------------------------------------------------------------------
    def _solo(self) -> list[Active]:
        return [a for a in self._active if a.seq.state == SeqState.DECODE and not a.in_batch]

    def _start_decode(self, ready: list[Active]) -> None:
        """Sequences that finished their prefill this tick: solo or the batch (see the module docstring). Those
        that join the batch join together, in one step."""
        plain = [a for a in ready if self.engine.batchable(a)]
        if not plain:
            return  # all solo
        others = [s for s in self._solo() if s not in ready and self.engine.can_migrate(s)]
        if len(plain) == 1 and not len(self._batch) and not others:
            return  # the only plain decoding sequence: the fast solo path
        joining = others + plain
        self._batch.add_many([(a, *self.engine.batch_entry(a), self._row(a)) for a in joining])

    def _row(self, a: Active) -> dict:
        return {"sampler": self.engine.row_sampler(a), "processors": self.engine.batch_processors(a)}

    def _decode_step(self) -> int:
        produced = 0
        if len(self._batch):
            try:
                rows = self._batch.step()
            except Exception as exc:
                log.exception("batched decode step failed; failing its %d sequences", len(self._batch))
                for a in self._batch.sequences:
                    self._drop(a)
                    self.engine.fail(a, exc)
                self._batch = self.engine.new_batch()
                rows = []
            ending = []
            for a, token, logprobs in rows:
                produced += 1
                reason = a.seq.on_token(token, logprobs)
                if reason is not None:
                    ending.append((a, reason))
            if ending:
                removed = self._batch.remove([a for a, _ in ending])
                for (a, reason), covered in zip(ending, removed):
                    self._drop(a)
                    self.engine.finish(a, reason, covered)
        for a in self._solo():
            try:
                out = self.engine.solo_step(a)
            except Exception as exc:
                log.exception("decode of %s failed", a.job.id)
                self._drop(a)
                self.engine.fail(a, exc)
                continue
            produced += 1 if out is not None else 0
            reason = "length" if out is None else a.seq.on_token(*out)
            if reason is not None:
                self._end(a, reason)
        self._leave_batch_of_one()
        return produced

    def _leave_batch_of_one(self) -> None:
        """A batch of one row is slower than the solo path: its last row goes on solo when nothing else decodes."""
        if len(self._batch) != 1 or self._solo() or any(a.seq.state == SeqState.PREFILL for a in self._active):
            return
        a = self._batch.sequences[0]
        if a.grammar is not None:  # see Engine.can_migrate
            return
        (tokens, caches), = self._batch.remove([a])
        self.engine.resume_solo(a, tokens, caches)

    def _end(self, a: Active, reason: str) -> None:
        covered = self._batch.remove([a])[0] if a.in_batch else None
        self._drop(a)
        self.engine.finish(a, reason, covered)

    def _drop(self, a: Active) -> None:
        self._active = [x for x in self._active if x is not a]


def _slowed(sink, delay_s: float):
    """The test seam: the lane sleeps after handing over each token (the engine checks the cancel flag next)."""

    def slow_sink(event) -> None:
        sink(event)
        if isinstance(event, Delta):
            time.sleep(delay_s)

    return slow_sink


def _cancelled_before_start(job: Job) -> Finished:
    return Finished(
        finish_reason="cancelled",
        prompt_tokens=len(job.prompt),
        completion_tokens=0,
        cached_tokens=0,
        prefill_tokens=0,
        prefill_s=0.0,
        decode_tokens=0,
        decode_s=0.0,
        queued_s=time.monotonic() - job.enqueued_at,
    )
