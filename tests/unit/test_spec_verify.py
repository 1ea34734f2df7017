"""The verify loop on tiny random llamas: identity with plain greedy, rollback, EOS, close, sampling.

Every speculative run is compared with mlx-lm's plain ``generate_step`` on fresh caches of the
same target; "caches cover X" is checked against the KV of a fresh forward over X.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from spec import AdaptiveDraftLength, FixedDraftLength, NgramProvider, SpecStats, TwoModelProvider, speculative_decode
from tests.unit.test_spec_models import assert_caches_cover, noisy_copy, plain_greedy, prefilled, tiny_llama

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4],
    [10, 11, 12, 10, 11, 12, 10, 11],
    [300, 5, 77, 300, 5, 77, 9, 300, 5, 77, 9],
    [42] * 3 + list(range(100, 130)) + [42] * 3 + list(range(100, 110)),
]
N = 72


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def providers(target):
    return {
        "noisy": TwoModelProvider(target, noisy_copy(0, 0.005), identity="draft:noisy"),
        "same": TwoModelProvider(target, tiny_llama(0), identity="draft:same"),
        "ngram": NgramProvider(),
    }


def run(target, provider, prompt, n=N, *, k=4, policy=None, sampler=None, processors=None):
    caches = prefilled(target, prompt)
    source = provider.open()
    source.prefill(prompt[:-1])
    stats = SpecStats()
    gen = speculative_decode(
        target, caches, prompt[-1], source, max_tokens=n, num_draft_tokens=k,
        policy=policy, stats=stats, sampler=sampler, logits_processors=processors,
    )
    out = list(gen)
    return out, caches, source, stats


@pytest.mark.parametrize("kind", ["noisy", "same", "ngram"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
def test_greedy_equals_plain_greedy(target, providers, kind, prompt):
    want = plain_greedy(target, prompt, N)
    out, caches, source, stats = run(target, providers[kind], prompt)
    assert [t for t, _, _ in out] == want
    assert stats.emitted == N
    assert stats.accepted == sum(1 for _, _, d in out if d)
    assert stats.accepted > 0 and stats.rounds > 0
    if kind == "same":
        assert stats.accepted == stats.drafted  # the draft is the target: nothing is ever rejected
    if kind == "noisy":
        assert stats.accepted < stats.drafted  # non-trivial: some drafts rejected, rollback exercised
    assert_caches_cover(target, caches, prompt + want)


@pytest.mark.parametrize("kind", ["noisy", "same"])
def test_drafts_read_before_verifying_decode_the_same_as_drafts_read_with_the_verdict(target, providers, kind,
                                                                                       monkeypatch):
    """The two-model source hands its drafts over unread (``draft_lazy``: one wait a round); read first
    (spec.verify.READ_DRAFTS_WITH_VERDICT False) the tokens, the rounds and both caches are the same."""
    import spec.verify

    prompt = PROMPTS[0]
    runs = {}
    for with_verdict in (True, False):
        monkeypatch.setattr(spec.verify, "READ_DRAFTS_WITH_VERDICT", with_verdict)
        out, caches, source, stats = run(target, providers[kind], prompt)
        seq = prompt + [t for t, _, _ in out]
        source.prefill(seq)
        assert_caches_cover(providers[kind].model, source.caches, seq)
        assert_caches_cover(target, caches, seq)
        runs[with_verdict] = ([t for t, _, _ in out], stats.rounds, stats.drafted, stats.accepted)
    assert runs[True] == runs[False]
    assert runs[True][0] == plain_greedy(target, prompt, N)


def test_an_unread_draft_taken_back_whole_leaves_the_draft_caches_on_the_sequence(target, providers):
    """A verify forward that failed before reading the drafts: the verifier commits the array itself, nothing
    accepted; the draft model's caches drop every drafted position they were fed, unread."""
    prompt = PROMPTS[1]
    source = providers["noisy"].open()
    source.prefill(prompt[:-1])
    proposed = source.draft_lazy([prompt[-1]], 4)
    assert isinstance(proposed, mx.array) and proposed.shape == (4,)
    source.commit(proposed, 0)
    assert source.tokens == prompt
    assert_caches_cover(providers["noisy"].model, source.caches, prompt)
    again = source.draft([77], 3)  # drafting goes on from the sequence and the target's correction
    assert len(again) == 3
    source.commit(again, 3)
    source.prefill(prompt + [77] + again)
    assert_caches_cover(providers["noisy"].model, source.caches, prompt + [77] + again)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_identity_for_each_draft_length(target, providers, k):
    prompt = PROMPTS[0]
    want = plain_greedy(target, prompt, N)
    out, caches, _, stats = run(target, providers["noisy"], prompt, k=k)
    assert [t for t, _, _ in out] == want
    assert stats.drafted <= k * stats.rounds


