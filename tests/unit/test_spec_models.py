"""Tiny random-weight llama pairs for the spec tests, and the start-up checks of a draft pair.

The helpers here are imported by the other test_spec_* modules. No model is downloaded: a
target (hidden 64, 2 layers, vocab 512) and drafts derived from it (the same weights, or the
same weights plus noise, so acceptance is neither 0 nor 1) are built in-process.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from spec import DraftMismatch, TwoModelProvider, UnsupportedDraft
from spec.two_model import tokenizer_digest

VOCAB = 512


def tiny_llama(seed: int = 0, *, hidden: int = 64, layers: int = 2, vocab: int = VOCAB) -> llama.Model:
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def noisy_copy(seed: int, noise: float, **kw) -> llama.Model:
    """The target built from ``seed`` with Gaussian noise of scale ``noise`` on every weight."""
    model = tiny_llama(seed, **kw)
    mx.random.seed(1000 + seed)
    model.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def prefilled(model, prompt: list[int]) -> list:
    """Fresh caches covering prompt[:-1] (what the lane hands the decode loop)."""
    caches = make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array(prompt[:-1])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def plain_greedy(model, prompt: list[int], n: int, logits_processors=None) -> list[int]:
    caches = prefilled(model, prompt)
    steps = generate_step(
        mx.array(prompt[-1:]), model, max_tokens=n, prompt_cache=caches, logits_processors=logits_processors
    )
    return [tok for tok, _ in steps]


def assert_caches_cover(model, caches: list, tokens: list[int]) -> None:
    """``caches`` hold exactly the KV a fresh forward over ``tokens`` produces."""
    fresh = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=fresh)
    for got, want in zip(caches, fresh, strict=True):
        assert got.offset == want.offset == len(tokens)
        for a, b in zip(got.keys_and_values(), want.keys_and_values()):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int], eos=(0,)):
        self._vocab = vocab
        self.eos_token_ids = list(eos)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def fake_vocab(n: int = VOCAB) -> dict[str, int]:
    return {f"t{i}": i for i in range(n)}


class SlidingLlama(llama.Model):
    """A llama whose caches are sliding windows (untrimmable once wrapped)."""

    def make_cache(self):
        return [RotatingKVCache(max_size=16, keep=0) for _ in self.layers]


# -- start-up checks --------------------------------------------------------------------


def test_draft_with_other_vocab_size_is_refused():
    with pytest.raises(DraftMismatch, match=r"vocabulary has 384 entries but the target's has 512"):
        TwoModelProvider(tiny_llama(0), tiny_llama(1, hidden=32, vocab=384), identity="d")


def test_draft_with_other_tokenizer_is_refused():
    other = fake_vocab()
    other["renamed"] = other.pop("t7")
    with pytest.raises(DraftMismatch, match="tokenizer differs"):
        TwoModelProvider(
            tiny_llama(0),
            tiny_llama(1, hidden=32),
            identity="d",
            target_tokenizer=FakeTokenizer(fake_vocab()),
            draft_tokenizer=FakeTokenizer(other),
        )


def test_draft_with_other_eos_is_refused():
    with pytest.raises(DraftMismatch, match="tokenizer differs"):
        TwoModelProvider(
            tiny_llama(0),
            tiny_llama(1, hidden=32),
            identity="d",
            target_tokenizer=FakeTokenizer(fake_vocab(), eos=(0,)),
            draft_tokenizer=FakeTokenizer(fake_vocab(), eos=(1,)),
        )


def test_matching_pair_is_accepted_with_a_cost_ratio():
    provider = TwoModelProvider(
        tiny_llama(0),
        tiny_llama(1, hidden=32),
        identity="draft:abc",
        target_tokenizer=FakeTokenizer(fake_vocab()),
        draft_tokenizer=FakeTokenizer(fake_vocab()),
    )
    assert provider.identity == "draft:abc"
    assert 0.0 < provider.cost_ratio < 1.0
    assert provider.kind == "two-model"


def test_sliding_window_draft_is_refused():
    draft = SlidingLlama(tiny_llama(1).args)
    with pytest.raises(UnsupportedDraft, match="RotatingKVCache"):
        TwoModelProvider(tiny_llama(0), draft, identity="d")


def test_tokenizer_digest_depends_on_mapping_not_order():
    a = FakeTokenizer({"x": 0, "y": 1})
    b = FakeTokenizer({"y": 1, "x": 0})
    c = FakeTokenizer({"x": 1, "y": 0})
    assert tokenizer_digest(a) == tokenizer_digest(b)
    assert tokenizer_digest(a) != tokenizer_digest(c)
