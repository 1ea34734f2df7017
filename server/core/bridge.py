"""Bridge between one HTTP request (event loop) and its sequence on the lane (thread).

``JobRun`` submits a ``server.lane.sequence.Sequence`` whose thread-safe sink forwards events into an asyncio
queue, watches the client's connection (an ``http.disconnect`` sets the sequence's cancel flag, so the lane ends it
within one tick) and yields events, or ``None`` as a keep-alive tick when nothing arrived for ``keepalive_s``.
Leaving the ``async with`` block cancels the sequence if it has not finished, whatever the reason (error,
disconnect, task cancel).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import AsyncIterator, Optional

from starlette.requests import Request

from server.lane.events import Delta, Event, Failed, Finished, SamplingParams
from server.lane.sequence import Sequence
from server.lane.target import Target


class _EventPump:
    """Hands the lane's events to one event loop with one wake-up per burst, not one per event.

    The batching lane produces a token for every running request each tick; ``call_soon_threadsafe`` per event
    would wake the loop (a write to its self-pipe, a GIL hand-over) once per request per tick. Events are queued
    here and the first event of a burst schedules one ``_drain``; those that arrive before it runs ride along.
    Order per request is kept (one list, appended in the lane's order)."""

    _pumps: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _EventPump]" = weakref.WeakKeyDictionary()
    _pumps_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_EventPump":
        with cls._pumps_lock:
            pump = cls._pumps.get(loop)
            if pump is None:
                pump = cls._pumps[loop] = cls(loop)
            return pump

    def put(self, queue: asyncio.Queue, event) -> None:  # any thread
        with self._lock:
            self._pending.append((queue, event))
            first = len(self._pending) == 1
        if first:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # the loop's thread
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, event in batch:
            queue.put_nowait(event)


class JobRun:
    def __init__(self, lane, request: Request, prompt: list[int], params: SamplingParams, target: Target,
                 session: Optional[str], keepalive_s: float, request_id: Optional[str] = None, ns: str = "",
                 anchors: tuple = (), checkpoints: tuple = (), media=None):
        self.lane = lane
        self.request = request
        self.keepalive_s = keepalive_s
        self._pump = _EventPump.of(asyncio.get_running_loop())
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.seq = Sequence(prompt=prompt, params=params, sink=self._sink, target=target, session=session, ns=ns,
                            anchors=anchors, checkpoints=checkpoints, media=media)
        if request_id:
            self.seq.id = request_id
        self._watcher: Optional[asyncio.Task] = None
        self._held: Optional[Event] = None  # taken from the queue while merging deltas; goes out next
        self.done = False
        self.client_left = False  # the connection closed before the job ended (the watcher cancelled it)

    def _sink(self, event: Event) -> None:  # called on the lane thread
        self._pump.put(self._queue, event)

    async def __aenter__(self) -> "JobRun":
        self.lane.submit(self.seq)  # may raise QueueFull before anything else starts
        self._watcher = asyncio.create_task(self._watch_disconnect())
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.done:
            self.seq.cancel.set()
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch_disconnect(self) -> None:
        try:
            while True:
                message = await self.request.receive()
                if message["type"] == "http.disconnect":
                    self.client_left = True
                    self.seq.cancel.set()
                    return
        except (asyncio.CancelledError, RuntimeError, OSError):
            return

    async def events(self) -> AsyncIterator[Optional[Event]]:
        """The job's events in order; ``None`` is a keep-alive tick. Deltas that are already queued when one is
        taken go out merged into one (text and logprobs joined): a stream that keeps up still gets a token per
        event, one that fell behind (many streams, a slow event loop) catches up in fewer, larger chunks instead of
        paying the per-chunk cost of SSE framing and socket writes for every token."""
        while True:
            if self._held is not None:
                event, self._held = self._held, None
            elif not self._queue.empty():
                event = self._queue.get_nowait()  # no wait_for: it costs a task and a timer per event
            else:
                try:
                    event = await asyncio.wait_for(self._queue.get(), timeout=self.keepalive_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
            if isinstance(event, Delta) and not self._queue.empty():
                event = self._merge_queued(event)
            if isinstance(event, (Finished, Failed)):
                self.done = True
            yield event
            if self.done:
                return

    def _merge_queued(self, first: Delta) -> Delta:
        parts = [first]
        while not self._queue.empty():
            event = self._queue.get_nowait()
            if not isinstance(event, Delta):
                self._held = event  # goes out next, after the merged text
                break
            parts.append(event)
        if len(parts) == 1:
            return first
        return Delta(text="".join(p.text for p in parts), logprobs=tuple(lp for p in parts for lp in p.logprobs),
                     first_token=first.first_token)