def test_logprobs_match_plain_decode(target, providers):
    from mlx_lm.generate import generate_step

    prompt = PROMPTS[1]
    caches = prefilled(target, prompt)
    plain = [(t, lp) for t, lp in generate_step(mx.array(prompt[-1:]), target, max_tokens=16, prompt_cache=caches)]
    out, _, _, _ = run(target, providers["noisy"], prompt, n=16)
    for (t1, lp1), (t2, lp2, _) in zip(plain, out, strict=True):
        assert t1 == t2
        assert lp2.shape == lp1.shape
        assert mx.allclose(lp1, lp2, atol=1e-4).item()


def test_two_model_source_syncs_to_the_whole_sequence(target, providers):
    prompt = PROMPTS[2]
    out, caches, source, _ = run(target, providers["noisy"], prompt)
    generated = [t for t, _, _ in out]
    seq = prompt + generated
    assert source.tokens == seq[: len(source.tokens)]  # after close: a prefix of the sequence
    source.prefill(seq)  # what the lane calls before storing both caches
    assert source.tokens == seq
    assert_caches_cover(providers["noisy"].model, source.caches, seq)


def test_source_reopened_on_cached_prefix(target, providers):
    """A prompt-cache hit hands the draft caches back with the tokens they cover."""
    prompt = PROMPTS[3]
    first, _, source, _ = run(target, providers["noisy"], prompt, n=24)
    seq = prompt + [t for t, _, _ in first]
    source.prefill(seq)
    longer = seq + [7, 8, 9]
    caches = prefilled(target, longer)
    again = providers["noisy"].open(source.caches, source.tokens)
    again.prefill(longer[:-1])
    assert_caches_cover(providers["noisy"].model, again.caches, longer[:-1])
    out = [t for t, _, _ in speculative_decode(target, caches, longer[-1], again, max_tokens=24)]
    assert out == plain_greedy(target, longer, 24)


@pytest.mark.parametrize("kind", ["same", "noisy"])
def test_eos_inside_a_draft_stops_at_the_same_place(target, providers, kind):
    prompt = PROMPTS[1]
    full, _, _, _ = run(target, providers[kind], prompt)
    tokens = [t for t, _, _ in full]
    # an accepted draft token that is not the last of its round, first occurrence in the output
    candidates = [
        i for i, (t, _, d) in enumerate(full)
        if d and i + 1 < len(full) and full[i + 1][2] and tokens.index(t) == i and i > 2
    ]
    assert candidates, "no accepted draft token in the middle of a round"
    stop_at = candidates[0]
    eos = tokens[stop_at]

    caches = prefilled(target, prompt)
    source = providers[kind].open()
    source.prefill(prompt[:-1])
    got = []
    gen = speculative_decode(target, caches, prompt[-1], source, max_tokens=N, num_draft_tokens=4)
    for token, _, _ in gen:  # the lane's loop: stop on EOS
        got.append(token)
        if token == eos:
            break
    gen.close()
    assert got == tokens[: stop_at + 1]
    assert_caches_cover(target, caches, prompt + got)  # plain generate_step leaves the EOS fed too


@pytest.mark.parametrize("kind", ["noisy", "ngram"])
@pytest.mark.parametrize("close_after", [1, 2, 3, 5, 8, 13, 21])
def test_early_close_leaves_caches_covering_exactly_the_yielded_tokens(target, providers, kind, close_after):
    prompt = PROMPTS[0]
    caches = prefilled(target, prompt)
    source = providers[kind].open()
    source.prefill(prompt[:-1])
    gen = speculative_decode(target, caches, prompt[-1], source, max_tokens=N, num_draft_tokens=4)
    got = [next(gen)[0] for _ in range(close_after)]
    gen.close()
    assert got == plain_greedy(target, prompt, close_after)
    assert_caches_cover(target, caches, prompt + got)
    # the caches are usable as-is: the next turn continues exactly like a fresh plain run would
    seq = prompt + got + [3]
    source.prefill(seq[:-1])
    more = [t for t, _, _ in speculative_decode(target, caches, seq[-1], source, max_tokens=16)]
    assert more == plain_greedy(target, seq, 16)


