"""models.quant.quantize / models.quant.rotation / models.quant.evaluate on tiny random-weight models (no real model, a few seconds).

Contracts: rotation folding leaves float logits unchanged (llama, qwen2; tied and untied heads; Hadamard and
block rotation); a non-power-of-two width asks for a pure Hadamard -> a clear error; a quantized directory loads
in plain mlx-lm; a mixed-precision config round-trips (the bits mlx-lm builds are the bits the config names).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from models.quant.evaluate import compare, reference_logprobs
from models.quant.quantize import QuantSpec, quantize_dir
from models.quant.rotation import RotationError, hadamard, rotate_model, rotation_matrix

TOKENS = mx.array([[1, 5, 7, 9, 22, 3, 200, 17]])


def _config(arch: str, hidden: int = 64, tied: bool = True) -> dict:
    return dict(model_type=arch, hidden_size=hidden, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5,
                tie_word_embeddings=tied, max_position_embeddings=512)


def _model(config: dict, seed: int = 0):
    from mlx_lm.models import llama, qwen2

    mod = {"llama": llama, "qwen2": qwen2}[config["model_type"]]
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(config))
    # random norm gains and biases too, so the folding of every one of them is exercised
    model.update(tree_map(lambda x: mx.random.normal(x.shape) * 0.3 + (0.5 if x.ndim == 1 else 0.0),
                          model.parameters()))
    mx.eval(model.parameters())
    return model


def _byte_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def write_tiny_dir(out: Path, arch: str = "llama", *, tied: bool = True, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, tied=tied)
    model = _model(config, seed)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    _byte_tokenizer(out)
    return out


# -- rotation -----------------------------------------------------------------------------------------------------
def test_hadamard_is_orthogonal_and_block_too():
    for n in (1, 2, 8, 64):
        h = hadamard(n)
        assert np.allclose(h @ h.T, np.eye(n))
    q = rotation_matrix(576, "block")
    assert q.shape == (576, 576) and np.allclose(q @ q.T, np.eye(576))


@pytest.mark.parametrize("arch,tied,kind", [
    ("llama", True, "hadamard"), ("llama", False, "hadamard"), ("qwen2", True, "hadamard"),
    ("qwen2", False, "block"), ("llama", True, "block"),
])
def test_rotation_preserves_float_logits(arch, tied, kind):
    hidden = 64 if kind == "hadamard" else 96  # 96 = 32 * 3: block rotation only
    config = _config(arch, hidden=hidden, tied=tied)
    model = _model(config)
    before = model(TOKENS)
    new_config = rotate_model(model, config, kind=kind)
    after = model(TOKENS)
    assert new_config["tie_word_embeddings"] is False and "lm_head" in model
    scale = mx.abs(before).max().item()
    assert mx.abs(before - after).max().item() < 1e-5 * max(scale, 1.0)
    # and the weights did change: the stream really is rotated
    assert not mx.allclose(model.model.layers[0].self_attn.q_proj.weight,
                           _model(config).model.layers[0].self_attn.q_proj.weight).item()


def test_rotation_refuses_non_power_of_two_hadamard():
    model = _model(_config("llama", hidden=96))
    with pytest.raises(RotationError, match="96 is not a power of two"):
        rotate_model(model, _config("llama", hidden=96), kind="hadamard")


def test_rotation_refuses_other_architectures():
    with pytest.raises(RotationError, match="gemma3_text"):
        rotate_model(object(), {"model_type": "gemma3_text", "hidden_size": 64})


# -- quantize to a directory -------------------------------------------------------------------------------------
def _load(path: Path):
    from mlx_lm import load

    return load(str(path), return_config=True)


def test_uniform_quantized_dir_loads_in_plain_mlx_lm(tmp_path):
    src = write_tiny_dir(tmp_path / "src")
    res = quantize_dir(str(src), tmp_path / "q4", QuantSpec(bits=4, group_size=32))
    model, _, config = _load(res.path)
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["mlx_lane_quantize"]["weights_sha256"]
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "QuantizedLinear" and q_proj.bits == 4
    float_model, _, _ = _load(src)
    a, b = float_model(TOKENS), model(TOKENS)
    assert a.shape == b.shape and mx.all(mx.isfinite(b)).item()
    assert 4.0 < res.bits_per_weight < 6.5  # float32 scales + biases: 2 * 32 bits per group of 32


def test_mixed_precision_config_round_trips(tmp_path):
    src = write_tiny_dir(tmp_path / "src")
    spec = QuantSpec(bits=3, group_size=32, target_bpw=5.6, calib_tokens=128, seq_len=64)
    res = quantize_dir(str(src), tmp_path / "mixed", spec)
    model, _, config = _load(res.path)
    q = config["quantization"]
    per_layer = {k: v for k, v in q.items() if isinstance(v, dict)}
    assert per_layer, "a target between the low and high bit widths must raise some layers"
    assert all(v["bits"] == 4 for v in per_layer.values())
    built = {k: m.bits for k, m in tree_flatten(model.leaf_modules(), is_leaf=lambda m: hasattr(m, "bits"))
             if hasattr(m, "bits")}
    for path, bits in built.items():
        assert bits == per_layer.get(path, {"bits": q["bits"]})["bits"], path
    assert set(built.values()) == {3, 4}
    assert (res.path / "mlx_lane_sensitivities.json").is_file()


def test_target_bpw_out_of_reach_is_an_error(tmp_path):
    src = write_tiny_dir(tmp_path / "src")
    with pytest.raises(ValueError, match="outside what"):
        quantize_dir(str(src), tmp_path / "x", QuantSpec(bits=3, group_size=32, target_bpw=9.0))


def test_rotated_quantized_dir_loads_untied(tmp_path):
    src = write_tiny_dir(tmp_path / "src")
    res = quantize_dir(str(src), tmp_path / "rot", QuantSpec(bits=8, group_size=32, rotate="hadamard"))
    model, _, config = _load(res.path)
    assert config["tie_word_embeddings"] is False
    assert type(model.lm_head).__name__ == "QuantizedLinear"
    float_model, _, _ = _load(src)
    # 8-bit keeps the rotated model close to the float one: the rotation itself changed nothing
    assert mx.abs(float_model(TOKENS) - model(TOKENS)).max().item() < 0.1 * mx.abs(float_model(TOKENS)).max().item()


def test_eval_reports_zero_kl_for_the_same_model():
    model = _model(_config("llama"))
    data = mx.array(np.random.default_rng(0).integers(0, 256, (2, 16)), dtype=mx.int32)
    ref = reference_logprobs(model, data)
    row = compare(ref, model, data, config="same")
    assert abs(row.kl) < 1e-5 and row.top1 == 1.0 and row.ppl == pytest.approx(row.ppl_float)
    other = compare(ref, _model(_config("llama"), seed=1), data, config="other")
    assert other.kl > 0.01 and other.top1 < 1.0
