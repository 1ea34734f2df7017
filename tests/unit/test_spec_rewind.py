"""Speculation that never fails a request for its model's caches (issue 35): a sliding-window model whose window has
wrapped takes back rejected drafts exactly (spec.rewind) and gives plain greedy decoding's tokens; a model with
recurrent state (which cannot take anything back) decodes plainly from the first token and says so. Before, both
raised "speculative decoding needs trimmable target caches" inside the lane: a 500 for every such request."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from spec import NgramSource, SpecStats, speculative_decode
from spec.rewind import can_rewind, rewind
from tests.unit.test_hybrid_batch import own_caches as prefilled  # caches after a prefill of tokens

WINDOW = 16


@pytest.fixture(scope="module")
def windowed():
    """A 2-layer gemma3-text model, its first layer a sliding window of 16 (a RotatingKVCache)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    config = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32,
              "vocab_size": 97, "sliding_window": WINDOW, "sliding_window_pattern": 2,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}
    mx.random.seed(3)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights["model.embed_tokens.weight"] = mx.random.normal(weights["model.embed_tokens.weight"].shape) * 0.5
    model.load_weights(list(weights.items()))
    assert any(isinstance(c, RotatingKVCache) for c in make_prompt_cache(model))
    return model




def plain(model, prompt, n):
    caches = prefilled(model, prompt[:-1])
    return [int(t) for t, _ in generate_step(mx.array(prompt[-1:]), model, max_tokens=n, prompt_cache=caches)]


# repetitive, so that prompt lookup drafts often (accepted and rejected), and far past the window
PROMPT = ([3, 9, 27, 81, 50, 56] * 9)[:50]


def test_ngram_speculation_over_a_wrapped_sliding_window_gives_plain_greedy_tokens(windowed):
    caches = prefilled(windowed, PROMPT[:-1])
    assert not all(c.is_trimmable() for c in caches) and can_rewind(caches)  # wrapped: mlx-lm would refuse a trim
    source = NgramSource()
    source.prefill(PROMPT[:-1])
    stats = SpecStats()
    got = [t for t, _, _ in speculative_decode(windowed, caches, PROMPT[-1], source, max_tokens=40,
                                               num_draft_tokens=4, stats=stats)]
    assert got == plain(windowed, PROMPT, 40)
    assert stats.drafted > stats.accepted > 0  # drafts were both kept and taken back after the window wrapped
    assert stats.cannot_rewind == 0


def test_a_draft_model_over_a_wrapped_window_hands_its_drafts_over_unread_and_gives_plain_greedy_tokens(windowed):
    """The two-model source drafts without being read (spec.verify reads drafts and verdict in one wait); the
    target's wrapped window takes the rejected ones back all the same."""
    from spec import FixedDraftLength
    from spec.two_model import TwoModelSource
    from tests.unit.test_spec_models import tiny_llama

    caches = prefilled(windowed, PROMPT[:-1])
    source = TwoModelSource(tiny_llama(3, vocab=97))  # an unrelated draft: mostly rejected, sometimes kept
    source.prefill(PROMPT[:-1])
    stats = SpecStats()
    got = [t for t, _, _ in speculative_decode(windowed, caches, PROMPT[-1], source, max_tokens=40,
                                               num_draft_tokens=3, stats=stats,
                                               policy=FixedDraftLength(3))]
    assert got == plain(windowed, PROMPT, 40)
    assert stats.drafted > stats.accepted and stats.cannot_rewind == 0


def test_a_wrapped_window_rewound_after_a_multi_token_forward_continues_as_if_never_fed(windowed):
    history = list(range(5, 5 + 3 * WINDOW))
    caches = prefilled(windowed, history)
    drafted = [7, 8, 9, 10]
    mx.eval(windowed(mx.array([drafted])[None][0], cache=caches))  # a verify forward of 4 positions
    rewind(caches, 3, fed=4)  # keep the first, take back three
    assert {c.offset for c in caches} == {len(history) + 1}
    want = windowed(mx.array([[11]]), cache=prefilled(windowed, history + [7]))[0, -1]
    assert mx.allclose(windowed(mx.array([[11]]), cache=caches)[0, -1], want, atol=1e-5)
    with pytest.raises(ValueError):
        rewind(caches, 1, fed=1)  # a single-token forward leaves nothing to take back


