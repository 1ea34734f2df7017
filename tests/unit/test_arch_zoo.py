"""The architecture zoo's models are fit for what the zoo tests (tests/fixtures/zoo.py): each writes as an mlx-lm
directory that mlx-lm's loader and the server's (models.load_model) load, computes finite float32 logits of the
default tokenizer's vocabulary, decodes greedily far from ties, lets the context move the next token, and has the
cache kinds its family says (plain attention; sliding windows that wrap within a short test; hybrids holding both
recurrent and attention state). What the zoo is for is tested in test_zoo_models.py and test_zoo_live.py."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from tests.fixtures import zoo

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # the sum of two and three, printed\n"
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit over greedy steps; float32 reorderings (a batch) move logits ~1e-5
@pytest.fixture(scope="module")
def default_model_dir():
    from pathlib import Path

    from models import ensure_default_model

    return Path(ensure_default_model(progress=False))


FAMILY_KINDS = {
    "plain": {"KVCache"},
    "window": {"KVCache", "RotatingKVCache"},
    "hybrid": {"KVCache", "ArraysCache"},
}


def test_every_architecture_has_the_cache_kinds_of_its_family():
    for name in zoo.ZOO:
        kinds = zoo.cache_kinds(name)
        assert set(kinds) == FAMILY_KINDS[zoo.FAMILY[name]], (name, kinds)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_each_model_directory_loads_and_decodes_far_from_ties(name, default_model_dir, tmp_path):
    from mlx_lm.utils import load

    from models import load_model

    vocab = 8192  # a small embedding (the directory is ~6 MB, not ~50): the prompt's ids are folded below it
    path = zoo.write(name, tmp_path / name, default_model_dir, vocab=vocab)
    try:
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == name and config["vocab_size"] == vocab
        model, tokenizer = load(str(path))
        served = load_model(str(path), "float32", progress=False)  # the server's loader takes it too
        assert served.architecture == name
        del served
        prompt = [t % vocab for t in tokenizer.encode(TEXT)]

        logits = model(mx.array(prompt)[None])
        assert logits.shape == (1, len(prompt), vocab) and logits.dtype == mx.float32
        assert bool(mx.all(mx.isfinite(logits)))

        caches = make_prompt_cache(model)
        assert tuple(type(c).__name__ for c in caches) == zoo.cache_kinds(name)
        steps = list(generate_step(mx.array(prompt), model, max_tokens=12, prompt_cache=caches))
        margins = [zoo.top2_margin(lp[None]) for _, lp in steps]
        assert min(margins) > MIN_MARGIN, (name, min(margins))
        assert len({int(t) for t, _ in steps}) > 2, name  # not stuck on one token

        family = zoo.FAMILY[name]
        if family == "window":  # the prompt is longer than the window: the ring has wrapped, mlx-lm cannot trim it
            assert len(prompt) > zoo.WINDOW
            rings = [c for c in caches if isinstance(c, RotatingKVCache)]
            assert rings and all(c.max_size == zoo.WINDOW and not c.is_trimmable() for c in rings)
        if family == "hybrid":
            assert any(isinstance(c, ArraysCache) and c.cache[0] is not None for c in caches)
            # generate_step computes a token ahead of the one it yields: the 12th was fed too
            assert any(type(c) is KVCache and c.offset == len(prompt) + 12 for c in caches)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_the_context_moves_the_next_token():
    """Random weights at mlx's init hardly look past the last token; the zoo's must, or a wrong cache goes unseen:
    changing the first of 64 tokens changes later greedy tokens in every architecture."""
    tokens = [int(t) for t in mx.random.randint(20, 4000, (64,), key=mx.random.key(3)).tolist()]
    changed = [tokens[0] + 1] + tokens[1:]
    for name in zoo.ZOO:
        model = zoo.build(name, vocab=4096)
        a = mx.argmax(model(mx.array([tokens])), axis=-1)
        b = mx.argmax(model(mx.array([changed])), axis=-1)
        assert int(mx.sum(a[0, 1:] != b[0, 1:])) > 0, name
