"""The plan executor: one ``TickPlan`` run through the engine (server.lane.seam.LaneEngine), in the plan's order.

The executor owns the running sequences' lifecycle: it asks the engine to do the model work and writes what comes
back (``Admitted``, ``Prefilled``, ``Emitted``, ``Ended``) into the sequences (phase, coverage, tokens, output),
sends their events, counts them in the serving stats, and ends them. Every rank of a model sharded over processes
runs the same plans (server.lane.replay), so nothing here decides: the scheduler did (server.lane.scheduler).

Failures are per sequence: a step that raises ends the sequences it concerned with ``Failed`` (a 500) and the lane
serves on; a batch step that raises fails that batch's rows and starts the group afresh.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, cast

from server.device_memory import trim_pool
from server.lane import cuda_profile
from server.lane.device_loss import MAX_OOM_RETRIES, device_lost_error, device_lost_reason, is_out_of_memory
from server.lane.events import Failed, Finished, Progress
from server.lane.plan import Start, TickPlan
from server.lane.seam import Admitted, Emitted, LaneEngine
from server.lane.sequence import FinishReason, Phase, Sequence

__all__ = ["Executor"]

log = logging.getLogger("mlx_lane.lane")


class Executor:
    def __init__(self, engine: LaneEngine, prompt_cache, stats):
        self.engine = engine
        self.prompt_cache = prompt_cache  # make_room before admissions (a cache.protocol.PrefixCache)
        self.stats = stats  # server.stats.ServingStats
        self.running: list[Sequence] = []  # admitted, in admission order (lane thread only)
        self.device_lost: Optional[str] = None  # the GPU's sticky error, once one is seen (server.lane.device_loss)
        self.requeued: list[Sequence] = []  # prompts whose prefill ran out of memory: back to the queue's front
        self.may_requeue = True  # False on rank 0 of a sharded model (its followers replay plans, not retries)

    def execute(self, plan: TickPlan) -> None:
        """Run one plan (see server.lane.plan for the order)."""
        stats, engine = self.stats, self.engine
        t0 = time.perf_counter()
        for seq in plan.end_waiting:
            stats.on_started(seq.id)
            self._send_end(seq, cancelled_before_start(seq))
        if plan.make_room:
            self.prompt_cache.make_room(plan.make_room)
        for seq in plan.admit:
            self._admit(seq)
        for seq in plan.cancel:
            self._end([(seq, FinishReason.CANCELLED)])
        for seq, position in plan.anchor:  # a prefix others wait for: stored when this sequence's chunk gets there
            seq.anchors = tuple(sorted({*seq.anchors, position}))
        t1 = time.perf_counter()
        # "take": the longer prefixes taken before a prefill forward; "prefill": the forwards (and the stores they
        # make); "join" / "leave": rows into and out of the batches
        phases = {"admit": t1 - t0, "take": 0.0}
        prefilled = sum(self._prefill(group, plan.store_now, phases) for group in plan.prefill)
        t2 = time.perf_counter()
        for start in plan.start:
            self._start(start)
        t3 = time.perf_counter()
        for seq in plan.leave:
            if seq.phase == Phase.BATCHED:
                self._call(seq, engine.leave_batch, seq)
                if seq.phase == Phase.BATCHED:
                    seq.phase = Phase.SOLO
        t4 = time.perf_counter()
        phases.update(prefill=t2 - t1 - phases["take"], join=t3 - t2, leave=t4 - t3)
        decoded = self._decode(plan, phases)
        t5 = time.perf_counter()
        take = phases["take"]
        prefilled += sum(self._prefill(group, plan.store_now, phases) for group in plan.prefill_late)
        phases["prefill"] += time.perf_counter() - t5 - (phases["take"] - take)
        stats.on_tick(batch=engine.batch_rows(), prefill_tokens=prefilled, decode_tokens=decoded,
                      running=len(self.running), phase_s=phases)

    # -- the steps of a plan -----------------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        self.stats.on_started(seq.id)
        seq.timings.admitted_at = time.monotonic()
        try:
            admitted: Admitted = self.engine.admit(seq)
        except Exception as exc:
            log.exception("admitting %s failed", seq.id)
            self._fail(seq, exc)
            return
        seq.start_output(admitted.detokenizer, admitted.eos, admitted.logprob_of)
        seq.cached = seq.covered = admitted.cached
        seq.phase = Phase.PREFILL
        seq.timings.prefill_started = time.monotonic()
        self.running.append(seq)

    def _prefill(self, group, store_now: bool, phases: dict) -> int:
        """One planned prefill group: each sequence takes again from the prefix cache first (an entry put this tick
        may cover more of its prompt; its seconds are added to ``phases["take"]``); then one forward for the group.
        Returns the tokens computed."""
        items = []
        t0 = time.perf_counter()
        for chunk in group:
            seq = chunk.seq
            if seq.phase != Phase.PREFILL:
                continue
            try:
                longer = self.engine.take_longer_prefix(seq)
            except Exception as exc:
                log.exception("prefill of %s failed", seq.id)
                self._fail(seq, exc)
                continue
            if longer is not None:
                seq.covered = seq.cached = longer
            items.append((seq, min(chunk.tokens, seq.prefill_left), seq.covered))
        phases["take"] += time.perf_counter() - t0
        if not items:
            return 0
        profiled = cuda_profile.current("prefill")  # --debug-cuda-profile-steps prefill:A:B
        if profiled is not None:
            profiled.before_step()
        try:
            done = self.engine.prefill([(seq, n) for seq, n, _ in items], store_now)
            if profiled is not None:
                profiled.after_step()
        except Exception as exc:
            log.exception("prefill of %s failed", ", ".join(seq.id for seq, *_ in items))
            retry = is_out_of_memory(exc) and self.may_requeue
            if retry:
                self._relieve_memory()
            for seq, *_ in items:
                if retry and seq.oom_retries < MAX_OOM_RETRIES:
                    self._requeue(seq)
                else:
                    self._fail(seq, exc)
            return 0
        if sum(1 for _, n, _ in items if n > 0) > 1:
            self.stats.on_prefill_together(sum(1 for _, n, _ in items if n > 0))
        computed = 0
        for (seq, _, before), p in zip(items, done):
            computed += p.covered - before
            seq.covered, seq.stored = p.covered, max(seq.stored, p.stored)
            if p.covered != before:
                seq.sink(Progress(p.covered, len(seq.prompt)))
            if p.ready:
                seq.phase = Phase.READY
        return computed

    def _start(self, start: Start) -> None:
        """Planned starts of decoding whose prefill did complete: into the group's batch together, or solo."""
        batch = [s for s in start.batch if s.phase in (Phase.SOLO, Phase.READY)]
        if batch:
            try:
                regrouped = self.engine.join_batch(start.group, batch)
            except Exception as exc:
                log.exception("joining the batch failed for %s", ", ".join(s.id for s in batch))
                for seq in batch:
                    self._fail(seq, exc)
            else:
                for seq in batch:
                    seq.phase = Phase.BATCHED
                for joined, facts in regrouped or ():  # it speculated alone and decodes plainly in the batch now
                    cast(Sequence, joined).facts = facts
        for seq in start.solo:
            if seq.phase == Phase.READY:
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
                out: Optional[Emitted] = self.engine.step_solo(seq)
            except Exception as exc:
                log.exception("decode of %s failed", seq.id)
                self._fail(seq, exc)
                continue
            produced += 1 if out is not None else 0
            reason = FinishReason.LENGTH if out is None else seq.on_token(out.token, out.logprobs)
            if reason is not None:
                self._end([(seq, reason)])
        phases["solo"] = time.perf_counter() - t0
        return produced

    def _step_batch(self, group, phases: dict) -> int:
        profiled = cuda_profile.current()  # --debug-cuda-profile-steps: None unless a range is still ahead
        if profiled is not None:
            profiled.before_step()
        t0 = time.perf_counter()
        try:
            stepped = self.engine.step_batch(group)
        except Exception as exc:
            log.exception("batched decode step failed; failing its sequences")
            members = [s for s in self.running if s.phase == Phase.BATCHED and s.group == group]
            self.engine.reset_batch(group, members)  # first: no row is copied out of a batch whose step failed
            for seq in members:
                self._fail(seq, exc)
            return 0
        for seq, facts in stepped.regrouped:  # its rows decode in another group from now on
            seq.facts = facts
        if profiled is not None:
            profiled.after_step()
        t1 = time.perf_counter()
        phases["batch_step"] = phases.get("batch_step", 0.0) + t1 - t0
        ending, ended = [], set()
        for out in stepped.emitted:  # a speculating row may bring several tokens; none after its end
            seq = out.seq
            if id(seq) in ended:
                continue
            reason = seq.on_token(out.token, out.logprobs)
            if reason is not None:
                ending.append((seq, reason))
                ended.add(id(seq))
        t2 = time.perf_counter()
        if ending:
            self._end(ending)
        t3 = time.perf_counter()
        phases["batch_rows"] = phases.get("batch_rows", 0.0) + t2 - t1
        if ending:
            phases["batch_leave"] = phases.get("batch_leave", 0.0) + t3 - t2
        return len(stepped.emitted)

    # -- the end of a sequence ---------------------------------------------------------------------------------
    def _end(self, ending: list) -> None:
        """These sequences end for their reasons: the engine stores what they computed; then ``Finished``."""
        seqs = [seq for seq, _ in ending]
        for seq in seqs:
            self._drop(seq)
        try:
            ended = self.engine.end(seqs)
        except Exception as exc:
            log.exception("ending %s failed", ", ".join(s.id for s in seqs))
            for seq in seqs:
                self._fail(seq, exc)
            return
        for (seq, reason), e in zip(ending, ended):
            seq.stored = max(seq.stored, e.stored)
            if e.spec is not None:
                seq.spec_stats = e.spec.as_dict()
                self.stats.on_spec(e.spec)
            finished = seq.finished(reason)
            target = seq.target
            if target is not None and target.counters is not None and not seq.internal:
                target.counters.add(finished)
            self._send_end(seq, finished)

    def _send_end(self, seq: Sequence, finished: Finished) -> None:
        if not seq.internal:
            self.stats.on_finished(finished)
        seq.sink(finished)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """The sequence ends with ``Failed`` (a 500), whatever it was doing (the lane's last resort)."""
        self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """The sequence's model work raised: it ends with ``Failed`` (a 500); the lane serves on. An error that leaves
        the GPU unusable is remembered (``device_lost``: the lane stops taking work after this tick) and the
        sequence is told so (a 503 ``device_lost``). A sequence already ended is left alone."""
        if seq.phase == Phase.FINISHED:
            return
        reason = self.note_device_loss(exc)
        if reason is not None:
            exc = device_lost_error(reason)
        self._drop(seq)
        try:
            self.engine.abandon(seq)
        except Exception:
            log.exception("abandoning %s failed", seq.id)
        seq.phase, seq.finish_reason = Phase.FINISHED, FinishReason.FAILED
        self.stats.on_failure()
        seq.sink(Failed(exc))

    def _call(self, seq: Sequence, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:
            log.exception("%s of %s failed", fn.__name__, seq.id)
            self._fail(seq, exc)

    def note_device_loss(self, exc: BaseException) -> Optional[str]:
        """Remember (and log, once) CUDA's sticky error when ``exc`` is one; return its words, else None."""
        reason = device_lost_reason(exc)
        if reason is not None and self.device_lost is None:
            log.critical("the GPU is lost to this process: %s", reason)
            self.device_lost = reason
        return reason

    def _requeue(self, seq: Sequence) -> None:
        """A prompt whose prefill ran out of memory (nothing of it reached the client yet): its engine state goes,
        and it waits again at the front of the queue (the lane takes ``requeued``), to take its prefix afresh."""
        self._drop(seq)
        try:
            self.engine.abandon(seq)
        except Exception:
            log.exception("abandoning %s failed", seq.id)
        seq.phase, seq.covered, seq.cached = Phase.WAITING, 0, 0
        seq.oom_retries += 1
        log.warning("%s ran out of memory in its prefill: back to the queue (try %d of %d)", seq.id,
                    seq.oom_retries + 1, MAX_OOM_RETRIES + 1)
        self.requeued.append(seq)

    def _relieve_memory(self) -> None:
        """After an out-of-memory: the RAM tier yields a quarter of what it holds (the running requests need it), then
        MLX's cache of freed buffers and, on a CUDA GPU, the memory pool's unused reserve go back to the card
        (server.device_memory.trim_pool): the pool fragments, and what it keeps reserved the next prefill may not fit
        in."""
        try:
            held = int(self.prompt_cache.stats().get("bytes", 0) or 0)
            if held:
                self.prompt_cache.make_room(max(1, held // 4))
            trim_pool()
        except Exception:
            log.exception("making room after an out-of-memory failed")

    def _drop(self, seq: Sequence) -> None:
        self.running = [s for s in self.running if s is not seq]


def cancelled_before_start(seq: Sequence) -> Finished:
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