def test_a_hybrid_speculates_rewinding_its_recurrent_state_from_a_checkpoint():
    """Recurrent state has no positions to drop: before each verify forward its state is kept, and a round that
    rejected drafts restores it and feeds the kept positions again. The tokens are plain greedy decoding's, and
    drafts were both kept and taken back."""
    from tests.unit.test_hybrid_batch import tiny_qwen3_next

    model = tiny_qwen3_next(seed=1)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    caches = prefilled(model, prompt[:-1])
    assert any(isinstance(c, ArraysCache) for c in caches) and can_rewind(caches)
    source = NgramSource()
    source.prefill(prompt[:-1])
    stats = SpecStats()
    got = [t for t, _, _ in speculative_decode(model, caches, prompt[-1], source, max_tokens=24,
                                               num_draft_tokens=4, stats=stats)]
    assert got == plain(model, prompt, 24)
    assert stats.drafted > stats.accepted > 0 and stats.cannot_rewind == 0
    kv = [c for c in caches if isinstance(c, KVCache)]
    assert all(c.offset == len(prompt) + 24 for c in kv)  # prompt + every token yielded, as plain decoding leaves


@pytest.mark.parametrize("choose", [True, False], ids=["chosen", "replayed"])
def test_a_watched_hybrid_takes_drafts_back_by_choosing_a_recorded_state_not_replaying(choose):
    """With this room's kernels installed (models.kernels: the gated delta rule switched, its convolution watched),
    a verify forward keeps each recurrent layer's values at every position, and a round that rejected drafts sets the
    layer to those after the kept tokens: no replay forward (``replayed`` 0). The same tokens either way, and they
    are plain greedy decoding's."""
    from models import kernels
    from spec import rewind as rewind_module
    from tests.unit.test_hybrid_batch import tiny_qwen3_next

    model = tiny_qwen3_next(seed=1)
    assert kernels.install(model) > 0 and kernels.positions.watch(model) == 2  # two gated-delta layers of four
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    caches = prefilled(model, prompt[:-1])
    source = NgramSource()
    source.prefill(prompt[:-1])
    stats = SpecStats()
    rewind_module.CHOOSE = choose
    try:
        got = [t for t, _, _ in speculative_decode(model, caches, prompt[-1], source, max_tokens=24,
                                                   num_draft_tokens=4, stats=stats)]
    finally:
        rewind_module.CHOOSE = True
    assert got == plain(model, prompt, 24)
    assert stats.drafted > stats.accepted > 0
    # a replay happens only in a round that rejected a draft (here: every round)
    assert (stats.replayed == 0) if choose else (0 < stats.replayed <= stats.rounds), stats


def test_a_chosen_state_is_the_state_a_forward_of_the_kept_tokens_leaves():
    """Directly: after a 5-token verify forward inside ``verifying()``, taking 3 back leaves every layer (convolution
    window, delta-rule state, attention KV) as a forward of the 2 kept tokens from the same prefix leaves it."""
    from models import kernels
    from spec.rewind import VerifyRewind
    from tests.unit.test_hybrid_batch import tiny_qwen3_next

    model = tiny_qwen3_next(seed=2)
    kernels.install(model)
    history = list(range(3, 40))
    fed = [11, 12, 13, 14, 15]
    caches = prefilled(model, history)
    rewinder = VerifyRewind(model, caches, choose=True)
    with rewinder.verifying():
        mx.eval(model(mx.array([fed]), cache=caches))
    rewinder.take_back(3, fed)
    assert rewinder.replays == 0
    want = prefilled(model, history + fed[:2])

    def arrays(c):  # a recurrent layer's [conv window, state]; an attention layer's keys and values so far
        if isinstance(c, ArraysCache):
            return list(c.cache)
        return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]

    assert {type(c) for c in caches} == {ArraysCache, KVCache}
    for got_c, want_c in zip(caches, want):
        assert len(arrays(got_c)) == len(arrays(want_c)) == 2
        for a, b in zip(arrays(got_c), arrays(want_c)):
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()
    # and it goes on from there as the kept tokens' cache does
    nxt = mx.array([[16]])
    assert mx.allclose(model(nxt, cache=caches), model(nxt, cache=want), atol=1e-4).item()


