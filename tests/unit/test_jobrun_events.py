"""JobRun.events: order, merging of deltas that are already queued, keep-alive ticks (no lane, no model)."""

import asyncio

from server.core.bridge import JobRun
from server.lane.events import Delta, Finished, SamplingParams, TokenLogprob


class _Lane:
    def __init__(self):
        self.jobs = []

    def submit(self, job):
        self.jobs.append(job)


class _Request:
    async def receive(self):
        await asyncio.sleep(3600)


def _finished() -> Finished:
    return Finished("stop", 3, 2, 0, 3, 0.0, 1, 0.0, 0.0)


def _lp(text: str) -> TokenLogprob:
    return TokenLogprob(token=text, logprob=-0.5, bytes=list(text.encode()), top=[])


async def _collect(run: JobRun) -> list:
    return [ev async for ev in run.events()]


def _run(keepalive_s: float = 10.0) -> JobRun:
    return JobRun(_Lane(), _Request(), [1, 2, 3], SamplingParams(max_tokens=4), None, None, keepalive_s)


def test_queued_deltas_go_out_merged_and_the_finish_after_them():
    async def main():
        run = _run()
        async with run:
            for ev in (Delta("He", (_lp("He"),), first_token=True), Delta("llo", (_lp("llo"),)), _finished()):
                run._queue.put_nowait(ev)
            return await _collect(run)

    events = asyncio.run(main())
    assert [type(e) for e in events] == [Delta, Finished]
    merged = events[0]
    assert merged.text == "Hello" and merged.first_token
    assert [lp.token for lp in merged.logprobs] == ["He", "llo"]


def test_a_delta_taken_alone_stays_alone():
    async def main():
        run = _run()
        out = []
        async with run:
            run._queue.put_nowait(Delta("a", first_token=True))
            agen = run.events()
            out.append(await agen.__anext__())  # nothing else queued yet: one token, one event
            run._queue.put_nowait(Delta("b"))
            out.append(await agen.__anext__())
            run._queue.put_nowait(_finished())
            out.extend([ev async for ev in agen])
        return out

    events = asyncio.run(main())
    assert [getattr(e, "text", None) for e in events] == ["a", "b", None]
    assert events[0].first_token and not events[1].first_token


def test_keepalive_tick_while_nothing_arrives():
    async def main():
        run = _run(keepalive_s=0.01)
        async with run:
            agen = run.events()
            first = await agen.__anext__()
            run._queue.put_nowait(_finished())
            rest = [ev async for ev in agen]
        return first, rest

    first, rest = asyncio.run(main())
    assert first is None
    assert [type(e) for e in rest] == [Finished]
