"""Per-architecture knowledge for GGUF -> mlx-lm conversion: tensor names, weight fix-ups, config.

Supported GGUF architectures and the mlx-lm model_type each becomes:

    llama  -> llama        (Q/K rows un-permuted: llama.cpp interleaves rotary halves)
    qwen2  -> qwen2        (not permuted; q/k/v carry biases)
    gemma3 -> gemma3_text  (norm weights stored as 1 + w: subtract 1; GGUF lacks the local rope
                            base and the sliding-window pattern, filled with gemma3's constants)
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from models.errors import ModelLoadError

__all__ = ["SUPPORTED_ARCHITECTURES", "check_architecture", "mlx_name", "fix_tensor", "build_config",
           "permute_qk", "unpermute_qk"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}
_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "gemma3": 1000000.0}
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# ffn_norm is the norm before the MLP: llama/qwen2 call it post_attention_layernorm, gemma3 has
# both a post-attention norm (post_attention_norm) and a pre-feedforward one.
_ARCH_BLOCK_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm"},
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})  # recomputed by mlx-lm from the config


def check_architecture(arch: str) -> None:
    """Raise ModelLoadError unless `arch` (general.architecture) can be converted."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; mlx-lane converts {', '.join(SUPPORTED_ARCHITECTURES)}. "
            "Use an mlx-lm model directory (mlx_lm.convert --hf-path ...) for other architectures."
        )


def mlx_name(arch: str, gguf_name: str) -> str | None:
    """The mlx-lm parameter name for a GGUF tensor name; None for tensors mlx-lm does not need."""
    if gguf_name in SKIPPED_TENSORS:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        target = _ARCH_BLOCK_NAMES[arch].get(part) or _BLOCK_NAMES.get(part)
        if target is not None:
            return f"model.layers.{layer}.{target}.{kind}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(
        f"GGUF tensor {gguf_name!r} has no mlx-lm counterpart for architecture {arch!r}; "
        "this file is a variant mlx-lane cannot convert. Use an mlx-lm model directory instead."
    )


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K rows (HF rotary halves -> interleaved pairs), per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: back to the HF/mlx-lm row order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def fix_tensor(arch: str, gguf_name: str, w: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    """Undo llama.cpp's storage conventions for one dequantized tensor (numpy, HF layout)."""
    part = gguf_name.split(".")[-2]
    if arch == "llama" and part in ("attn_q", "attn_k"):
        heads = meta[f"{arch}.attention.head_count"]
        if part == "attn_k":
            heads = meta.get(f"{arch}.attention.head_count_kv", heads)
        return unpermute_qk(w, int(heads))
    if arch == "gemma3" and part.endswith("norm"):
        return w - np.float32(1.0)
    return w


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    """EOS ids: the file's eos and eot, plus the end-of-turn markers the vocabulary marks as control."""
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    tokens, types = meta.get("tokenizer.ggml.tokens", []), meta.get("tokenizer.ggml.token_type") or []
    for marker in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>"):
        try:
            i = tokens.index(marker)
        except ValueError:
            continue
        if i < len(types) and types[i] == 3:
            ids.append(i)
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out


def build_config(arch: str, meta: dict[str, Any], vocab_size: int, tied: bool) -> dict[str, Any]:
    """The config.json for mlx-lm (HF field names) from GGUF metadata."""
    get: Callable[[str, Any], Any] = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    cfg: dict[str, Any] = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": _MODEL_TYPE[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", _DEFAULT_ROPE_THETA[arch])),
        "tie_word_embeddings": bool(tied),
        "torch_dtype": "float32",
    }
    if get("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    eos = _eos_ids(meta)
    if eos:
        cfg["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    if arch == "gemma3":
        cfg.update(
            query_pre_attn_scalar=head_dim,
            sliding_window=int(get("attention.sliding_window", 512)),
            sliding_window_pattern=GEMMA3_SLIDING_WINDOW_PATTERN,
            rope_local_base_freq=GEMMA3_ROPE_LOCAL_BASE_FREQ,
        )
    return cfg