def test_recurrent_state_beside_a_wrapped_window_cannot_rewind_and_decodes_plainly_from_the_first_token(windowed):
    """Recurrent state rewinds from a checkpoint only beside attention layers that can drop a whole forward: beside
    a wrapped sliding window it cannot. No draft is verified, the tokens are plain greedy decoding's, and the
    request's counters say why."""
    caches = prefilled(windowed, PROMPT[:-1]) + [ArraysCache(2)]  # a layer the model never reads, as a hybrid's
    assert not can_rewind(caches) and can_rewind(caches[:-1])
    stats = SpecStats()
    source = NgramSource()
    source.prefill(PROMPT[:-1])
    got = [t for t, _, _ in speculative_decode(windowed, caches, PROMPT[-1], source, max_tokens=12, stats=stats)]
    assert got == plain(windowed, PROMPT, 12)
    assert stats.cannot_rewind == 1 and stats.drafted == 0


@pytest.mark.parametrize("case", ["hybrid-chosen", "hybrid-replayed", "window"])
def test_a_sequence_handed_over_at_any_token_leaves_its_caches_one_short_of_what_it_yielded(case, request):
    """``HandOver`` thrown into the speculative decoder at any yield (an accepted draft's, a correction's, a bonus
    token's) leaves a hybrid's caches covering the prompt and every yielded token but the last, the sequence's next
    input, which a batch then feeds: plain decoding from there continues the plain greedy tokens. Recurrent state
    cannot take a token back, so at an accepted draft's yield the decoder takes that draft back with the rejected
    ones (the state chosen at the position before it, or replayed from the checkpoint); a wrapped window likewise."""
    from models import kernels
    from spec import rewind as rewind_module
    from spec.verify import HandOver
    from tests.unit.test_hybrid_batch import tiny_qwen3_next

    choose = case != "hybrid-replayed"
    if case == "window":
        model, prompt = request.getfixturevalue("windowed"), PROMPT
    else:
        model, prompt = tiny_qwen3_next(seed=1), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
        if choose:
            assert kernels.install(model) > 0 and kernels.positions.watch(model) == 2
    n = 40
    want = plain(model, prompt, n)

    def decoder():
        caches = prefilled(model, prompt[:-1])
        source = NgramSource()
        source.prefill(prompt[:-1])
        return caches, speculative_decode(model, caches, prompt[-1], source, max_tokens=n, num_draft_tokens=4,
                                          pipelined=False)

    rewind_module.CHOOSE = choose
    try:
        full = list(decoder()[1])
        assert [t for t, _, _ in full] == want
        # stop right after accepted drafts' yields and after the target's own tokens, three of each
        drafted = [i + 1 for i, (_, _, d) in enumerate(full[:-1]) if d][:3]
        own = [i + 1 for i, (_, _, d) in enumerate(full[:-1]) if not d][:3]
        assert drafted and own
        for stop in drafted + own:
            caches, gen = decoder()
            got = [next(gen) for _ in range(stop)]
            with pytest.raises(HandOver):
                gen.throw(HandOver())
            tokens = [t for t, _, _ in got]
            assert tokens == want[:stop]
            kv = [c for c in caches if isinstance(c, KVCache)]
            assert all(c.offset == len(prompt) + stop - 1 for c in kv), stop  # the last yielded token unfed
            more = [int(t) for t, _ in generate_step(mx.array(tokens[-1:]), model, max_tokens=n - stop,
                                                      prompt_cache=caches)]
            assert tokens + more == want, stop
    finally:
        rewind_module.CHOOSE = True
