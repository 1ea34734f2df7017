"""The lane: one thread that owns all model compute and advances every running sequence each tick.

(About 530 lines, one job: the tick loop and its lifecycle. Adapter groups, tasks and the sharded replay hooks are
part of the same tick; policy is in server.scheduler, model work in server.engine, replay in server.replay. The
next split, when it grows: the prefill-grouping of _prefill into the scheduler.)

``submit(job)`` appends to a FIFO (or raises ``QueueFull`` beyond ``max_queue`` waiting jobs). Each tick the
thread (policy in server.scheduler, model work in server.engine, the batch in server.batch):

1. admits waiting jobs, FIFO, while there is room (``--max-batch``, ``--memory-budget``): prefix-cache ``take``,
   the sequence's caches; a job cancelled while waiting ends without touching the model;
2. ends the sequences whose cancel flag is set (client gone; shutdown) and stores what they computed;
3. runs ONE prefill chunk (``--prefill-chunk``) of the oldest admitted sequence still prefilling (with
   ``--prefill-batch`` B > 1: the next chunks of up to B sequences, in one batched forward);
4. runs one decode step for every decoding sequence: one batched forward for the batch (mlx-lm's
   ``GenerationBatch``) plus one step of each solo sequence.

Adapter groups (issue 17): rows of one batched forward share a model, so each LoRA adapter in use has its own batch
(``engine.batch_key``) and every tick steps each group's batch once, one after the other: no adapter's requests
wait for another's to finish, and base-model requests run exactly as without adapters. The solo/batch rules below
hold per group.

Tasks (``call(fn)``): model work that is not a sequence (an embeddings batch, loading an adapter) runs on this
thread too, at most one per tick, so it never contends with the decode steps for the cores and delays them by at
most one task.

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
import concurrent.futures
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
                 budget: Optional[MemoryBudget] = None, prefill_batch: int = 1, replay=None):
        self.engine = engine
        # server.replay.Leader (rank 0) or Follower (other ranks) of a model sharded over processes; None in a
        # single process, where no distributed code runs at all
        self.replay = replay
        self.max_queue = max_queue  # 0 = unbounded
        self.token_delay_s = token_delay_s  # test seam (MLX_LANE_TEST_TOKEN_DELAY): pause after each token
        self.scheduler = Scheduler(Limits(max_batch=max(1, max_batch), prefill_chunk=engine.prefill_chunk,
                                          prefill_batch=max(1, prefill_batch)), budget)
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Active] = []  # admitted sequences, in admission order (lane thread only)
        self._running_ids: tuple[str, ...] = ()  # a snapshot for readers on other threads
        # server.batch.DecodeBatch per adapter group (key: engine.batch_key; None = the base model), made on the
        # lane thread (engine.new_batch); the base batch always exists, an adapter's exists while it has rows
        self._batches: dict = {}
        self._tasks: collections.deque = collections.deque()  # (callable, Future): model work other than a sequence
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
            self.engine.stats.on_queued(job.id)
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
        return sum(len(b) for b in list(self._batches.values()))

    @property
    def _batch(self):
        """The base model's decode batch."""
        return self._batches.get(None)

    def _cancel_all_locked(self) -> int:
        origin = getattr(self.replay, "origin", None)  # rank 0 of a group: the handler's job, not the lane's view
        jobs = [*self._waiting, *((origin(a.job) if origin else a.job) for a in list(self._active))]
        for job in jobs:
            job.cancel.set()
        while self._tasks:  # tasks not started: their callers get CancelledError
            self._tasks.popleft()[1].cancel()
        return len(jobs)

    # -- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        _name_os_thread("mlx-lane")
        self.engine.bind_stream(as_default=self.replay is not None)
        if self.replay is not None:  # the group's collectives run on the stream that runs the model
            self.replay.group.bind(self.engine.stream)
            self.replay.group.same_seed()
        try:
            self.engine.warmup()
        except Exception:
            log.exception("warm-up failed; serving anyway")
        self._batches[None] = self.engine.new_batch()
        if self.replay is not None and not self.replay.group.leader:
            return self._follow()
        with self._cond:
            if self.state == LaneState.STARTING:
                self.state = LaneState.SERVING
        self.ready.set()
        while True:
            with self._cond:
                while (not self._waiting and not self._active and not self._tasks
                       and self.state != LaneState.STOPPED):
                    self._cond.wait()
                if not self._waiting and not self._active and not self._tasks:
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
        if None not in self._batches:
            self._batches[None] = self.engine.new_batch()
        with self._cond:
            jobs = self.scheduler.admit(self._waiting, self._active, ready=self._prefix_ready)
            task = self._tasks.popleft() if self._tasks else None
            waiting = bool(self._waiting)
        if task is not None:
            self._run_task(*task)  # rank 0 only: what tasks run (embeddings) is not sharded
        if not jobs and not self._active:
            return task is not None
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
        t0 = time.perf_counter()
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
        t1 = time.perf_counter()
        plan = self.scheduler.prefill_plan((a for a in self._active if a.seq.state == SeqState.PREFILL),
                                           self.engine.prefill_left)
        prefilled, ready = self._prefill(plan)
        if ready:
            self._start_decode(ready)
        phases = {"admit": t1 - t0, "prefill": time.perf_counter() - t1}
        decoded = self._decode_step(phases)
        stats.on_tick(batch=self.batch_size(), prefill_tokens=prefilled, decode_tokens=decoded,
                      running=len(self._active), phase_s=phases)

    def _prefill(self, plan: list) -> tuple[int, list]:
        """Run the tick's prefill plan; returns (tokens computed, sequences whose prefill completed).

        In plan order, each sequence first re-takes from the prefix cache (an entry put this tick may cover more of
        its prompt). Chunks that may go together (``Engine.prefills_together``; only with ``prefill_batch`` > 1)
        are gathered into one batched forward; a sequence that shares a prefix with one already gathered waits
        until that group is computed and shared, so it re-takes the shared prefix instead of computing it again."""
        done = {"tokens": 0}
        ready: list = []
        group: list = []  # [(a, n, done before)]

        def flush() -> None:
            if not group:
                return
            items = list(group)
            group.clear()
            try:
                if len(items) == 1:
                    a, n, before = items[0]
                    if self.engine.prefill_step(a, n, share=self._others_need_prefill):
                        ready.append(a)
                else:
                    ready.extend(self.engine.prefill_together([(a, n) for a, n, _ in items],
                                                              share=self._others_need_prefill))
                    self.engine.stats.on_prefill_together(len(items))
                done["tokens"] += sum(a.done - before for a, _, before in items)
            except Exception as exc:
                log.exception("prefill of %s failed", ", ".join(a.job.id for a, *_ in items))
                for a, *_ in items:
                    self._drop(a)
                    self.engine.fail(a, exc)

        rows = self.scheduler.limits.prefill_batch
        for a, n in plan:
            if group and (len(group) >= rows or any(_shares_prefix(g.seq.prompt, a) for g, *_ in group)):
                flush()
            try:
                if self.engine.retake(a):  # an entry put this tick (or since admission) covers more of its prompt
                    n = min(n, self.engine.prefill_left(a))
            except Exception as exc:
                log.exception("prefill of %s failed", a.job.id)
                self._drop(a)
                self.engine.fail(a, exc)
                continue
            if rows > 1 and self.engine.prefills_together(a, n):
                group.append((a, n, a.done))
                continue
            flush()
            group.append((a, n, a.done))
            flush()
        flush()
        return done["tokens"], ready

    def _others_need_prefill(self) -> bool:
        """Requests wait, or more than one prefills: a prompt just prefilled may serve them (Engine.retake)."""
        waiting = self._tick_waiting if self._tick_waiting is not None else bool(self._waiting)
        return waiting or sum(a.seq.state == SeqState.PREFILL for a in self._active) > 1

    # -- decode ---------------------------------------------------------------------
    def _solo(self) -> list[Active]:
        return [a for a in self._active if a.seq.state == SeqState.DECODE and not a.in_batch]

    def _start_decode(self, ready: list[Active]) -> None:
        """Sequences that finished their prefill this tick: solo or their group's batch (see the module docstring).
        Those that join a batch join together, in one step."""
        groups: dict = {}
        for a in ready:
            if self.engine.batchable(a):
                groups.setdefault(self.engine.batch_key(a), []).append(a)
        for key, plain in groups.items():  # all solo when nothing is batchable
            batch = self._batches.get(key)
            others = [s for s in self._solo() if s not in ready and self.engine.batch_key(s) == key
                      and self.engine.can_migrate(s)]
            if len(plain) == 1 and not (batch is not None and len(batch)) and not others:
                continue  # the group's only plain decoding sequence: the fast solo path
            if batch is None:
                batch = self._batches[key] = self.engine.new_batch(plain[0])
            joining = others + plain
            batch.add_many([(a, *self.engine.batch_entry(a), self._row(a)) for a in joining])

    def _row(self, a: Active) -> dict:
        return {"sampler": self.engine.row_sampler(a), "processors": self.engine.batch_processors(a)}

    def _decode_step(self, phases: dict) -> int:
        """One step of every batch (the base model's, then each adapter group's: one forward each, so a group never
        waits for another) and of every solo sequence; adds the seconds of each part to ``phases``."""
        produced = 0
        for key, batch in list(self._batches.items()):
            produced += self._step_batch(key, batch, phases)
            if key is not None and not len(self._batches[key]):
                del self._batches[key]  # an adapter group with no rows left: its batch arrays go
        t0 = time.perf_counter()
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
        phases["solo"] = time.perf_counter() - t0
        return produced

    def _step_batch(self, key, batch, phases: dict) -> int:
        if not len(batch):
            return 0
        produced = 0
        t0 = time.perf_counter()
        try:
            rows = batch.step()
        except Exception as exc:
            log.exception("batched decode step failed; failing its %d sequences", len(batch))
            for a in batch.sequences:
                self._drop(a)
                self.engine.fail(a, exc)
            if key is None:
                self._batches[None] = self.engine.new_batch()
            else:
                del self._batches[key]
            return 0
        t1 = time.perf_counter()
        phases["batch_step"] = phases.get("batch_step", 0.0) + t1 - t0
        ending = []
        for a, token, logprobs in rows:
            produced += 1
            reason = a.seq.on_token(token, logprobs)
            if reason is not None:
                ending.append((a, reason))
        if ending:
            removed = batch.remove([a for a, _ in ending])
            for (a, reason), covered in zip(ending, removed):
                self._drop(a)
                self.engine.finish(a, reason, covered)
        phases["batch_rows"] = phases.get("batch_rows", 0.0) + time.perf_counter() - t1
        return produced

    def _leave_batch_of_one(self) -> None:
        """A batch of one row is slower than the solo path: a group's last row goes on solo when nothing else of its
        group decodes or prefills."""
        for key, batch in list(self._batches.items()):
            if len(batch) != 1:
                continue
            same = [a for a in self._active if self.engine.batch_key(a) == key]
            if any(a.seq.state == SeqState.PREFILL or (a.seq.state == SeqState.DECODE and not a.in_batch)
                   for a in same):
                continue
            a = batch.sequences[0]
            if a.grammar is not None:  # see Engine.can_migrate
                continue
            (tokens, caches), = batch.remove([a])
            self.engine.resume_solo(a, tokens, caches)
            if key is not None:
                del self._batches[key]

    def _end(self, a: Active, reason: str) -> None:
        covered = None
        if a.in_batch:
            key = self.engine.batch_key(a)
            covered = self._batches[key].remove([a])[0]
            if key is not None and not len(self._batches[key]):
                del self._batches[key]
        self._drop(a)
        self.engine.finish(a, reason, covered)

    # -- tasks: model work other than a sequence's (embeddings, loading an adapter) ----------------------------
    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn()`` on the lane thread, between two ticks' decode steps (at most one task per tick, so a task
        delays the running sequences by its own duration once: callers keep each task to about one prefill chunk
        of work). The future holds its result or exception. Raises ``ShuttingDown`` once the lane drains."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.state not in (LaneState.STARTING, LaneState.SERVING):
                raise ShuttingDown("The server is shutting down and accepts no new requests; retry in a moment.",
                                   retry_after_s=5)
            self._tasks.append((fn, future))
            self._cond.notify()
        return future

    def _run_task(self, fn, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with self.engine.task_context():
                result = fn()
        except BaseException as exc:  # the caller gets it; the lane serves on
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _drop(self, a: Active) -> None:
        self._active = [x for x in self._active if x is not a]


SHARED_PREFIX_MIN = 64  # tokens of a prompt that another one computing this tick would put in the cache for it


def _shares_prefix(prompt: list, a) -> bool:
    """Does ``prompt`` hold at least SHARED_PREFIX_MIN tokens of ``a``'s prompt beyond what ``a`` has computed?"""
    mine = a.seq.prompt
    need = a.done + SHARED_PREFIX_MIN
    if len(prompt) < need or len(mine) < need:
        return False
    return prompt[:need] == mine[:need]


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: ``top -H``, ``ps -L``, /proc/PID/task/*/comm and profilers
    show it); Python's thread names stay inside Python. Best effort: elsewhere nothing happens."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


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
