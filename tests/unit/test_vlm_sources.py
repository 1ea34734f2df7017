"""The second source's plumbing without a model (issue 46): which library a config loads from, mlx-vlm's cache classes
declared alike in models.vlm_caches (what the engine may do) and cache.vlm_classes (what the tiers fork and store), a
snapshot that later writes leave alone, and the SSD codec refusing what it would not have written. The models
themselves are checked in tests/unit/test_zoo_models.py (tests/fixtures/zoo_vlm.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm")

from cache import vlm_classes  # noqa: E402
from models import ModelLoadError, vlm_caches  # noqa: E402
from models.loading.vlm_text import MLX_VLM_ONLY, source  # noqa: E402


@pytest.mark.parametrize("model_type, asked, want", [
    ("llama", "auto", "mlx-lm"),
    ("qwen3_5", "auto", "mlx-lm"),
    ("qwen4_exp", "auto", "mlx-vlm"),
    ("step3p7", "auto", "mlx-vlm"),  # mlx-lm has its text model (step3p5), not the model_type
    ("llama", "mlx-vlm", "mlx-vlm"),  # the user asks
])
def test_a_config_loads_from_mlx_lm_first_and_from_mlx_vlm_where_only_it_has_the_model_type(model_type, asked, want):
    assert source({"model_type": model_type}, asked) == want


def test_every_architecture_we_serve_from_mlx_vlm_is_one_mlx_lm_lacks():
    assert all(source({"model_type": t}) == "mlx-vlm" for t in MLX_VLM_ONLY)


def test_a_model_type_neither_library_has_or_an_unknown_source_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="supported by neither mlx-lm nor mlx-vlm"):
        source({"model_type": "no_such_architecture"})
    with pytest.raises(ModelLoadError, match="unknown model source"):
        source({"model_type": "llama"}, "torch")


def test_the_engines_facts_and_the_tiers_codecs_name_the_same_classes():
    declared = {f"{m}.{n}" for m, n in vlm_caches.ROLES} | {"mlx_vlm.models.cache.CacheList"}
    stored = {f"{m}.{n}" for m, n in vlm_classes.CLASSES.values()} | {"mlx_vlm.models.cache.CacheList"}
    assert declared == stored
    assert set(vlm_caches.declared_classes()) == declared  # each imports here (inkling's would need mlx-audio)


def test_a_snapshot_keeps_what_the_layer_held_when_it_was_taken():
    from mlx_vlm.models.cache import ArraysCache, CacheList, KVCache

    layer = CacheList(KVCache(), ArraysCache(2))
    layer.caches[0].update_and_fetch(mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4)))
    layer.caches[1][0] = mx.zeros((1, 2))
    snap = vlm_caches.snapshot(layer)
    layer.caches[0].update_and_fetch(2 * mx.ones((1, 1, 1, 4)), 2 * mx.ones((1, 1, 1, 4)))
    layer.caches[1][0] = mx.ones((1, 2))
    assert snap.caches[0].offset == 3 and float(snap.caches[0].keys.sum()) == 12.0
    assert float(snap.caches[1][0].sum()) == 0.0
    assert vlm_caches.restores(layer) and not vlm_caches.restores(KVCache())


GOOD = {"tag": "vlm:KVCache", "state": {"l": [{"a": 0}, {"a": 1}]}, "meta": ""}


@pytest.mark.parametrize("meta", [
    GOOD,  # what encode writes for mlx-vlm's KVCache: it loads
    {"tag": "vlm:Pickle", "state": None, "meta": ""},  # not a class the registry names
    {"tag": "vlm:KVCache", "state": {"x": 1}, "meta": ""},  # a state shape encode never writes
    {"tag": "vlm:KVCache", "state": {"l": [{"a": 0}, {"a": 1}]}, "meta": {"eval": "x"}},  # a meta state of a dict
])
def test_the_ssd_codec_refuses_what_it_would_not_have_written(tmp_path, meta):
    import json

    from cache import kvfile

    path = tmp_path / "entry.safetensors"
    kv = mx.ones((1, 1, 3, 4))
    header = {"format": kvfile.FORMAT, "version": kvfile.VERSION, "fingerprint": "f", "ns": "n",
              "ns_hash": kvfile.ns_hash("n"), "tokens": [1, 2, 3], "trimmable": True, "nbytes": 2 * kv.nbytes,
              "layers": [{"tag": "vlm", "meta": meta}], "extra": {}}
    mx.save_safetensors(str(path), {"0.s0": kv, "0.s1": kv}, {"mlx_lane": json.dumps(header)})
    if meta is GOOD:
        (layer,) = kvfile.load(path).caches
        assert (type(layer).__module__, layer.offset) == ("mlx_vlm.models.cache", 3)
        return
    with pytest.raises(kvfile.KVFileError):
        kvfile.load(path)
