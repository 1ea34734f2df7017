"""KV-cache quantization (--kv-bits) on a tiny random llama: hits equal cold, SSD round trips, scheme isolation.

The engine makes every KVCache layer a QuantizedKVCache from the first token (server.engine.kv_layout.quantize_fresh), and
the KV scheme is part of the namespace (cache.prefix.namespace). Checked here without a server or real model.
"""

from __future__ import annotations

import hashlib
import re

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from cache.copying import fork
from cache.prefix import namespace
from cache.ssd_store import SSDStore
from server.engine.kv_layout import quantize_fresh, state_nbytes, kv_scheme

FP = "ab" * 32
PROMPT = [3, 17, 42, 9, 100, 7, 7, 81, 5, 250, 33, 12, 64, 2]


@pytest.fixture(scope="module")
def model():
    config = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5)
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs.from_dict(config))  # head_dim 32
    m.update(tree_map(lambda x: mx.random.normal(x.shape) * 0.2 + (1.0 if x.ndim == 1 else 0.0), m.parameters()))
    mx.eval(m.parameters())
    return m


def _caches(model, bits):
    caches = make_prompt_cache(model)
    return caches if bits is None else quantize_fresh(caches, bits, 32)


def _prefill(model, caches, tokens, chunk):
    for i in range(0, len(tokens), chunk):
        model(mx.array(tokens[i : i + chunk])[None], cache=caches)
    mx.eval([c.state for c in caches])


def _next_logits(model, caches, token):
    return model(mx.array([[token]]), cache=caches)[0, -1]


def kv_namespace(fp: str, bits, group: int = 64) -> str:
    return namespace(fp, kv_scheme=kv_scheme(bits, group))


def test_namespace_separates_schemes():
    names = {kv_namespace(FP, None), kv_namespace(FP, 8), kv_namespace(FP, 4), kv_namespace(FP, 8, 32)}
    assert len(names) == 4 and kv_namespace(FP, None) == FP
    assert kv_scheme(None) == "float" and kv_scheme(8, 64) == "q8g64"
    quantized = names - {FP}
    assert all(re.fullmatch(r"[0-9a-f]{64}", n) for n in quantized)  # usable as an SSD directory name
    # the digest files on SSD were written under: changing it would orphan every cached file of that scheme
    assert kv_namespace(FP, 8) == hashlib.sha256(f"{FP}\0kv\0q8g64".encode()).hexdigest()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_prefix_hit_computes_what_cold_computes(model, bits):
    body, last = PROMPT[:-1], PROMPT[-1]
    cold = _caches(model, bits)
    assert all(isinstance(c, QuantizedKVCache) and c.bits == bits for c in cold)
    _prefill(model, cold, body, chunk=5)
    want = _next_logits(model, cold, last)

    donor = _caches(model, bits)
    _prefill(model, donor, body[:9] + [1, 2, 3], chunk=4)  # a longer entry that diverges after 9 tokens
    taken = fork(donor, trim=3)  # the RAM tier's zero-copy fork, trimmed to the shared prefix
    assert all(isinstance(c, QuantizedKVCache) for c in taken)
    _prefill(model, taken, body[9:], chunk=5)
    got = _next_logits(model, taken, last)
    assert mx.allclose(want, got, atol=1e-4).item()
    assert want.argmax().item() == got.argmax().item()


def test_quantized_bytes_per_token(model):
    sizes = {}
    for bits in (None, 8, 4):
        caches = _caches(model, bits)
        _prefill(model, caches, PROMPT, chunk=8)
        sizes[bits] = state_nbytes(caches) / len(PROMPT)
    # float32: 2 (k, v) * 2 layers * 2 heads * 32 dims * 4 bytes; per group of 32: float32 scale + bias
    assert sizes[None] == 2 * 2 * 2 * 32 * 4
    assert sizes[8] == sizes[None] * (8 + 64 / 32) / 32
    assert sizes[4] == sizes[None] * (4 + 64 / 32) / 32


def test_kv_quantized_entry_round_trips_through_ssd_and_restores_only_into_its_scheme(model, tmp_path):
    ns8 = kv_namespace(FP, 8, 32)
    caches = _caches(model, 8)
    body = PROMPT[:-1]
    _prefill(model, caches, body, chunk=6)
    store = SSDStore(tmp_path, FP, 1 << 30)
    assert store.write(body, caches, ns8)
    want = _next_logits(model, fork(caches), PROMPT[-1])

    again = SSDStore(tmp_path, FP, 1 << 30)  # a restart: the index is rebuilt from the files
    for other in (FP, kv_namespace(FP, 4, 32), kv_namespace(FP, 8, 64)):
        assert again.find(PROMPT, other) is None
    match = again.find(PROMPT, ns8)
    assert match is not None and match.length == len(body)
    restored = again.restore(match)
    assert restored is not None
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 8 and c.group_size == 32 for c in restored.caches)
    assert mx.allclose(want, _next_logits(model, restored.caches, PROMPT[-1]), atol=1e-5).item()


def test_unquantizable_layers_stay_as_they_are():
    from mlx_lm.models.cache import RotatingKVCache

    mixed = [KVCache(), RotatingKVCache(max_size=8)]
    out = quantize_fresh(mixed, 8, 64)
    assert isinstance(out[0], QuantizedKVCache) and out[1] is mixed[1]


def _engine(model_obj, bits):
    from types import SimpleNamespace

    from server.engine.engine import Engine, EngineConfig

    loaded = SimpleNamespace(model=model_obj, tokenizer=SimpleNamespace(eos_token_ids=[2]), fingerprint=FP)
    return Engine(loaded, prompt_cache=None, stats=None, config=EngineConfig(kv_bits=bits, kv_group_size=32))


def test_engine_starts_with_kv_bits_where_quantized_attention_works(model):
    assert _engine(model, 8).config.kv_bits == 8


def test_engine_refuses_kv_bits_where_the_device_cannot_attend_over_quantized_kv(model):
    # what mlx-cuda 0.32.4 does on an H200: quantized_matmul has no kernel for the attention shapes
    from models import ModelLoadError

    class NoQuantizedAttention:
        layers = model.layers

        def __call__(self, tokens, cache=None):
            if any(isinstance(c, QuantizedKVCache) for c in cache):
                raise RuntimeError("[quantized_matmul] No implementation for problem shape: 2x2x128x32")
            return model(tokens, cache=cache)

    with pytest.raises(ModelLoadError, match="--kv-bits 8 is not supported.*Start without --kv-bits"):
        _engine(NoQuantizedAttention(), 8)
    assert _engine(NoQuantizedAttention(), None).config.kv_bits is None  # without --kv-bits nothing is probed
