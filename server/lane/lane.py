"""The lane: one thread that owns all model compute and runs one tick plan after another.

(About 430 lines, one job: the thread and its control. The inbox, the run loop (with a sharded group's rest when it
goes idle), draining, tasks and a lost device are all the lane's state machine, changed under one lock; what a tick decides and does lives in server.lane.scheduler
and server.lane.executor already.)

What a tick does is decided in server.lane.scheduler, executed by server.lane.executor through the engine's verbs
(server.lane.seam.LaneEngine); what stays here is the thread, its inbox, its control and its tasks.

``submit(seq)`` (event loop) appends to an inbox under a short lock, or raises ``QueueFull`` beyond ``max_queue``
waiting sequences, or ``ShuttingDown``. Each tick the thread, holding no lock while it works:

1. moves the inbox into its queue (the engine classifies each arrival: its batch group, whether it may batch);
2. asks the scheduler for this tick's ``TickPlan`` (server.lane.scheduler; the prefix cache answers index-only
   questions: is a queued prompt's SSD prefix in RAM yet, how much of it is cached);
3. executes the plan (server.lane.executor), in the plan's order (server.lane.plan): end the cancelled, make room in
   the RAM tier, admit (cache take), the prefill chunks that complete a prompt, start decoding (solo or into a
   batch), one step of every batch and every solo sequence, then the other prefill chunks; sequences that finish
   leave at once and store what they computed.

In a model sharded over processes, rank 0 broadcasts each plan before executing it and every other rank executes
the same plan on its own sequences (server.lane.replay).

Warm-up (server.lane.warm): the engine's warm-up steps run on this thread, on its stream: all of them before
``ready`` with --warm-up before-ready, or (the default, --warm-up behind) one at a time while the lane is idle, after
a short grace, looking for work between steps; a model sharded over processes always warms up before ready.

Tasks (``call(fn)``): model work that is not a sequence (an embeddings batch, loading an adapter) runs on this
thread too, at most one per tick, so it never contends with the decode steps for the cores and delays them by at
most one task.

Shutdown, in three steps (server.serve.GracefulServer drives the first two):
  ``drain()``  refuse new sequences (``ShuttingDown``, a 503); queued and running ones go on.
  ``abort()``  the drain ran out of time: cancel every queued and running sequence; each ends within one tick
               with ``Finished("cancelled")``, and ``aborted`` tells the HTTP layer to end its response with a
               shutdown error, not a cut.
  ``stop()``   cancel whatever is left and join the thread (its last cache put is done by then).

A lost device (server.lane.device_loss): after the tick that saw CUDA's sticky error, every request in the lane ends
with ``DeviceLost`` (a 503), new ones are refused with it, and ``on_device_lost`` tells the server to exit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import logging
import threading
import time
from typing import Callable, Optional

from server.errors import InvalidRequest, QueueFull, ShuttingDown
from server.lane.budget import MemoryBudget
from server.lane.device_loss import device_lost_error
from server.lane.executor import Executor
from server.lane.plan import TickPlan
from server.lane.scheduler import Limits, Scheduler
from server.lane.seam import LaneEngine
from server.lane.events import Failed
from server.lane.sequence import FinishReason, Phase, Sequence
from server.lane.warm import WarmMode, WarmUp

__all__ = ["Lane", "LaneState"]

log = logging.getLogger("mlx_lane.lane")

FAILED_TICKS_BEFORE_RESET = 3  # ticks failing in a row before the lane ends the requests in it (see _run)


class LaneState(enum.Enum):
    STARTING = "starting"  # the thread starting (and warming up, with --warm-up before-ready)
    SERVING = "serving"
    DRAINING = "draining"  # refuses new sequences; running ones go on
    ABORTED = "aborted"  # draining ran out of time: every sequence was cancelled
    STOPPED = "stopped"
    DEVICE_LOST = "device_lost"  # the GPU reported a sticky error: nothing more is served (server.lane.device_loss)


class Lane:
    def __init__(self, engine: LaneEngine, prompt_cache, stats, *, max_queue: int = 0, max_batch: int = 8,
                 budget: Optional[MemoryBudget] = None, prefill_batch: int = 1, replay=None,
                 warm_up: WarmMode | str = WarmMode.BEHIND, prefill_together_max: int = 0):
        """``prompt_cache``: the prefix cache the scheduler asks index-only questions of (a
        ``cache.protocol.PrefixCache``); ``stats``: the serving counters (server.stats.ServingStats); ``warm_up``:
        when the engine's warm-up runs (--warm-up; server.lane.warm); ``prefill_together_max``: the longest chunk past
        a long cache hit that joins a batched prefill forward (--prefill-together-max; server.lane.scheduler)."""
        self.engine = engine
        self.prompt_cache = prompt_cache
        self.stats = stats
        self.executor = Executor(engine, prompt_cache, stats)
        # server.lane.replay.Leader (rank 0) or Follower (other ranks) of a model sharded over processes; None in a
        # single process, where no distributed code runs at all
        self.replay = replay
        warm_up = WarmMode(warm_up)
        if replay is not None and warm_up == WarmMode.BEHIND:
            # sharded: every rank must run the same forwards in the same order (their collectives pair up), and a
            # follower only runs the plans rank 0 broadcasts; warm-up steps interleaved by each rank's own idleness
            # would not pair up. Before ready, every rank runs all the steps at the same point of its start.
            warm_up = WarmMode.BEFORE_READY
        self.warm = WarmUp(warm_up)
        self.max_queue = max_queue  # 0 = unbounded
        self.scheduler = Scheduler(Limits(max_batch=max(1, max_batch), prefill_chunk=engine.prefill_chunk,
                                          prefill_batch=max(1, prefill_batch),
                                          together_max=max(0, prefill_together_max)), budget)
        self._inbox: collections.deque[Sequence] = collections.deque()  # submitted, not yet seen by the thread
        self._waiting: list[Sequence] = []  # the queue (lane thread only)
        self._running_ids: tuple[str, ...] = ()  # a snapshot for readers on other threads
        self._tasks: collections.deque = collections.deque()  # (callable, Future): model work other than a sequence
        self.follow_failed = False  # a follower's replay raised (server.serve.follow exits non-zero)
        self._cond = threading.Condition()
        self.state = LaneState.STARTING
        self.aborted = False  # set by abort(): a cancelled sequence was ended by the shutdown, not by its client
        self._thread = threading.Thread(target=self._run, name="mlx-lane", daemon=True)
        self.ready = threading.Event()  # set once the lane serves (warm only with --warm-up before-ready)
        # called once, on the lane thread, after a device loss has ended every request (server.serve: shut down)
        self.on_device_lost: Optional[Callable[[], None]] = None

    # -- control --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def drain(self) -> int:
        """Refuse new sequences from now on; return how many are queued or running (they go on)."""
        with self._cond:
            if self.state in (LaneState.STARTING, LaneState.SERVING):
                self.state = LaneState.DRAINING
            return self.queue_depth + len(self._running_ids)

    def abort(self) -> int:
        """Cancel every queued and running sequence (the drain ran out of time); return how many."""
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

    def check_fits(self, prompt_tokens: int, max_tokens: int, price=None) -> None:
        """400 for a request that the memory budget can never admit (the handler asks before submitting);
        ``price``: the KV price (server.lane.budget.KVPrice) of the request's model when it is not the base model."""
        why = self.scheduler.budget.never_fits(prompt_tokens, max_tokens, price)
        if why:
            raise InvalidRequest(why, param="max_tokens", code="memory_budget_exceeded")

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq`` (any thread). Raises ``ShuttingDown`` (503) once draining, ``QueueFull`` (429) when
        ``max_queue`` sequences wait already. O(1) under a lock the lane thread never holds while it works."""
        with self._cond:
            self._check_open_locked()
            depth = self.queue_depth
            if self.max_queue and depth >= self.max_queue:
                raise QueueFull(f"too many requests waiting ({depth}); retry later", retry_after_s=1)
            seq.enqueued_at = time.monotonic()
            self._inbox.append(seq)
            self.stats.on_queued(seq.id)
            self._cond.notify()

    def _check_open_locked(self) -> None:
        """Raise what a new sequence or task is told once the lane takes no more: ``DeviceLost`` (503, restart) or
        ``ShuttingDown`` (503, retry)."""
        if self.state == LaneState.DEVICE_LOST:
            raise device_lost_error(self.executor.device_lost or "unknown")
        if self.state not in (LaneState.STARTING, LaneState.SERVING):
            raise ShuttingDown("The server is shutting down and accepts no new requests; retry in a moment.",
                               retry_after_s=5)

    # -- introspection --------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._inbox) + len(self._waiting)

    @property
    def running_ids(self) -> tuple[str, ...]:
        return self._running_ids

    @property
    def active_job_id(self) -> Optional[str]:
        ids = self._running_ids
        return ids[0] if ids else None

    def running(self) -> list[Sequence]:
        """The admitted sequences (lane thread only)."""
        return list(self.executor.running)

    def idle(self) -> bool:
        """Nothing queued, running or waiting to run (a snapshot)."""
        return not (self._inbox or self._waiting or self.executor.running or self._tasks)

    def _fail_waiting(self, seq: Sequence, exc: BaseException) -> None:
        """A sequence that never ran ends with ``Failed`` (a 500)."""
        seq.phase, seq.finish_reason = Phase.FINISHED, FinishReason.FAILED
        self.stats.on_failure()
        seq.sink(Failed(exc))

    def _fail_everything(self, exc: BaseException) -> None:
        """Every request in the lane ends with ``Failed``: the last resort after ticks that keep failing."""
        with self._cond:
            waiting = [*self._inbox, *self._waiting]
            self._inbox.clear()
        self._waiting = []
        log.error("%d lane ticks failed in a row: ending the %d requests in the lane with an error",
                  FAILED_TICKS_BEFORE_RESET, len(waiting) + len(self.executor.running))
        for seq in waiting:
            self._fail_waiting(seq, exc)
        for seq in list(self.executor.running):
            self.executor.fail(seq, exc)

    def _lose_device(self) -> None:
        """The GPU is unusable (server.lane.device_loss): refuse new work, end every request in the lane with
        ``DeviceLost`` (a 503), then tell the server (``on_device_lost``: it shuts down and exits non-zero)."""
        exc = device_lost_error(self.executor.device_lost or "unknown")
        with self._cond:
            self.state = LaneState.DEVICE_LOST
            waiting = [*self._inbox, *self._waiting]
            self._inbox.clear()
            while self._tasks:  # model work other than sequences (embeddings): its callers get the error
                future = self._tasks.popleft()[1]
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
        self._waiting = []
        log.critical("ending the %d requests in the lane: %s", len(waiting) + len(self.executor.running), exc.message)
        for seq in waiting:
            self._fail_waiting(seq, exc)
        for seq in list(self.executor.running):
            self.executor.fail(seq, exc)
        if self.on_device_lost is not None:
            try:
                self.on_device_lost()
            except Exception:
                log.exception("reporting the device loss failed")

    def _cancel_all_locked(self) -> int:
        seqs = [*self._inbox, *list(self._waiting), *list(self.executor.running)]
        for seq in seqs:
            seq.cancel.set()
        while self._tasks:  # tasks not started: their callers get CancelledError
            self._tasks.popleft()[1].cancel()
        return len(seqs)

    # -- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        _name_os_thread("mlx-lane")
        self.engine.bind_stream(as_default=self.replay is not None)
        if self.replay is not None:  # the group's collectives run on the stream that runs the model
            self.replay.group.bind(self.engine.stream)
            self.replay.group.same_seed()
            self.replay.open()
        self.executor.may_requeue = self.replay is None  # a sharded model's ranks replay plans, not retries
        self._plan_warm_up()
        if self.warm.mode == WarmMode.BEFORE_READY:
            self.warm.run_all()  # a step that fails is logged; serving goes on
        if self.replay is not None and not self.replay.group.leader:
            return self._follow()
        with self._cond:
            if self.state == LaneState.STARTING:
                self.state = LaneState.SERVING
        self.warm.on_ready()
        self.ready.set()
        failed_ticks = 0  # in a row
        while True:
            warm_now = False
            if self.replay is not None and self.idle():
                try:
                    self.replay.rest()  # the followers wait on rank 0's doorbell, not polling a core each
                except Exception:  # a broken group: the next plan's broadcast fails in the tick, as it would have
                    log.exception("sending the followers to rest failed")
            with self._cond:
                while self.idle() and self.state != LaneState.STOPPED:
                    # idle: wait for work, or until the warm-up's next step is due (None: no step will come)
                    delay = self.warm.delay() if self.state == LaneState.SERVING else None
                    if delay is None:
                        self._cond.wait()
                    elif delay > 0:
                        self._cond.wait(delay)
                    else:
                        warm_now = True
                        break
                if not warm_now and self.idle():
                    if self.replay is not None:
                        self.replay.stop()  # the followers stop too
                    return  # stopped and nothing left
            if warm_now:  # outside the lock: submit() goes on; what arrives waits for this one step
                self.warm.step()
                continue
            try:
                busy = self.tick()
                failed_ticks = 0
            except Exception as exc:  # each step reports its own failures; this is the last resort that keeps the
                # lane up. A tick that keeps failing would leave every request waiting forever: after a few in a
                # row, the requests in the lane end with an error (a 500) and the lane starts clean.
                log.exception("lane tick failed")
                failed_ticks += 1
                self.executor.note_device_loss(exc)
                if failed_ticks >= FAILED_TICKS_BEFORE_RESET:
                    self._fail_everything(exc)
                    failed_ticks = 0
                busy = False
            if self.executor.device_lost is not None and self.state != LaneState.DEVICE_LOST:
                self._lose_device()
                continue
            if busy:
                self.warm.worked()
            else:
                with self._cond:  # only sequences whose SSD prefix is still being read: wait for it, do not spin
                    self._cond.wait(0.005)

    def _plan_warm_up(self) -> None:
        """The engine's warm-up steps (after ``bind_stream``: they run on the lane's stream)."""
        if self.warm.mode == WarmMode.OFF:
            return
        try:
            self.warm.load(self.engine.warmup_steps())
        except Exception:
            self.warm.fail("planning the steps")

    def tick(self) -> bool:
        """One tick: take in what was submitted, plan, execute; False when there was nothing to do. The thread calls
        it in a loop; the model-free tests call it directly, tick by tick, on a lane that was never started."""
        with self._cond:
            arrived = list(self._inbox)
            self._inbox.clear()
        for i, seq in enumerate(arrived):
            company = bool(self.executor.running or self._waiting or i)
            try:
                seq.facts = self.engine.classify(seq, company)
            except Exception as exc:
                log.exception("classifying %s failed", seq.id)
                self._fail_waiting(seq, exc)
        arrived = [s for s in arrived if s.phase != Phase.FINISHED]
        self._waiting.extend(arrived)
        plan = self.scheduler.schedule(self._waiting, self.executor.running, task=bool(self._tasks),
                                       ready=self._prefix_ready, lookup=self._cached_length,
                                       batch_bytes=self._batch_bytes())
        for seq in plan.waiting_io:
            seq.phase = Phase.WAITING_IO
        if plan.empty:
            return False
        gone = {id(s) for s in (*plan.end_waiting, *plan.admit)}
        self._waiting = [s for s in self._waiting if id(s) not in gone]
        if plan.task:
            with self._cond:
                task = self._tasks.popleft() if self._tasks else None
            if task is not None:
                self._run_task(*task)  # rank 0 only: what tasks run (embeddings) is not sharded
        if plan.model_work:
            if self.replay is not None:  # rank 0 of a group: every rank runs this plan
                self.replay.lead(plan, self.executor.running)
            self.execute(plan)
        return True

    def _prefix_ready(self, seq: Sequence) -> bool:
        ready = self.prompt_cache.ready(seq.prompt, seq.ns, seq.session)
        if ready and seq.phase == Phase.WAITING_IO:
            seq.phase = Phase.WAITING
        return ready

    def _batch_bytes(self) -> int:
        """What the decode batches' buffers hold, for the memory budget (0 when the budget is off)."""
        if not self.scheduler.budget.budget_bytes:
            return 0
        return int(self.engine.batch_kv_bytes())

    def _cached_length(self, seq: Sequence) -> int:
        # local: the scheduler runs on rank 0 alone, before its plan is broadcast (an agreement would deadlock)
        return self.prompt_cache.peek(seq.prompt, seq.ns, seq.session, local=True)

    # -- executing a plan -------------------------------------------------------------
    def execute(self, plan: TickPlan) -> None:
        """Run one plan (server.lane.executor); every rank of a sharded model runs the same one. Prompts whose
        prefill ran out of memory go back to the front of the queue."""
        self.executor.execute(plan)
        self._running_ids = tuple(s.id for s in self.executor.running)
        if self.executor.requeued:
            self._waiting[:0] = self.executor.requeued
            self.executor.requeued = []

    # -- a follower of a sharded model (server.lane.replay) ------------------------------------
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

    # -- tasks: model work other than a sequence's (embeddings, loading an adapter) ----------------------------
    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn()`` on the lane thread, between two ticks' decode steps (at most one task per tick, so a task
        delays the running sequences by its own duration once: callers keep each task to about one prefill chunk
        of work). The future holds its result or exception. Raises ``ShuttingDown`` once the lane drains."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._check_open_locked()
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


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: ``top -H``, ``ps -L``, /proc/PID/task/*/comm and profilers
    show it); Python's thread names stay inside Python. Best effort: elsewhere nothing happens."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
