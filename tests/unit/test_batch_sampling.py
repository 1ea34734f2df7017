"""Sampling a whole batch at once (server.engine.sampling.sample_rows): one call per distinct sampler instead of one
per row, with the same tokens as each row's own sampler wherever that is deterministic (greedy rows, seeded rows:
each seeded request keeps its own key chain), and one sampler object shared by every unseeded request with the same
settings so that such rows are drawn in one call. Model-free: fake log-probabilities."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import greedy_sampler

from server.engine.sampling import build_sampler, sample_rows
from server.lane.events import SamplingParams


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=8, **kw)

VOCAB = 32


def fake_logprobs(rows: int, seed: int = 0) -> mx.array:
    logits = mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3.0
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_unseeded_requests_with_the_same_settings_share_one_sampler_and_seeded_ones_never_do():
    a = build_sampler(params(temperature=0.7, top_p=0.9))
    b = build_sampler(params(temperature=0.7, top_p=0.9))
    assert a is b
    assert build_sampler(params(temperature=0.8, top_p=0.9)) is not a  # other settings, other sampler
    assert build_sampler(params(temperature=0)) is greedy_sampler  # every greedy row: one object
    s1 = build_sampler(params(temperature=0.7, top_p=0.9, seed=5))
    s2 = build_sampler(params(temperature=0.7, top_p=0.9, seed=5))
    assert s1 is not s2 and s1 is not a  # a seeded request's key chain is its own


def test_mixed_rows_get_the_same_tokens_as_each_rows_own_sampler_step_after_step():
    """Greedy, seeded (two with the same seed, one with another) and top-k-1 rows in one batch, over several steps:
    every token equals what the row's sampler gives the row alone, in a parallel set of samplers."""
    def samplers():
        return [build_sampler(params(temperature=0)),
                build_sampler(params(temperature=0.9, seed=11)),
                build_sampler(params(temperature=0.9, top_k=1)),  # unseeded but deterministic
                build_sampler(params(temperature=0.9, seed=11)),
                build_sampler(params(temperature=1.3, top_p=0.8, min_p=0.05, seed=3)),
                build_sampler(params(temperature=0))]

    batched, alone = samplers(), samplers()
    for step in range(6):
        lp = fake_logprobs(len(batched), seed=step)
        got = sample_rows(lp, batched).tolist()
        want = [alone[e](lp[e: e + 1]).item() for e in range(len(alone))]
        assert got == want, step
    assert got[0] == mx.argmax(lp[0]).item() and got[2] == mx.argmax(lp[2]).item()


def test_rows_sharing_an_unseeded_sampler_are_drawn_together_and_keep_their_distribution():
    """Four rows with one shared sampler: one call over (4, vocab); each row's draws follow its own distribution
    (here: every row allows exactly two tokens with probabilities 0.8 / 0.2, at different positions)."""
    sampler = build_sampler(params(temperature=1.0))
    rows = 4
    logits = mx.full((rows, VOCAB), -1e9)
    hi, lo = [1, 7, 20, 30], [2, 8, 21, 0]
    for r in range(rows):
        logits[r, hi[r]] = 0.0
        logits[r, lo[r]] = float(mx.log(mx.array(0.25)).item())  # 0.2 / 0.8 = 0.25
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(0)
    trials = 600
    counts = [[0, 0] for _ in range(rows)]
    for _ in range(trials):
        toks = sample_rows(lp, [sampler] * rows).tolist()
        for r, t in enumerate(toks):
            assert t in (hi[r], lo[r]), (r, t)
            counts[r][t == lo[r]] += 1
    for r in range(rows):
        share = counts[r][1] / trials
        assert 0.14 < share < 0.26, (r, share)  # 0.2 expected; 600 trials: sd 0.016


@pytest.mark.parametrize("order", [[0, 1, 0, 1, 1], [1, 1, 0, 0, 0]])
def test_groups_are_scattered_back_in_row_order(order):
    """Rows of two deterministic samplers interleaved in any order come back in their own rows."""
    first = build_sampler(params(temperature=0))
    second = build_sampler(params(temperature=0.5, top_k=1))
    lp = fake_logprobs(len(order), seed=42)
    got = sample_rows(lp, [(first, second)[g] for g in order]).tolist()
    assert got == mx.argmax(lp, axis=-1).tolist()
