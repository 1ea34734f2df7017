"""Serving counters for /stats and /metrics.

``ServingStats`` is updated by the lane thread (``on_finished`` / ``on_failure``) and by
handlers (``on_first_token``/``on_request_done`` for latency), and read by the event loop.
Prometheus series use vLLM-style names under the ``mlx_lane:`` prefix; they live in a
private registry so several servers in one process (tests) never collide.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.lane.events import Finished

RECENT_STARTED = 128
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _Mean:
    """Running mean and last value of a rate."""

    def __init__(self):
        self.last = None
        self.total = 0.0
        self.count = 0

    def add(self, value: float) -> None:
        self.last = value
        self.total += value
        self.count += 1

    def as_dict(self) -> dict:
        mean = self.total / self.count if self.count else None
        return {"last": _round(self.last), "mean": _round(mean)}


def _round(x):
    return None if x is None else round(x, 3)


class EmbeddingTotals:
    """/v1/embeddings counters: requests, inputs, tokens (thread-safe; Prometheus counters alongside)."""

    def __init__(self, registry):
        self._lock = threading.Lock()
        self.requests = self.inputs = self.tokens = 0
        self._m_requests = Counter("mlx_lane:embedding_requests", "Embeddings requests served", registry=registry)
        self._m_inputs = Counter("mlx_lane:embedding_inputs", "Inputs embedded", registry=registry)
        self._m_tokens = Counter("mlx_lane:embedding_tokens", "Tokens embedded (special tokens included)",
                                 registry=registry)

    def add(self, *, inputs: int, tokens: int) -> None:
        with self._lock:
            self.requests += 1
            self.inputs += inputs
            self.tokens += tokens
        self._m_requests.inc()
        self._m_inputs.inc(inputs)
        self._m_tokens.inc(tokens)

    def as_dict(self, embedder=None) -> dict:
        with self._lock:
            d = {"enabled": embedder is not None, "requests": self.requests, "inputs": self.inputs,
                 "tokens": self.tokens}
        if embedder is not None:
            d.update({"model": embedder.model_id, "dimensions": embedder.dims, "max_input_tokens": embedder.max_tokens})
        return d


class ServingStats:
    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests_served = 0
        self.requests_failed = 0
        self.requests_cancelled = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        # request ids in the order the lane started them: FIFO order is observable from /stats
        self.recent_started: collections.deque[str] = collections.deque(maxlen=RECENT_STARTED)
        self.recent_queued: collections.deque[str] = collections.deque(maxlen=RECENT_STARTED)  # lane.submit order
        self.prefill_tps = _Mean()
        self.spec = None  # server.engine.speculation.SpecTotals when a draft is configured
        self.decode_tps = _Mean()
        self.registry = CollectorRegistry()
        self.embeddings = EmbeddingTotals(self.registry)
        self._m_requests = Counter(
            "mlx_lane:request_success", "Finished requests by finish reason",
            ["finished_reason"], registry=self.registry,
        )
        self._m_failed = Counter("mlx_lane:request_failure", "Requests that failed", registry=self.registry)
        self._m_prompt = Counter("mlx_lane:prompt_tokens", "Prompt tokens", registry=self.registry)
        self._m_generation = Counter("mlx_lane:generation_tokens", "Generated tokens", registry=self.registry)
        self._m_ttft = Histogram(
            "mlx_lane:time_to_first_token_seconds", "Time to first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self._m_e2e = Histogram(
            "mlx_lane:e2e_request_latency_seconds", "End-to-end request latency",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self._m_queue_time = Histogram(
            "mlx_lane:request_queue_time_seconds", "Time waiting for the lane",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue_depth = Gauge("mlx_lane:num_requests_waiting", "Requests waiting", registry=self.registry)
        # the batching lane (issue 12): what each tick did
        self.ticks = 0
        self.batch_now = 0
        self.running_now = 0
        self.running_max = 0
        self.batch_hist: collections.Counter = collections.Counter()  # batch size -> decode ticks
        self.batch_rows = 0  # sum of batch sizes over decode ticks
        self.tick_seconds: collections.Counter = collections.Counter()  # lane phase -> seconds, over all ticks
        self.prefill_batches = 0  # batched prefill forwards (--prefill-batch)
        self.prefill_batch_rows = 0  # prompts computed in them
        self.hits_read_in_place = 0  # RAM hits whose caches read the entry where it lies (models.attention.shared_prefix)
        self.prefill_tick_tokens = 0
        self.decode_tick_tokens = 0
        self.prefill_ticks = 0
        self.decode_ticks = 0
        self.queue_wait = _Mean()
        self.ttft = _Mean()  # lane-side: enqueued -> first token
        self._m_running = Gauge("mlx_lane:num_requests_running", "Sequences admitted to the lane (prefilling or "
                                "decoding)", registry=self.registry)
        self._m_batch = Histogram("mlx_lane:batch_size", "Sequences in the batched decode step, per tick",
                                  buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.http_status: collections.Counter = collections.Counter()  # HTTP status -> responses
        self._m_tick_tokens = Counter("mlx_lane:tick_tokens", "Tokens computed by the lane's ticks", ["phase"],
                                      registry=self.registry)

    # -- lane thread ------------------------------------------------------------------
    def on_started(self, job_id: str) -> None:
        with self._lock:
            self.recent_started.append(job_id)

    def on_queued(self, job_id: str) -> None:
        with self._lock:
            self.recent_queued.append(job_id)

    def on_tick(self, *, batch: int, prefill_tokens: int, decode_tokens: int, running: int,
                phase_s: Optional[dict] = None) -> None:
        """One lane tick; ``phase_s`` = seconds the tick spent in each of its phases (see Lane._tick)."""
        with self._lock:
            self.ticks += 1
            for phase, dt in (phase_s or {}).items():
                self.tick_seconds[phase] += dt
            self.batch_now, self.running_now = batch, running
            self.running_max = max(self.running_max, running)
            if batch:
                self.batch_hist[batch] += 1
                self.batch_rows += batch
            if prefill_tokens:
                self.prefill_ticks += 1
                self.prefill_tick_tokens += prefill_tokens
            if decode_tokens:
                self.decode_ticks += 1
                self.decode_tick_tokens += decode_tokens
        self._m_running.set(running)
        if batch:
            self._m_batch.observe(batch)
        if prefill_tokens:
            self._m_tick_tokens.labels("prefill").inc(prefill_tokens)
        if decode_tokens:
            self._m_tick_tokens.labels("decode").inc(decode_tokens)

    def on_hit_read_in_place(self) -> None:
        with self._lock:
            self.hits_read_in_place += 1

    def on_prefill_together(self, rows: int) -> None:
        with self._lock:
            self.prefill_batches += 1
            self.prefill_batch_rows += rows

    def batch_block(self) -> dict:
        """The batching part of /stats' lane block."""
        with self._lock:
            ticks_with_batch = sum(self.batch_hist.values())
            return {
                "running": self.running_now,
                "running_max": self.running_max,
                "batch_size": {
                    "current": self.batch_now,
                    "mean": round(self.batch_rows / ticks_with_batch, 3) if ticks_with_batch else None,
                    "histogram": {str(k): v for k, v in sorted(self.batch_hist.items())},
                },
                "ticks": self.ticks,
                "prefill_tokens_per_tick": round(self.prefill_tick_tokens / self.prefill_ticks, 2)
                if self.prefill_ticks else None,
                "decode_tokens_per_tick": round(self.decode_tick_tokens / self.decode_ticks, 2)
                if self.decode_ticks else None,
                "prefill_batches": {"forwards": self.prefill_batches, "rows": self.prefill_batch_rows},
                "hits_read_in_place": self.hits_read_in_place,
                "queue_wait_s": self.queue_wait.as_dict(),
                "ttft_s": self.ttft.as_dict(),
                # where the lane thread's time went: admit (take, caches), prefill (chunks), batch_step (the
                # batched forward, including waiting for the device), batch_rows (per-row tokens: detokenize,
                # stops, events), batch_leave (finished rows out of the batch and their caches stored: RAM put,
                # SSD write scheduled), solo (solo sequences' steps)
                "tick_seconds": {k: round(v, 3) for k, v in sorted(self.tick_seconds.items())},
            }

    def on_finished(self, f: Finished) -> None:
        with self._lock:
            self.queue_wait.add(f.queued_s)
            if f.completion_tokens:
                self.ttft.add(f.queued_s + f.prefill_s)
            if f.finish_reason == "cancelled":
                self.requests_cancelled += 1
            else:
                self.requests_served += 1
            self.prompt_tokens += f.prompt_tokens
            self.completion_tokens += f.completion_tokens
            self.cached_tokens += f.cached_tokens
            if f.prefill_tokens > 0 and f.prefill_s > 0:
                self.prefill_tps.add(f.prefill_tokens / f.prefill_s)
            if f.decode_tokens > 0 and f.decode_s > 0:
                self.decode_tps.add(f.decode_tokens / f.decode_s)
        self._m_requests.labels(f.finish_reason).inc()
        self._m_prompt.inc(f.prompt_tokens)
        self._m_generation.inc(f.completion_tokens)
        self._m_queue_time.observe(f.queued_s)

    def on_spec(self, spec_stats) -> None:
        if self.spec is not None:
            self.spec.add(spec_stats)

    def on_failure(self) -> None:
        with self._lock:
            self.requests_failed += 1
        self._m_failed.inc()

    # -- handlers -----------------------------------------------------------------------
    def on_http_status(self, status: int) -> None:
        with self._lock:
            self.http_status[status] += 1

    def http_block(self) -> dict:
        """/stats' ``http`` block: responses by status code (the dashboard's errors by status)."""
        with self._lock:
            by_status = {str(k): v for k, v in sorted(self.http_status.items())}
            errors = sum(v for k, v in self.http_status.items() if k >= 400)
            return {"responses": sum(self.http_status.values()), "errors": errors, "by_status": by_status}

    def observe_ttft(self, seconds: float) -> None:
        self._m_ttft.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._m_e2e.observe(seconds)

    # -- readers ------------------------------------------------------------------------
    def lane_block(self) -> dict:
        with self._lock:
            return {
                "requests_served": self.requests_served,
                "requests_failed": self.requests_failed,
                "requests_cancelled": self.requests_cancelled,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
                "prefill_tokens_per_s": self.prefill_tps.as_dict(),
                "decode_tokens_per_s": self.decode_tps.as_dict(),
                "uptime_s": round(time.time() - self.started, 1),
                "recent_started": list(self.recent_started),
                "recent_queued": list(self.recent_queued),
            }

