"""The lane: one thread that owns all model compute and serves jobs in arrival order.

``submit(job)`` appends to a FIFO (or raises ``QueueFull`` beyond ``max_queue`` waiting
jobs); the thread runs ``engine.run(job)`` for each in turn. A job cancelled while still
waiting is skipped without touching the model (it still gets its ``Finished`` event).

Shutdown, in three steps (server.serve.GracefulServer drives the first two):
  ``drain()``  refuse new jobs (``ShuttingDown``, a 503); queued and running jobs go on.
  ``abort()``  the drain ran out of time: cancel every queued and running job; each ends within
               one decode step (or prefill chunk) with ``Finished("cancelled")``, and ``aborted``
               tells the HTTP layer to end its response with a shutdown error, not a cut.
  ``stop()``   cancel whatever is left and join the thread (its last cache put is done by then).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional

from server.errors import QueueFull, ShuttingDown
from server.jobs import Delta, Finished, Job

log = logging.getLogger("mlx_lane.lane")


class Lane:
    def __init__(self, engine, *, max_queue: int = 0, token_delay_s: float = 0.0):
        self.engine = engine
        self.max_queue = max_queue  # 0 = unbounded
        self.token_delay_s = token_delay_s  # test seam (MLX_LANE_TEST_TOKEN_DELAY): pause after each token
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._active: Optional[Job] = None
        self._draining = False
        self._stopping = False
        self.aborted = False  # set by abort(): a cancelled job was ended by the shutdown, not by its client
        self._thread = threading.Thread(target=self._run, name="mlx-lane", daemon=True)
        self.ready = threading.Event()  # set once the lane has warmed the model up

    # -- control --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def drain(self) -> int:
        """Refuse new jobs from now on; return how many are queued or running (they go on)."""
        with self._cond:
            self._draining = True
            return self._busy_locked()

    def abort(self) -> int:
        """Cancel every queued and running job (the drain ran out of time); return how many."""
        with self._cond:
            self._draining = self.aborted = True
            return self._cancel_all_locked()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._draining = self._stopping = True
            self._cancel_all_locked()
            self._cond.notify_all()
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._draining:
                raise ShuttingDown("The server is shutting down and accepts no new requests; retry in a moment.",
                                   retry_after_s=5)
            if self.max_queue and len(self._queue) >= self.max_queue:
                raise QueueFull(
                    f"too many requests waiting ({len(self._queue)}); retry later", retry_after_s=1
                )
            job.enqueued_at = time.monotonic()
            self._queue.append(job)
            self._cond.notify()

    # -- introspection --------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_job_id(self) -> Optional[str]:
        job = self._active
        return job.id if job is not None else None

    def _busy_locked(self) -> int:
        return len(self._queue) + (self._active is not None)

    def _cancel_all_locked(self) -> int:
        jobs = [*self._queue, *([self._active] if self._active is not None else [])]
        for job in jobs:
            job.cancel.set()
        return len(jobs)

    # -- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        self.engine.bind_stream()
        try:
            self.engine.warmup()
        except Exception:
            log.exception("warm-up failed; serving anyway")
        self.ready.set()
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return  # stopping and drained
                job = self._queue.popleft()
                self._active = job
                self.engine.stats.on_started(job.id)
            try:
                if job.cancel.is_set():
                    finished = _cancelled_before_start(job)
                    self.engine.stats.on_finished(finished)
                    job.sink(finished)
                else:
                    if self.token_delay_s:
                        job.sink = _slowed(job.sink, self.token_delay_s)
                    self.engine.run(job)
            except Exception:  # engine.run reports its own failures; this is a last resort
                log.exception("lane failed on job %s", job.id)
            finally:
                with self._cond:
                    self._active = None


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
