"""A model-free engine and batch for the lane's scheduling tests (tests/unit/test_lane_scheduling.py).

The fake engine has the lane-facing verbs of server.engine.Engine; every model step appends a line to a shared
``log`` so tests can read what each tick did, in order. Tokens are scripted per job: a job whose prompt is
[p0, ...] generates p0 * 100 + 1, p0 * 100 + 2, ... ; token 0 is EOS.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from server.engine import Active
from server.jobs import Job, SamplingParams
from server.sequence import SeqState, Sequence
from server.stats import ServingStats

EOS = 0


class FakeDetokenizer:
    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens, self.last_segment = [], ""

    def add_token(self, token):
        self.tokens.append(token)
        self.last_segment = f"<{token}>"

    def finalize(self):
        self.last_segment = ""


def script(job) -> list:
    """The tokens a job generates: the first prompt token picks the script; a negative one ends with EOS."""
    p0 = job.prompt[0]
    if p0 < 0:
        return [-p0 * 100 + 1, EOS]
    return [p0 * 100 + i for i in range(1, 1000)]


class FakeBatch:
    def __init__(self, log, group=None):
        self.log = log
        self.group = group  # the adapter group (None: the base model); logged with each step when set
        self._rows = []

    def __len__(self):
        return len(self._rows)

    @property
    def sequences(self):
        return list(self._rows)

    def add(self, a, caches, history, sampler=None, processors=None):
        a.history = list(history)
        self._rows.append(a)
        self.log.append(("join", a.job.id))

    def add_many(self, rows):
        for a, caches, history, opts in rows:
            self.add(a, caches, history, **opts)

    def step(self):
        ids = tuple(a.job.id for a in self._rows)
        self.log.append(("batch", ids) if self.group is None else ("batch", self.group, ids))
        out = []
        for a in self._rows:
            token = script(a.job)[len(a.seq.generated)]
            out.append((a, token, None))
        return out

    def remove(self, seqs):
        gone = {id(a) for a in seqs}
        self._rows = [a for a in self._rows if id(a) not in gone]
        for a in seqs:
            self.log.append(("leave", a.job.id))
        return [(list(a.seq.prompt) + list(a.seq.generated), None) for a in seqs]


class FakeEngine:
    def __init__(self, prefill_chunk: int = 4):
        self.prefill_chunk = prefill_chunk
        self.stats = ServingStats()
        self.prompt_cache = object()  # no `ready`: every prefix is ready
        self.log: list = []
        self.finished: dict = {}
        self.solo_only: set = set()  # job ids that cannot join a batch (like speculative ones)
        self.model = None

    def bind_stream(self):
        pass

    def warmup(self):
        pass

    def new_batch(self, a=None):
        return FakeBatch(self.log, None if a is None else self.batch_key(a))

    def batch_key(self, a):
        """Adapters are plain names in these tests (the real engine keys by the adapter's weights hash)."""
        return a.job.params.adapter

    def task_context(self):
        import contextlib

        return contextlib.nullcontext()

    def namespace_for(self, params):
        return "ns"

    def admit(self, job: Job) -> Active:
        seq = Sequence(job, FakeDetokenizer(), frozenset({EOS}))
        seq.state = SeqState.PREFILL
        self.log.append(("admit", job.id))
        return Active(seq, "ns", caches=[], done=0)

    def prefill_left(self, a: Active) -> int:
        return max(0, len(a.seq.prompt) - 1 - a.done)

    def retake(self, a: Active) -> bool:
        return False

    def prefill_step(self, a: Active, n=None, share=lambda: False) -> bool:
        end = len(a.seq.prompt) - 1
        n = self.prefill_chunk if n is None else n
        if a.done < end and n > 0:
            a.done = min(end, a.done + n)
            self.log.append(("prefill", a.job.id, a.done))
            if a.done < end:
                return False
        a.seq.state = SeqState.DECODE
        return True

    def prefills_together(self, a: Active, n: int) -> bool:
        return n > 0 and a.job.id not in self.solo_only

    def prefill_together(self, items, share=lambda: False) -> list:
        self.log.append(("prefill_together", tuple(a.job.id for a, _ in items)))
        complete = []
        for a, n in items:
            end = len(a.seq.prompt) - 1
            a.done = min(end, a.done + n)
            if a.done >= end:
                a.seq.state = SeqState.DECODE
                complete.append(a)
        return complete

    def batchable(self, a):
        return a.job.id not in self.solo_only

    can_migrate = batchable

    def row_sampler(self, a):
        return None

    def batch_processors(self, params):
        return []

    def batch_entry(self, a):
        a.in_batch, a.decoder = True, None
        return [], list(a.seq.prompt) + list(a.seq.generated)

    def resume_solo(self, a, tokens, caches):
        a.in_batch = False
        self.log.append(("resume_solo", a.job.id))

    def solo_step(self, a):
        self.log.append(("solo", a.job.id))
        a.decoder = True
        return script(a.job)[len(a.seq.generated)], None

    def finish(self, a, reason, covered=None):
        self.log.append(("finish", a.job.id, reason))
        f = a.seq.finished(reason)
        self.finished[a.job.id] = (f, list(a.seq.generated))
        self.stats.on_finished(f)
        a.job.sink(f)

    def fail(self, a, exc):
        self.fail_job(a.job, exc)

    def fail_job(self, job, exc):
        from server.jobs import Failed

        job.sink(Failed(exc))


@dataclass
class Recorder:
    """A job's sink: collects events; `done` is set by Finished/Failed."""

    events: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event):
        from server.jobs import Failed, Finished

        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()


def job(name: str, prompt: list, max_tokens: int = 3, **kw) -> tuple[Job, Recorder]:
    rec = Recorder()
    j = Job(prompt=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), sink=rec, id=name)
    return j, rec
