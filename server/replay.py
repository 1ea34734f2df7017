"""Rank 0 leads the lane, the other ranks replay it: the tick plan of a model sharded over processes.

A sharded model's forward is a collective: every rank must run the same model calls, on the same shapes, in the
same order, or the group deadlocks or computes garbage. The lane (server.lane) is deterministic given three inputs
that only rank 0 sees (the HTTP side lives there), so rank 0 broadcasts them at the start of every tick in which it
does model work, and every follower runs the very same ``Lane._tick`` code on them:

  * ``admit``: the jobs the scheduler admitted this tick (id, prompt, session, sampling parameters, the grammar's
    source text, and whether it was already cancelled);
  * ``cancel``: the running jobs whose client went away (or that the shutdown cancelled) since the last tick;
  * ``waiting``: whether requests wait for admission (decides whether a finished prefill is shared at once).

Everything else the lane decides follows from those and from the tokens, which are the same on every rank: the
sharded forward ends with the same logits on every rank (an all-reduce), sampling is seeded the same on every rank
(``Group.same_seed`` for unseeded requests, the request's seed otherwise) and grammars are compiled from the same
text. Prefix-cache hits are agreed by all ranks (server.sharded_cache). The plan also carries each running job's
generated-token count, which followers check: a divergence is logged as an error, never silent.

Rank 0 sees a job through a *view*: a copy with its own cancel flag, set only at the tick start from the real one,
so that a client disconnecting in the middle of a tick changes nothing until every rank knows of it.

A ``stop`` plan ends the followers (rank 0's lane stopped: shutdown); they flush their SSD tier and exit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Optional

import orjson

from server.jobs import Job, SamplingParams

log = logging.getLogger("mlx_lane.replay")


@dataclasses.dataclass
class Plan:
    admit: list  # job specs (see job_spec)
    cancel: list  # ids
    waiting: bool
    check: dict  # id -> tokens generated so far (rank 0's count at the tick start)
    stop: bool = False

    def encode(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> "Plan":
        return cls(**orjson.loads(data))


def job_spec(job: Job, cancelled: bool) -> dict:
    """What a follower needs to rebuild ``job`` (no sink: a follower's events go nowhere)."""
    params = dataclasses.asdict(dataclasses.replace(job.params, grammar=None))
    if params.get("logit_bias"):
        params["logit_bias"] = [[int(k), float(v)] for k, v in params["logit_bias"].items()]
    params["stop"] = list(params["stop"])
    grammar = job.params.grammar.grammar if job.params.grammar is not None else None
    return {"id": job.id, "prompt": list(job.prompt), "session": job.session, "params": params,
            "grammar": grammar, "cancelled": cancelled}


def job_from_spec(spec: dict, tokenizer) -> Job:
    params = dict(spec["params"])
    params.pop("grammar", None)
    if params.get("logit_bias"):
        params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"]}
    params["stop"] = tuple(params["stop"])
    grammar = None
    if spec.get("grammar") is not None:
        from server.grammar import GrammarSpec

        grammar = GrammarSpec.compile(tokenizer, spec["grammar"])
    job = Job(prompt=list(spec["prompt"]), params=SamplingParams(**params, grammar=grammar),
              sink=_discard, session=spec.get("session"), id=spec["id"])
    if spec.get("cancelled"):
        job.cancel.set()
    return job


def _discard(event) -> None:
    pass


class Leader:
    """Rank 0's side: turns each tick's inputs into a plan, broadcasts it, hands the lane views of the jobs."""

    def __init__(self, group):
        self.group = group
        self._origin: dict[str, Job] = {}  # view id -> the handler's job (its cancel flag is the live one)
        self._lock = threading.Lock()

    def origin(self, job: Job) -> Job:
        with self._lock:
            return self._origin.get(job.id, job)

    def lead(self, jobs: list[Job], active: list, waiting: bool) -> list[Job]:
        """Broadcast this tick's plan; return the views of ``jobs`` for the lane to admit. ``active``: the lane's
        running sequences (their views get the cancellations now)."""
        cancel = []
        for a in active:
            view = a.job
            if not view.cancel.is_set() and self.origin(view).cancel.is_set():
                view.cancel.set()
                cancel.append(view.id)
        views, specs = [], []
        for job in jobs:
            cancelled = job.cancel.is_set()
            view = dataclasses.replace(job, cancel=threading.Event())
            if cancelled:
                view.cancel.set()
            views.append(view)
            specs.append(job_spec(job, cancelled))
        with self._lock:
            live = {a.job.id for a in active} | {v.id for v in views}
            self._origin = {k: v for k, v in self._origin.items() if k in live}
            self._origin.update({v.id: j for v, j in zip(views, jobs)})
        check = {a.job.id: len(a.seq.generated) for a in active}
        self.group.share_bytes(Plan(specs, cancel, waiting, check).encode())
        return views

    def stop(self) -> None:
        """Tell the followers the lane stopped (they flush their SSD tier and exit)."""
        self.group.share_bytes(Plan([], [], False, {}, stop=True).encode())


class Follower:
    """A follower's side: receives each plan and runs it through the lane's own tick."""

    def __init__(self, group, tokenizer):
        self.group = group
        self.tokenizer = tokenizer
        self.diverged = 0

    def receive(self) -> Plan:
        return Plan.decode(self.group.share_bytes(None))

    def follow(self, lane) -> None:
        """Replay plans on ``lane`` until a stop plan (lane thread)."""
        while True:
            plan = self.receive()
            if plan.stop:
                log.info("rank 0 stopped; rank %d stops", self.group.rank)
                return
            running = {a.job.id: a for a in lane.running()}
            self._check(plan.check, running)
            for job_id in plan.cancel:
                a = running.get(job_id)
                if a is not None:
                    a.job.cancel.set()
            jobs = [job_from_spec(s, self.tokenizer) for s in plan.admit]
            lane.replay_tick(jobs, plan.waiting)

    def _check(self, check: dict, running: dict) -> None:
        for job_id, n in check.items():
            a = running.get(job_id)
            mine: Optional[int] = len(a.seq.generated) if a is not None else None
            if mine != n:
                self.diverged += 1
                log.error("rank %d diverged from rank 0 on job %s: %s generated tokens here, %d on rank 0",
                          self.group.rank, job_id, mine, n)
