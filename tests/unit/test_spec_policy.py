"""Model-free parts of spec/: the adaptive draft-length policy, the counters, n-gram lookup."""

from __future__ import annotations

import pytest

from spec import AdaptiveDraftLength, FixedDraftLength, NgramProvider, NgramSource, SpecStats, break_even_rate

# -- AdaptiveDraftLength -----------------------------------------------------------------


def test_starts_at_max_and_shrinks_on_poor_rounds_down_to_min():
    p = AdaptiveDraftLength(5, min_len=2, stop_below=0.0)
    assert p.next_length() == 5
    lengths = []
    for _ in range(6):
        p.update(p.next_length(), 0)
        lengths.append(p.next_length())
    assert lengths == [4, 3, 2, 2, 2, 2]
    assert not p.stopped  # stop_below=0 never stops


def test_grows_after_full_accepts_up_to_max():
    p = AdaptiveDraftLength(4, start=1)
    seen = []
    for _ in range(5):
        n = p.next_length()
        p.update(n, n)
        seen.append(p.next_length())
    assert seen == [2, 3, 4, 4, 4]


def test_half_accepted_keeps_the_length():
    p = AdaptiveDraftLength(4, start=3, stop_below=0.0)
    p.update(4, 2)
    assert p.next_length() == 3


@pytest.mark.parametrize(
    "rounds, stop_below, warmup, stopped",
    [
        ([(4, 0)] * 3, 0.3, 4, False),  # still warming up
        ([(4, 0)] * 4, 0.3, 4, True),  # 0% over the window
        ([(4, 1)] * 8, 0.3, 4, True),  # 25% < 30%
        ([(4, 2)] * 8, 0.3, 4, False),  # 50% pays
        ([(4, 4)] * 2 + [(4, 0)] * 6, 0.3, 4, True),  # good start, then nothing: window forgets
    ],
)
def test_stops_when_recent_acceptance_is_below_break_even(rounds, stop_below, warmup, stopped):
    p = AdaptiveDraftLength(4, stop_below=stop_below, warmup=warmup, window=6)
    for d, a in rounds:
        p.update(d, a)
    assert p.stopped is stopped
    assert (p.next_length() == 0) is stopped


def test_stopped_is_final_and_rounds_without_drafts_do_not_count():
    p = AdaptiveDraftLength(3, stop_below=0.5, warmup=2)
    p.update(0, 0)  # a lookup that found nothing: no evidence either way
    p.update(0, 0)
    assert not p.stopped
    p.update(3, 0)
    p.update(3, 0)
    assert p.stopped
    p.update(3, 3)
    assert p.stopped and p.next_length() == 0


def test_policy_rejects_bad_arguments():
    with pytest.raises(ValueError):
        AdaptiveDraftLength(0)
    with pytest.raises(ValueError):
        AdaptiveDraftLength(3, min_len=4)
    with pytest.raises(ValueError):
        AdaptiveDraftLength(3).update(2, 3)
    with pytest.raises(ValueError):
        FixedDraftLength(-1)


def test_break_even_grows_with_the_draft_cost():
    assert break_even_rate(0.0) < break_even_rate(0.33) < 1.0
    assert NgramProvider().policy(4).stop_below == pytest.approx(break_even_rate(0.0))


def test_fixed_length():
    p = FixedDraftLength(3)
    p.update(3, 0)
    assert p.next_length() == 3 and not p.stopped
    assert FixedDraftLength(0).stopped


# -- SpecStats ---------------------------------------------------------------------------


def test_stats_rates_and_sum():
    s = SpecStats()
    assert s.acceptance_rate == 0.0 and s.mean_accepted_length == 0.0
    s += SpecStats(rounds=4, drafted=12, accepted=9, emitted=13)
    s += SpecStats(rounds=1, drafted=3, accepted=0, emitted=5, stopped=1)
    assert (s.rounds, s.drafted, s.accepted, s.emitted, s.stopped) == (5, 15, 9, 18, 1)
    assert s.acceptance_rate == pytest.approx(0.6)
    assert s.mean_accepted_length == pytest.approx(1.8)
    d = s.as_dict()
    assert d["acceptance_rate"] == pytest.approx(0.6) and d["drafted"] == 15


