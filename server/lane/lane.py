"""The lane: one thread that owns all model compute and runs one tick plan after another.

(About 475 lines, one job: the thread, its inbox and the plan executor. What a tick does is decided in
server.lane.scheduler, how a step is computed in server.engine; what stays here is their order and the hand-off.)

``submit(seq)`` (event loop) appends to an inbox under a short lock, or raises ``QueueFull`` beyond ``max_queue``
waiting sequences, or ``ShuttingDown``. Each tick the thread, holding no lock while it works:

1. moves the inbox into its queue (the engine classifies each arrival: its batch group, whether it may batch);
2. asks the scheduler for this tick's ``TickPlan`` (server.lane.scheduler; the prefix cache answers index-only
   questions: is a queued prompt's SSD prefix in RAM yet, how much of it is cached);
3. executes the plan through the engine, in the plan's order (server.lane.plan): end the cancelled, make room in
   the RAM tier, admit (cache take), the prefill chunks that complete a prompt, start decoding (solo or into a
   batch), one step of every batch and every solo sequence, then the other prefill chunks; sequences that finish
   leave at once and store what they computed.

In a model sharded over processes, rank 0 broadcasts each plan before executing it and every other rank executes
the same plan on its own sequences (server.lane.replay).

Tasks (``call(fn)``): model work that is not a sequence (an embeddings batch, loading an adapter) runs on this
thread too, at most one per tick, so it never contends with the decode steps for the cores and delays them by at
most one task.

Shutdown, in three steps (server.serve.GracefulServer drives the first two):
  ``drain()``  refuse new sequences (``ShuttingDown``, a 503); queued and running ones go on.
  ``abort()``  the drain ran out of time: cancel every queued and running sequence; each ends within one tick
               with ``Finished("cancelled")``, and ``aborted`` tells the HTTP layer to end its response with a
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

from server.errors import InvalidRequest, QueueFull, ShuttingDown
from server.lane.budget import MemoryBudget
from server.lane.events import Delta, Finished
from server.lane.plan import TickPlan
from server.lane.scheduler import Limits, Scheduler
from server.lane.sequence import FinishReason, Phase, Sequence

__all__ = ["Lane", "LaneState"]

log = logging.getLogger("mlx_lane.lane")


class LaneState(enum.Enum):
    STARTING = "starting"  # warming up; /health says so
    SERVING = "serving"
    DRAINING = "draining"  # refuses new sequences; running ones go on
    ABORTED = "aborted"  # draining ran out of time: every sequence was cancelled
    STOPPED = "stopped"


class Lane:
    def __init__(self, engine, *, max_queue: int = 0, token_delay_s: float = 0.0, max_batch: int = 8,
                 budget: Optional[MemoryBudget] = None, prefill_batch: int = 1, replay=None):
        self.engine = engine
        # server.lane.replay.Leader (rank 0) or Follower (other ranks) of a model sharded over processes; None in a
        # single process, where no distributed code runs at all
        self.replay = replay
        self.max_queue = max_queue  # 0 = unbounded
        self.token_delay_s = token_delay_s  # test seam (MLX_LANE_TEST_TOKEN_DELAY): pause after each token
        self.scheduler = Scheduler(Limits(max_batch=max(1, max_batch), prefill_chunk=engine.prefill_chunk,
                                          prefill_batch=max(1, prefill_batch)), budget)
        self._inbox: collections.deque[Sequence] = collections.deque()  # submitted, not yet seen by the thread
        self._waiting: list[Sequence] = []  # the queue (lane thread only)
        self._running: list[Sequence] = []  # admitted, in admission order (lane thread only)
        self._running_ids: tuple[str, ...] = ()  # a snapshot for readers on other threads
        self._tasks: collections.deque = collections.deque()  # (callable, Future): model work other than a sequence
        self.follow_failed = False  # a follower's replay raised (server.serve.follow exits non-zero)
        self._cond = threading.Condition()
        self.state = LaneState.STARTING
        self.aborted = False  # set by abort(): a cancelled sequence was ended by the shutdown, not by its client
        self._thread = threading.Thread(target=self._run, name="mlx-lane", daemon=True)
        self.ready = threading.Event()  # set once the lane has warmed the model up

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

    def check_fits(self, prompt_tokens: int, max_tokens: int, per_token: Optional[float] = None) -> None:
        """400 for a request that the memory budget can never admit (the handler asks before submitting);
        ``per_token``: the KV price of the request's model when it is not the base model."""
        why = self.scheduler.budget.never_fits(prompt_tokens, max_tokens, per_token)
        if why:
            raise InvalidRequest(why, param="max_tokens", code="memory_budget_exceeded")

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq`` (any thread). Raises ``ShuttingDown`` (503) once draining, ``QueueFull`` (429) when
        ``max_queue`` sequences wait already. O(1) under a lock the lane thread never holds while it works."""
        with self._cond:
            if self.state not in (LaneState.STARTING, LaneState.SERVING):
                raise ShuttingDown("The server is shutting down and accepts no new requests; retry in a moment.",
                                   retry_after_s=5)
            depth = self.queue_depth
            if self.max_queue and depth >= self.max_queue:
                raise QueueFull(f"too many requests waiting ({depth}); retry later", retry_after_s=1)
            seq.enqueued_at = time.monotonic()
            if self.token_delay_s:
                seq.sink = _slowed(seq.sink, self.token_delay_s)
            self._inbox.append(seq)
            self.engine.stats.on_queued(seq.id)
            self._cond.notify()

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
        return list(self._running)

    def idle(self) -> bool:
        """Nothing queued, running or waiting to run (a snapshot)."""
        return not (self._inbox or self._waiting or self._running or self._tasks)

    def _cancel_all_locked(self) -> int:
        seqs = [*self._inbox, *list(self._waiting), *list(self._running)]
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
        try:
            self.engine.warmup()
        except Exception:
            log.exception("warm-up failed; serving anyway")
        if self.replay is not None and not self.replay.group.leader:
            return self._follow()
        with self._cond:
            if self.state == LaneState.STARTING:
                self.state = LaneState.SERVING
        self.ready.set()
        while True:
            with self._cond:
                while self.idle() and self.state != LaneState.STOPPED:
                    self._cond.wait()
                if self.idle():
                    if self.replay is not None:
                        self.replay.stop()  # the followers stop too
                    return  # stopped and nothing left
            try:
                busy = self.tick()
            except Exception:  # each step reports its own failures; this is the last resort that keeps the lane up
                log.exception("lane tick failed")
                busy = False
            if not busy:
                with self._cond:  # only sequences whose SSD prefix is still being read: wait for it, do not spin
                    self._cond.wait(0.005)

    def tick(self) -> bool:
        """One tick: take in what was submitted, plan, execute; False when there was nothing to do. The thread calls
        it in a loop; the model-free tests call it directly, tick by tick, on a lane that was never started."""
        with self._cond:
            arrived = list(self._inbox)
            self._inbox.clear()
        for seq in arrived:
            self.engine.classify(seq)
        self._waiting.extend(arrived)
        plan = self.scheduler.schedule(self._waiting, self._running, task=bool(self._tasks),
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
                self.replay.lead(plan, self._running)
            self.execute(plan)
        return True

    def _prefix_ready(self, seq: Sequence) -> bool:
        ready = self.engine.prompt_cache.ready(seq.prompt, seq.ns, seq.session)
        if ready and seq.phase == Phase.WAITING_IO:
            seq.phase = Phase.WAITING
        return ready

    def _batch_bytes(self) -> int:
        """What the decode batches' buffers hold, for the memory budget (0 when the budget is off)."""
        if not self.scheduler.budget.budget_bytes:
            return 0
        held = getattr(self.engine, "batch_kv_bytes", None)
        return int(held()) if held is not None else 0

    def _cached_length(self, seq: Sequence) -> int:
        # local: the scheduler runs on rank 0 alone, before its plan is broadcast (an agreement would deadlock)
        return self.engine.prompt_cache.peek(seq.prompt, seq.ns, seq.session, local=True)

    # -- executing a plan -------------------------------------------------------------
    def execute(self, plan: TickPlan) -> None:
        """Run one plan (see server.lane.plan for the order); every rank of a sharded model runs the same one."""
        stats, engine = self.engine.stats, self.engine
        t0 = time.perf_counter()
        for seq in plan.end_waiting:
            stats.on_started(seq.id)
            finished = _cancelled_before_start(seq)
            stats.on_finished(finished)
            seq.sink(finished)
        if plan.make_room:
            engine.prompt_cache.make_room(plan.make_room)
        for seq in plan.admit:
            stats.on_started(seq.id)
            try:
                engine.admit(seq)
            except Exception as exc:
                log.exception("admitting %s failed", seq.id)
                engine.fail(seq, exc)
                continue
            self._running.append(seq)
        for seq in plan.cancel:
            self._end(seq, FinishReason.CANCELLED)
        for seq, position in plan.anchor:  # a prefix others wait for: stored when this sequence's chunk gets there
            seq.anchors = tuple(sorted({*seq.anchors, position}))
        t1 = time.perf_counter()
        prefilled = sum(self._prefill(group, plan.share) for group in plan.prefill)
        for start in plan.start:
            self._start(start)
        for seq in plan.leave:
            if seq.phase == Phase.BATCHED:
                engine.leave_batch(seq)
        phases = {"admit": t1 - t0, "prefill": time.perf_counter() - t1}
        decoded = self._decode(plan, phases)
        t2 = time.perf_counter()
        prefilled += sum(self._prefill(group, plan.share) for group in plan.prefill_late)
        phases["prefill"] += time.perf_counter() - t2
        self._running_ids = tuple(s.id for s in self._running)
        stats.on_tick(batch=engine.batch_size(), prefill_tokens=prefilled, decode_tokens=decoded,
                      running=len(self._running), phase_s=phases)

    def _prefill(self, group, share: bool) -> int:
        """One planned prefill group: each sequence takes again from the prefix cache first (an entry put this tick
        may cover more of its prompt); then one forward for the group. Returns the tokens computed."""
        items = []
        for chunk in group:
            seq = chunk.seq
            if seq.phase != Phase.PREFILL or seq.prefilled:
                continue
            try:
                self.engine.retake(seq)
            except Exception as exc:
                log.exception("prefill of %s failed", seq.id)
                self._fail(seq, exc)
                continue
            items.append((seq, min(chunk.tokens, seq.prefill_left), seq.done))
        if not items:
            return 0
        try:
            if len(items) == 1:
                seq, n, _ = items[0]
                self.engine.prefill(seq, n, share)
            else:
                self.engine.prefill_together([(seq, n) for seq, n, _ in items], share)
                self.engine.stats.on_prefill_together(len(items))
        except Exception as exc:
            log.exception("prefill of %s failed", ", ".join(seq.id for seq, *_ in items))
            for seq, *_ in items:
                self._fail(seq, exc)
            return 0
        return sum(seq.done - before for seq, _, before in items)

    def _start(self, start) -> None:
        """Planned starts of decoding whose prefill did complete: into the group's batch together, or solo."""
        batch = [s for s in start.batch if s.phase == Phase.SOLO or (s.phase == Phase.PREFILL and s.prefilled)]
        if batch:
            try:
                self.engine.join_batch(start.group, batch)
            except Exception as exc:
                log.exception("joining the batch failed for %s", ", ".join(s.id for s in batch))
                for seq in batch:
                    self._fail(seq, exc)
        for seq in start.solo:
            if seq.phase == Phase.PREFILL and seq.prefilled:
                seq.phase = Phase.SOLO

    def _decode(self, plan: TickPlan, phases: dict) -> int:
        """One step of every planned batch (one forward each: a group never waits for another) and of every solo
        sequence; adds the seconds of each part to ``phases``."""
        produced = 0
        for group in plan.decode:
            produced += self._step_batch(group, phases)
        t0 = time.perf_counter()
        for seq in plan.solo:
            if seq.phase != Phase.SOLO:
                continue
            try:
                out = self.engine.solo_step(seq)
            except Exception as exc:
                log.exception("decode of %s failed", seq.id)
                self._fail(seq, exc)
                continue
            produced += 1 if out is not None else 0
            reason = FinishReason.LENGTH if out is None else seq.on_token(*out)
            if reason is not None:
                self._end(seq, reason)
        phases["solo"] = time.perf_counter() - t0
        return produced

    def _step_batch(self, group, phases: dict) -> int:
        t0 = time.perf_counter()
        try:
            rows = self.engine.step_batch(group)
        except Exception as exc:
            log.exception("batched decode step failed; failing its sequences")
            for seq in [s for s in self._running if s.phase == Phase.BATCHED and s.group == group]:
                self._fail(seq, exc)
            self.engine.reset_batch(group)
            return 0
        t1 = time.perf_counter()
        phases["batch_step"] = phases.get("batch_step", 0.0) + t1 - t0
        ending, ended = [], set()
        for seq, token, logprobs in rows:  # a speculating row may bring several tokens; none after its end
            if id(seq) in ended:
                continue
            reason = seq.on_token(token, logprobs)
            if reason is not None:
                ending.append((seq, reason))
                ended.add(id(seq))
        t2 = time.perf_counter()
        if ending:
            for (seq, reason), covered in zip(ending, self.engine.leave_rows(group, [s for s, _ in ending])):
                self._drop(seq)
                self.engine.finish(seq, reason, covered)
        t3 = time.perf_counter()
        phases["batch_rows"] = phases.get("batch_rows", 0.0) + t2 - t1
        if ending:
            phases["batch_leave"] = phases.get("batch_leave", 0.0) + t3 - t2
        return len(rows)

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        covered = self.engine.leave_rows(seq.group, [seq])[0] if seq.phase == Phase.BATCHED else None
        self._drop(seq)
        self.engine.finish(seq, reason, covered)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        if seq.phase == Phase.BATCHED:
            try:
                self.engine.leave_rows(seq.group, [seq])
            except Exception:
                log.exception("removing %s from its batch failed", seq.id)
        self._drop(seq)
        self.engine.fail(seq, exc)

    def _drop(self, seq: Sequence) -> None:
        self._running = [s for s in self._running if s is not seq]

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


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: ``top -H``, ``ps -L``, /proc/PID/task/*/comm and profilers
    show it); Python's thread names stay inside Python. Best effort: elsewhere nothing happens."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _slowed(sink, delay_s: float):
    """The test seam: the lane sleeps after handing over each token (the scheduler sees cancellations next tick)."""

    def slow_sink(event) -> None:
        sink(event)
        if isinstance(event, Delta):
            time.sleep(delay_s)

    return slow_sink


def _cancelled_before_start(seq: Sequence) -> Finished:
    seq.phase, seq.finish_reason = Phase.FINISHED, FinishReason.CANCELLED
    return Finished(
        finish_reason=str(FinishReason.CANCELLED),
        prompt_tokens=len(seq.prompt),
        completion_tokens=0,
        cached_tokens=0,
        prefill_tokens=0,
        prefill_s=0.0,
        decode_tokens=0,
        decode_s=0.0,
        queued_s=time.monotonic() - seq.enqueued_at,
    )
