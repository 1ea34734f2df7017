"""Sequence: one request's token -> text state machine (no model): stops, EOS, length, first token, the end."""

from __future__ import annotations

from server.lane.events import Delta, SamplingParams
from server.lane.seam import SeqFacts
from server.lane.sequence import FinishReason, Phase, Sequence
from tests.fixtures.tiny_models import TextOfIds

EOS = 0


def seq(max_tokens=10, stop=()):
    events = []
    s = Sequence(prompt=[1, 2, 3], params=SamplingParams(max_tokens=max_tokens, stop=tuple(stop)), sink=events.append)
    s.start_output(TextOfIds(), frozenset({EOS}))
    return s, events


def texts(events):
    return "".join(e.text for e in events if isinstance(e, Delta))


def test_tokens_become_deltas_and_the_first_is_marked():
    s, events = seq()
    assert s.on_token(5) is None and s.on_token(6) is None
    assert [e.first_token for e in events] == [True, False]
    assert texts(events) == "<5><6>"


def test_max_tokens_is_length_and_eos_is_stop():
    s, _ = seq(max_tokens=2)
    assert s.on_token(5) is None
    assert s.on_token(6) is FinishReason.LENGTH
    s2, events2 = seq()
    assert s2.on_token(5) is None
    assert s2.on_token(EOS) is FinishReason.STOP
    assert texts(events2) == "<5>"  # EOS itself is never text
    f = s2.finished(FinishReason.STOP)
    assert (f.completion_tokens, f.prompt_tokens, f.finish_reason) == (2, 3, "stop")
    assert s2.phase == Phase.FINISHED and s2.finish_reason is FinishReason.STOP


def test_a_stop_string_is_never_emitted_even_split_across_tokens():
    s, events = seq(stop=["<7><8>"])
    assert s.on_token(5) is None
    assert s.on_token(7) is None  # "<7>" could start the stop string: held back
    assert texts(events) == "<5>"
    assert s.on_token(8) is FinishReason.STOP
    assert texts(events) == "<5>"
    assert s.finished(FinishReason.STOP).stop_sequence == "<7><8>"  # Anthropic's stop_sequence comes from here


def test_held_back_text_is_released_when_generation_ends_otherwise():
    s, events = seq(max_tokens=2, stop=["<6><9>"])
    s.on_token(5)
    assert s.on_token(6) is FinishReason.LENGTH
    assert texts(events) == "<5><6>"


def test_cancellation_is_the_schedulers_not_the_tokens():
    """The scheduler ends a cancelled sequence at the start of a tick (every rank of a sharded model at the same
    point); a token sampled meanwhile is still emitted, and the end says cancelled."""
    s, events = seq()
    s.on_token(5)
    s.cancel.set()
    assert s.cancelled and s.on_token(6) is None
    assert texts(events) == "<5><6>"
    assert s.finished(FinishReason.CANCELLED).finish_reason == "cancelled"


def test_migratable_needs_a_batch_no_grammar_and_an_unwrapped_window():
    s, _ = seq()
    assert not s.migratable  # not batchable (the engine has not said so)
    s.facts = SeqFacts(batchable=True)
    assert s.migratable
    s.facts = SeqFacts(batchable=True, window=4)
    s.generated = [1]
    assert not s.migratable  # 3 prompt + 1 generated tokens fill a window of 4: it cannot be trimmed back