@pytest.mark.parametrize("kind", ["noisy", "ngram"])
def test_close_in_the_middle_of_an_accepted_draft(target, providers, kind):
    """Close right after an accepted draft token while later drafts of the round are still unverified/unyielded."""
    prompt = PROMPTS[2]
    full, _, _, _ = run(target, providers[kind], prompt)
    mids = [i for i in range(len(full) - 1) if full[i][2] and full[i + 1][2]]
    assert mids, "no round with two accepted drafts"
    for i in mids[:3]:
        caches = prefilled(target, prompt)
        source = providers[kind].open()
        source.prefill(prompt[:-1])
        gen = speculative_decode(target, caches, prompt[-1], source, max_tokens=N, num_draft_tokens=4)
        got = [next(gen) for _ in range(i + 1)]
        assert got[-1][2]  # the last yielded token came from a draft
        gen.close()
        assert [t for t, _, _ in got] == [t for t, _, _ in full[: i + 1]]
        assert_caches_cover(target, caches, prompt + [t for t, _, _ in got])


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_max_tokens_is_exact(target, providers, n):
    prompt = PROMPTS[3]
    out, caches, _, _ = run(target, providers["same"], prompt, n=n, k=4)
    assert [t for t, _, _ in out] == plain_greedy(target, prompt, n)
    assert_caches_cover(target, caches, prompt + [t for t, _, _ in out])


def test_logits_processors_see_the_right_history(target, providers):
    prompt = PROMPTS[2]

    def procs():
        return make_logits_processors(logit_bias={77: 2.0, 5: 1.5}, repetition_penalty=1.5, repetition_context_size=8)

    want = plain_greedy(target, prompt, N, logits_processors=procs())
    assert want != plain_greedy(target, prompt, N)  # the processors do change the text
    for kind in ("noisy", "ngram"):
        out, _, _, stats = run(target, providers[kind], prompt, processors=procs())
        assert [t for t, _, _ in out] == want, kind
        assert stats.drafted > 0


@pytest.mark.parametrize("kind", ["noisy", "ngram"])
def test_seeded_sampling_is_reproducible(target, providers, kind):
    prompt = PROMPTS[0]
    runs = []
    for _ in range(2):
        mx.random.seed(1234)
        out, caches, _, stats = run(target, providers[kind], prompt, n=40, sampler=make_sampler(temp=0.7, top_p=0.9))
        runs.append([t for t, _, _ in out])
        assert_caches_cover(target, caches, prompt + runs[-1])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 40
    mx.random.seed(99)
    other, _, _, _ = run(target, providers[kind], prompt, n=40, sampler=make_sampler(temp=0.7, top_p=0.9))
    assert [t for t, _, _ in other] != runs[0]


def test_policy_that_stops_hands_over_to_plain_decode(target, providers):
    """A draft that never agrees: the policy stops it, the text is unchanged, stats say so."""
    prompt = PROMPTS[0]
    bad = TwoModelProvider(target, tiny_llama(7), identity="draft:unrelated")
    policy = AdaptiveDraftLength(4, stop_below=0.5, warmup=3, window=4)
    out, caches, _, stats = run(target, bad, prompt, policy=policy)
    assert [t for t, _, _ in out] == plain_greedy(target, prompt, N)
    assert policy.stopped and stats.stopped == 1
    assert stats.rounds <= 6  # stopped early, the rest decoded plainly
    assert stats.emitted == N
    assert_caches_cover(target, caches, prompt + [t for t, _, _ in out])


def test_close_after_policy_stop(target):
    prompt = PROMPTS[0]
    bad = TwoModelProvider(target, tiny_llama(7), identity="draft:unrelated")
    caches = prefilled(target, prompt)
    source = bad.open()
    source.prefill(prompt[:-1])
    gen = speculative_decode(
        target, caches, prompt[-1], source, max_tokens=N, num_draft_tokens=4,
        policy=AdaptiveDraftLength(4, stop_below=1.1, warmup=1),
    )
    got = [next(gen)[0] for _ in range(20)]
    gen.close()
    assert got == plain_greedy(target, prompt, 20)
    assert_caches_cover(target, caches, prompt + got)


def test_zero_draft_length_is_plain_decode(target, providers):
    prompt = PROMPTS[1]
    out, caches, _, stats = run(target, providers["ngram"], prompt, policy=FixedDraftLength(0))
    assert [t for t, _, _ in out] == plain_greedy(target, prompt, N)
    assert stats.drafted == 0 and not any(d for _, _, d in out)


@pytest.mark.parametrize("kind", ["noisy", "ngram"])
def test_default_adaptive_policy_keeps_greedy_identity(target, providers, kind):
    for prompt in PROMPTS[:2]:
        policy = providers[kind].policy(4)
        out, caches, _, stats = run(target, providers[kind], prompt, policy=policy)
        assert [t for t, _, _ in out] == plain_greedy(target, prompt, N)
        assert stats.drafted > 0
        assert_caches_cover(target, caches, prompt + [t for t, _, _ in out])