# -- n-gram lookup -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq, n, want",
    [
        ([1, 2, 3, 9, 9, 1, 2, 3], 3, [9, 9, 1]),  # trigram match, continuation
        ([5, 1, 2, 3, 4, 7, 2, 3], 2, [4, 7]),  # bigram match ("2 3")
        ([5, 6, 7, 8, 6], 2, [7, 8]),  # unigram only
        ([1, 2, 3, 4], 3, []),  # no earlier occurrence
        ([1, 2, 1, 2, 7, 1, 2], 4, [7, 1, 2, 7]),  # LATEST earlier occurrence, then periodic extension
        ([4, 4, 4], 3, [4, 4, 4]),  # period-1 repeat extends past the tail
        ([1, 2, 3, 1, 2, 3], 5, [1, 2, 3, 1, 2]),  # match runs into the tail: periodic
    ],
)
def test_lookup_table(seq, n, want):
    src = NgramSource(max_ngram=3, min_ngram=1)
    src.prefill(seq)
    assert src.lookup(n) == want


def test_longer_ngram_wins_over_more_recent_shorter_one():
    # "1 2 3" -> 8 earlier; "3" alone most recently -> 6
    src = NgramSource(3, 1)
    src.prefill([1, 2, 3, 8, 0, 3, 6, 0, 1, 2, 3])
    assert src.lookup(1) == [8]


def test_min_ngram_filters_short_matches():
    src = NgramSource(max_ngram=3, min_ngram=2)
    src.prefill([5, 6, 7, 8, 6])
    assert src.lookup(2) == []


def test_draft_commit_follow_the_sequence():
    src = NgramProvider().open()
    src.prefill([1, 2, 3, 4, 1, 2])
    assert src.draft([3], 2) == [4, 1]  # sequence is now ...1 2 3
    src.commit([4, 1], 1)  # 4 accepted, 1 rejected
    assert src.tokens == [1, 2, 3, 4, 1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        src.commit([4, 1], 1)  # nothing open
    assert src.draft([9], 3) == []  # "...4 9": 9 never seen
    src.commit([], 0)
    src.prefill([7, 7])  # not an extension: starts over
    assert src.tokens == [7, 7] and src.lookup(2) == [7, 7]


def test_draft_twice_without_commit_is_an_error():
    src = NgramSource()
    src.prefill([1, 2, 1])
    assert src.draft([2], 1) == [1]
    with pytest.raises(RuntimeError):
        src.draft([], 1)


def test_ngram_provider_is_stateless():
    p = NgramProvider(max_ngram=4, min_ngram=2)
    assert p.identity is None and p.cost_ratio == 0.0 and p.open().caches is None
    with pytest.raises(ValueError):
        NgramProvider(max_ngram=1, min_ngram=2)


def test_lookup_cost_does_not_grow_with_length():
    import time

    src = NgramSource()
    src.prefill(list(range(1000)) * 50)  # 50k tokens
    t0 = time.perf_counter()
    for _ in range(1000):
        src.lookup(4)
    assert time.perf_counter() - t0 < 0.5


def test_pause_instead_of_stop_then_probe_again_with_backoff():
    p = AdaptiveDraftLength(4, stop_below=0.5, warmup=2, window=4, pause=3)
    p.update(4, 0)
    p.update(4, 0)
    assert not p.stopped
    assert [p.next_length() for _ in range(3)] == [0, 0, 0]  # paused
    assert p.next_length() == 1  # probing again from min_len
    p.update(1, 0)
    p.update(1, 0)  # fails again: twice as long
    assert [p.next_length() for _ in range(6)] == [0] * 6
    assert p.next_length() == 1
    for _ in range(4):  # it pays now: grows back
        p.update(p.next_length(), p.next_length())
    assert p.next_length() == 4


def test_backoff_is_capped():
    p = AdaptiveDraftLength(2, stop_below=0.5, warmup=1, window=1, pause=1)
    zeros = []
    for _ in range(6):
        p.update(1, 0)
        n = 0
        while p.next_length() == 0:
            n += 1
        zeros.append(n)
    assert zeros == [1, 2, 4, 8, 8, 8]


def test_ngram_policy_pauses_and_two_model_default_stops():
    assert NgramProvider().policy(4).pause is not None
    from spec.source import DraftProvider

    assert DraftProvider().policy(4).pause is None
