"""PlainDecode: same tokens as mlx-lm's generate_step, and an exact account of what the caches cover."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from server.engine.batch.solo import PlainDecode


@pytest.fixture(scope="module")
def model():
    from tests.fixtures.tiny_models import tiny_llama

    return tiny_llama(seed=3)


PROMPT = [5, 17, 99, 3, 42, 42, 7, 250, 11]


def prefilled(model, prompt):
    caches = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def reference(model, prompt, n, **kw):
    caches = prefilled(model, prompt)
    return [t for t, _ in generate_step(mx.array(prompt[-1:]), model, max_tokens=n, prompt_cache=caches, **kw)]


@pytest.mark.parametrize("n", [1, 2, 5, 24])
def test_greedy_tokens_equal_generate_step_and_caches_cover_prompt_plus_fed(model, n):
    caches = prefilled(model, PROMPT)
    steps = PlainDecode(model, caches, PROMPT, max_tokens=n, sampler=make_sampler(0.0),
                        processors_for=lambda h: [], stream=mx.default_stream(mx.default_device()))
    got = [t for t, _ in steps]
    assert got == reference(model, PROMPT, n)
    expected_fed = 0 if n == 1 else n
    assert steps.fed_generated == expected_fed
    assert caches[0].offset == len(PROMPT) + expected_fed


def test_closed_early_reports_what_was_fed(model):
    caches = prefilled(model, PROMPT)
    steps = PlainDecode(model, caches, PROMPT, max_tokens=20, sampler=make_sampler(0.0),
                        processors_for=lambda h: [], stream=mx.default_stream(mx.default_device()))
    it = iter(steps)
    got = [next(it)[0] for _ in range(4)]
    steps.close()
    assert steps.fed_generated == 4
    assert caches[0].offset == len(PROMPT) + 4
    assert got == reference(model, PROMPT, 4)


def test_penalties_see_the_prompt_history(model):
    hist_procs = lambda h: [  # noqa: E731 - mirrors server.engine.sampling's history wrapper
        (lambda toks, logits, p=p, pre=mx.array(list(h), dtype=mx.uint32): p(mx.concatenate([pre, toks.astype(mx.uint32)]), logits))
        for p in make_logits_processors(repetition_penalty=1.8, repetition_context_size=64)]
    caches = prefilled(model, PROMPT)
    steps = PlainDecode(model, caches, PROMPT, max_tokens=12, sampler=make_sampler(0.0),
                        processors_for=hist_procs, stream=mx.default_stream(mx.default_device()))
    got = [t for t, _ in steps]
    # reference: mlx-lm with the whole prompt passed through generate_step (processors see it all)
    ref_caches = make_prompt_cache(model)
    ref = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12, prompt_cache=ref_caches,
                                       logits_processors=make_logits_processors(repetition_penalty=1.8,
                                                                                repetition_context_size=64))]
    assert got == ref


def test_repair_random_state_reseeds_only_a_state_a_failed_compiled_sampler_left_unusable():
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from server.engine.sampling import repair_random_state

    x = mx.random.normal((1, 10))
    assert repair_random_state() is False  # a usable state is left alone
    with pytest.raises(ValueError):
        mx.eval(make_sampler(temp=0.7, top_k=50)(x))  # raises inside the compiled call
    with pytest.raises(RuntimeError, match="without a primitive"):
        mx.eval(mx.random.uniform(shape=(2,)))
    assert repair_random_state() is True
    mx.eval(make_sampler(temp=0.7)(x), mx.random.uniform(shape=(2,)))


@pytest.mark.parametrize("n", [1, 3, 24])
def test_a_shared_hit_on_a_gpu_becomes_one_buffer_after_its_first_token(model, n):
    """one_buffer (a GPU): the hit's first token reads the entry where it lies; then the row's own list holds plain
    KVCache layers with room, the same tokens as generate_step's, and the entry is never written into."""
    from mlx_lm.models.cache import KVCache

    from cache.copying import fork
    from models.attention.shared_prefix import SharedPrefixKVCache, share_prefix

    entry = prefilled(model, PROMPT)
    before = [mx.array(c.keys) for c in entry]
    caches = share_prefix(fork(entry))
    assert all(isinstance(c, SharedPrefixKVCache) for c in caches)
    steps = PlainDecode(model, caches, PROMPT, max_tokens=n, sampler=make_sampler(0.0),
                        processors_for=lambda h: [], stream=mx.default_stream(mx.default_device()), one_buffer=True)
    it = iter(steps)
    got = [next(it)[0]]
    assert all(isinstance(c, SharedPrefixKVCache) for c in caches)  # the first token copied nothing
    got += [t for t, _ in it]
    assert got == reference(model, PROMPT, n)
    if n > 1:
        assert all(type(c) is KVCache and c.keys.shape[2] >= c.offset + 1 for c in caches)
        assert caches[0].offset == len(PROMPT) + n
    assert all(mx.array_equal(b, c.keys) for b, c in zip(before, entry))
