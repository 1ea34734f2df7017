"""A batch's logits rules in a few array operations (server.engine.batch.rules) give what mlx-lm's per-row
processors give: bias, repetition, presence and frequency penalties over each row's own window, rows without rules
untouched, rows with fewer tokens than the window, a pipelined row's newest token still lazy; grammar masks of any
width in one ``where``. Model-free (random logits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from server.engine.batch.rules import Penalties, apply_rules, mask_rows, penalise, penalty_windows
from server.engine.sampling import PENALTY_CONTEXT
from server.lane.events import SamplingParams

V = 97

RULES = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.7),
    dict(frequency_penalty=0.4),
    dict(logit_bias={3: 5.0, 40: -2.5}),
    dict(logit_bias={7: 1.0}, repetition_penalty=1.6, presence_penalty=-0.3, frequency_penalty=0.9),
    dict(repetition_penalty=0.8, frequency_penalty=-0.5),
]


def theirs(logits_row: mx.array, history: list, rule: dict) -> mx.array:
    """mlx-lm's processors for one row, as server.engine.sampling builds them (the same window)."""
    x = logits_row[None]
    tokens = mx.array(history[-PENALTY_CONTEXT:], dtype=mx.uint32)
    for proc in make_logits_processors(repetition_context_size=PENALTY_CONTEXT, presence_context_size=PENALTY_CONTEXT,
                                       frequency_context_size=PENALTY_CONTEXT, **rule):
        x = proc(tokens, x)
    return x[0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_penalise_gives_mlx_lms_processors_logits_row_by_row(dtype):
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(0, 3, (len(RULES), V)).astype(np.float32)).astype(dtype)
    # windows longer and shorter than PENALTY_CONTEXT, with repeats (frequency counts them)
    histories = [rng.integers(0, V, n).tolist() for n in (5, 200, 64, 1, 30, 90)]
    rules = [Penalties.of(SamplingParams(max_tokens=4, **r)) for r in RULES]
    ours = penalise(logits, rules, penalty_windows(histories))
    assert ours.dtype == dtype
    for i, (rule, h) in enumerate(zip(RULES, histories)):
        want = theirs(logits[i], h, rule)
        if "frequency_penalty" in rule:  # k subtractions one by one vs k * penalty: the last place may differ
            assert mx.allclose(ours[i], want, rtol=1e-2 if dtype == mx.bfloat16 else 1e-5, atol=1e-5), i
        else:
            assert mx.array_equal(ours[i], want), i
    assert not mx.array_equal(ours, logits)  # the rules did something


def test_a_rows_newest_token_may_still_be_lazy_and_rows_without_rules_are_untouched():
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(0, 3, (3, V)).astype(np.float32))
    histories = [[1, 2, 3], list(range(10, 90)), [5]]
    newest = mx.argmax(logits, axis=-1)  # computed, not on the host: as a pipelined batch's next input
    rule = Penalties.of(SamplingParams(max_tokens=4, repetition_penalty=2.0, frequency_penalty=0.5))
    out = apply_rules(logits, [0, 2], [rule, rule], [None, None], [histories[0], histories[2]], newest, newest.tolist)
    for i in (0, 2):
        assert mx.allclose(out[i], theirs(logits[i], histories[i] + [newest[i].item()],
                                          dict(repetition_penalty=2.0, frequency_penalty=0.5)), atol=1e-6)
    assert mx.array_equal(out[1], logits[1])


def test_penalty_windows_right_align_and_weigh_only_real_tokens():
    tokens, weights = penalty_windows([[4, 5], list(range(100))], last=mx.array([9, 8]), size=4)
    assert tokens.tolist() == [[0, 4, 5, 9], [97, 98, 99, 8]]
    assert weights.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]


def test_no_rules_means_none_and_zero_penalties_are_not_rules():
    assert Penalties.of(SamplingParams(max_tokens=4)) is None
    assert Penalties.of(SamplingParams(max_tokens=4, presence_penalty=0.0, frequency_penalty=0.0)) is None
    p = Penalties.of(SamplingParams(max_tokens=4, logit_bias={5: 1.0}))
    assert p.logit_bias == ((5, 1.0),) and not p.needs_history


class FixedGrammar:
    """Allows tokens (previous + 1) and (previous + 2) mod 11 after its first call, token 0 or 1 at first; records
    the tokens it advanced over (the contract of GrammarProcessor.allowed)."""

    def __init__(self):
        self.seen, self.started = [], False

    def allowed(self, previous):
        a = np.zeros(11, dtype=np.bool_)
        if self.started:
            t = previous()
            self.seen.append(t)
            a[(t + 1) % 11] = a[(t + 2) % 11] = True
        else:
            a[:2] = True
        self.started = True
        return a


def test_grammar_masks_of_several_rows_go_in_one_where_and_advance_over_each_rows_own_token():
    logits = mx.zeros((3, 16))  # the model's logits are wider than the grammar's vocabulary
    g0, g2 = FixedGrammar(), FixedGrammar()
    fed = mx.array([3, 4, 5])
    out = apply_rules(logits, [0, 2], [None, None], [g0, g2], [[], []], fed, fed.tolist)
    assert mx.isinf(out[0]).tolist() == [False, False] + [True] * 14
    assert mx.array_equal(out[1], logits[1])
    out = apply_rules(logits, [0, 2], [None, None], [g0, g2], [[], []], fed, fed.tolist)
    assert g0.seen == [3] and g2.seen == [5]
    allowed0 = [i for i, inf in enumerate(mx.isinf(out[0]).tolist()) if not inf]
    allowed2 = [i for i, inf in enumerate(mx.isinf(out[2]).tolist()) if not inf]
    assert allowed0 == [4, 5] and allowed2 == [6, 7]


def test_mask_rows_pads_a_short_vocabulary_with_disallowed_and_cuts_a_long_one():
    out = mask_rows(mx.ones((2, 4)), [np.array([True, False]), np.array([False, True, True, True, True, True])])
    assert mx.isinf(out).tolist() == [[False, True, True, True], [True, False, False, False]]


@pytest.mark.parametrize("rule", RULES)
def test_the_rules_as_mlx_lm_processors_give_mlx_lms_own_processors_logits(rule):
    """The solo path, mlx-lm's GenerationBatch and the solo speculative walk run mlx-lm's loops: they take the rules
    as processors (``LogitsRules.processors(history)``, the window built on the device from the history and the
    tokens the loop fed); the logits are mlx-lm's own processors' over the same window."""
    from server.engine.batch.rules import LogitsRules

    rng = np.random.default_rng(3)
    history = rng.integers(0, V, 90).tolist()
    fed = mx.array(rng.integers(0, V, 5).tolist(), dtype=mx.uint32)  # what the loop fed since `history`
    logits = mx.array(rng.normal(0, 3, (1, V)).astype(np.float32))
    (process,) = LogitsRules.of(SamplingParams(max_tokens=4, **rule)).processors(history)
    ours = process(fed, logits)[0]
    want = theirs(logits[0], history + fed.tolist(), rule)
    if "frequency_penalty" in rule:
        assert mx.allclose(ours, want, rtol=1e-5, atol=1e-5)
    else:
        assert mx.array_equal(ours, want)
    assert LogitsRules.of(SamplingParams(max_tokens=4)).processors(history) == []  # no rules: no processor
