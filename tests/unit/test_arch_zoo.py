"""The architecture zoo's model directories (tests/fixtures/arch_zoo.py): each loads with mlx-lm's loader, computes
logits of the default tokenizer's vocabulary in float32, greedy decoding stays far from ties, and its caches are the
kinds its family says (plain attention; sliding windows that wrap within a short test; hybrids with both recurrent
and attention layers). What the zoo is for is tested elsewhere; here, that each model is fit for it."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from tests.fixtures import arch_zoo

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # the sum of two and three, printed\n"
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit over greedy steps; float32 reorderings (a batch) move logits ~1e-5
FAMILY_KINDS = {
    "plain": {"KVCache"},
    "window": {"KVCache", "RotatingKVCache"},
    "hybrid": {"KVCache", "ArraysCache"},
}


@pytest.fixture(scope="module")
def tokenizer_dir():
    return arch_zoo.default_tokenizer_dir()


def test_every_architecture_has_the_cache_kinds_of_its_family():
    listed = arch_zoo.architectures()
    assert [name for name, _, _ in listed] == list(arch_zoo.ZOO)
    for name, family, kinds in listed:
        assert set(kinds) == FAMILY_KINDS[family], (name, kinds)
        assert 3 <= len(kinds) <= 4, name  # a cache per layer with a sequence state (nemotron_h's MLP block has none)


@pytest.mark.parametrize("name", list(arch_zoo.ZOO))
def test_each_model_directory_loads_and_decodes_far_from_ties(name, tokenizer_dir, tmp_path):
    from mlx_lm.utils import load

    path = arch_zoo.model_dir(name, tokenizer_dir)
    assert arch_zoo.model_dir(name, tokenizer_dir) == path  # built once, then the cached directory
    config = json.loads((path / "config.json").read_text())
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    assert config["model_type"] == name and config["vocab_size"] == vocab
    model, tokenizer = load(str(path))
    prompt = tokenizer.encode(TEXT)

    logits = model(mx.array(prompt)[None])
    assert logits.shape == (1, len(prompt), vocab) and logits.dtype == mx.float32
    assert bool(mx.all(mx.isfinite(logits)))

    caches = make_prompt_cache(model)
    assert [type(c).__name__ for c in caches] == list(arch_zoo.cache_kinds(name))
    steps = list(generate_step(mx.array(prompt), model, max_tokens=12, prompt_cache=caches))
    margins = [arch_zoo.top2_margin(lp[None]) for _, lp in steps]
    assert min(margins) > MIN_MARGIN, (name, min(margins))
    assert len({int(t) for t, _ in steps}) > 2, name  # not stuck on one token

    family = arch_zoo.ZOO[name].family
    if family == "window":  # the prompt is longer than the window: the ring has wrapped, mlx-lm cannot trim it
        assert len(prompt) > arch_zoo.WINDOW
        rings = [c for c in caches if isinstance(c, RotatingKVCache)]
        assert rings and all(c.max_size == arch_zoo.WINDOW and not c.is_trimmable() for c in rings)
    if family == "hybrid":
        assert any(isinstance(c, ArraysCache) and c.cache[0] is not None for c in caches)
        offsets = {c.offset for c in caches if type(c) is KVCache}
        assert len(offsets) == 1 and offsets.pop() > len(prompt), name  # attention beside the recurrent state


def test_the_context_moves_the_next_token():
    """Random weights at mlx's init hardly look past the last token; the zoo's must, or a wrong cache goes unseen:
    changing the first of 64 tokens changes later greedy tokens in every architecture."""
    tokens = [int(t) for t in mx.random.randint(20, 4000, (64,), key=mx.random.key(3)).tolist()]
    changed = [tokens[0] + 1] + tokens[1:]
    for name in arch_zoo.ZOO:
        model = arch_zoo.build(name, vocab=4096)
        a = mx.argmax(model(mx.array([tokens])), axis=-1)
        b = mx.argmax(model(mx.array([changed])), axis=-1)
        assert int(mx.sum(a[0, 1:] != b[0, 1:])) > 0, name
