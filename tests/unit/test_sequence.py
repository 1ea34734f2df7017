"""Sequence: one request's token -> text state machine (no model): stops, EOS, length, cancel, first token."""

from __future__ import annotations

from server.jobs import Delta, Job, SamplingParams
from server.sequence import Sequence
from tests.unit.fake_lane import FakeDetokenizer, Recorder

EOS = 0


def seq(max_tokens=10, stop=()):
    rec = Recorder()
    job = Job(prompt=[1, 2, 3], params=SamplingParams(max_tokens=max_tokens, stop=tuple(stop)), sink=rec)
    return Sequence(job, FakeDetokenizer(), frozenset({EOS})), rec


def texts(rec):
    return "".join(e.text for e in rec.events if isinstance(e, Delta))


def test_tokens_become_deltas_and_the_first_is_marked():
    s, rec = seq()
    assert s.on_token(5) is None and s.on_token(6) is None
    assert [e.first_token for e in rec.events] == [True, False]
    assert texts(rec) == "<5><6>"


def test_max_tokens_is_length_and_eos_is_stop():
    s, rec = seq(max_tokens=2)
    assert s.on_token(5) is None
    assert s.on_token(6) == "length"
    s2, rec2 = seq()
    assert s2.on_token(5) is None
    assert s2.on_token(EOS) == "stop"
    assert texts(rec2) == "<5>"  # EOS itself is never text
    f = s2.finished("stop")
    assert (f.completion_tokens, f.prompt_tokens, f.finish_reason) == (2, 3, "stop")


def test_a_stop_string_is_never_emitted_even_split_across_tokens():
    s, rec = seq(stop=["<7><8>"])
    assert s.on_token(5) is None
    assert s.on_token(7) is None  # "<7>" could start the stop string: held back
    assert texts(rec) == "<5>"
    assert s.on_token(8) == "stop"
    assert texts(rec) == "<5>"
    assert s.finished("stop").stop_sequence == "<7><8>"  # Anthropic's stop_sequence comes from here


def test_held_back_text_is_released_when_generation_ends_otherwise():
    s, rec = seq(max_tokens=2, stop=["<6><9>"])
    s.on_token(5)
    assert s.on_token(6) == "length"
    assert texts(rec) == "<5><6>"


def test_cancellation_is_seen_after_the_token():
    s, rec = seq()
    s.on_token(5)
    s.job.cancel.set()
    assert s.on_token(6) == "cancelled"
    assert s.finished("cancelled").finish_reason == "cancelled"
