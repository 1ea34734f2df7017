"""Rotation folding (QuaRot / SpinQuant style) for llama and qwen2 models, done offline on float weights.

The residual stream x (a row vector of width d) is replaced by x Q for an orthogonal d x d matrix Q. Outlier
channels of x are smeared over all channels, so per-group weight quantization loses less. The float model's outputs
do not change, because every matrix that touches the residual stream absorbs Q:

1. Fold the RMSNorm gains into the projections that read the normalised stream (`W <- W diag(g)`, `g <- 1`):
   input_layernorm -> q/k/v_proj, post_attention_layernorm -> gate/up_proj, the final norm -> lm_head. A norm
   with unit gain commutes with Q (rms(x Q) == rms(x)), which a norm with a per-channel gain does not.
2. Readers take x Q: `W <- W Q` for q/k/v_proj, gate/up_proj and lm_head.
3. Writers produce their output already rotated: `W <- Q^T W` (and `b <- b Q`) for o_proj and down_proj; the
   embedding table becomes `E <- E Q`.

Tied embeddings (SmolLM2 ties lm_head to embed_tokens) are untied: after folding the final norm's gain the head is
`(E diag(g)) Q` while the table is `E Q`, two different matrices. The output directory then has
`tie_word_embeddings: false` and an explicit `lm_head.weight` (vocab x d more parameters on disk; both are
quantized).

Rotation matrices (`rotation_matrix`):
- "hadamard": the normalised Sylvester Hadamard matrix H_d (entries +-1/sqrt(d)); d must be a power of two.
- "block": kron(H_p, R_m) for d = p * m, p the largest power of two dividing d and R_m a seeded random orthogonal
  m x m matrix (576 = 64 * 9 for SmolLM2). Still orthogonal, so still output-preserving; less uniform smearing than
  a full Hadamard when m is small relative to d.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = ["RotationError", "ROTATABLE", "KINDS", "hadamard", "rotation_matrix", "rotate_model"]

ROTATABLE = ("llama", "qwen2")
KINDS = ("hadamard", "block")


class RotationError(ValueError):
    """The model cannot be rotated as asked (architecture, width, or a layer we do not know how to fold)."""


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard(n: int) -> np.ndarray:
    """The normalised Sylvester Hadamard matrix of order n (a power of two), float64, orthogonal."""
    if not _is_pow2(n):
        raise RotationError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotation_matrix(d: int, kind: str = "hadamard", *, seed: int = 0) -> np.ndarray:
    """An orthogonal d x d matrix (float64) of the given kind; see the module doc."""
    if kind == "hadamard":
        if not _is_pow2(d):
            p = d & -d
            raise RotationError(
                f"hidden size {d} is not a power of two, so no pure Hadamard rotation exists for it; "
                f"use the block rotation instead (--rotation block: kron(H_{p}, a random orthogonal "
                f"{d // p}x{d // p}))"
            )
        return hadamard(d)
    if kind == "block":
        p = d & -d  # largest power of two dividing d
        m = d // p
        if m == 1:
            return hadamard(d)
        q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((m, m)))
        q = q * np.sign(np.diag(r))  # Haar-distributed
        return np.kron(hadamard(p), q)
    raise RotationError(f"unknown rotation kind {kind!r}; use one of {', '.join(KINDS)}")


def _f64(w: mx.array) -> np.ndarray:
    return np.array(w.astype(mx.float32), dtype=np.float64)


def _back(x: np.ndarray, dtype) -> mx.array:
    return mx.array(x.astype(np.float32)).astype(dtype)


def _check_linear(name: str, m: Any) -> None:
    if not isinstance(m, nn.Linear) or isinstance(m, nn.QuantizedLinear):
        raise RotationError(f"{name} is {type(m).__name__}, not a float Linear; rotate before quantizing")


def rotate_model(model: nn.Module, config: dict, *, kind: str = "hadamard", seed: int = 0) -> dict:
    """Fold norms and a rotation into `model` in place; return the updated config (a new dict).

    Raises RotationError for an architecture other than llama/qwen2, a width the rotation kind cannot handle, or an
    already quantized model. The returned config has `tie_word_embeddings: false`.
    """
    arch = config.get("model_type")
    if arch not in ROTATABLE:
        raise RotationError(f"rotation supports {', '.join(ROTATABLE)} models, not {arch!r}")
    inner = model.model
    d = int(config["hidden_size"])
    q = rotation_matrix(d, kind, seed=seed)
    embed = inner.embed_tokens
    if not isinstance(embed, nn.Embedding) or isinstance(embed, nn.QuantizedEmbedding):
        raise RotationError("embed_tokens is not a float Embedding; rotate before quantizing")
    dtype = embed.weight.dtype
    e = _f64(embed.weight)

    # lm_head: untie, fold the final norm, rotate.
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        head = e.copy()
        model.lm_head = nn.Linear(d, e.shape[0], bias=False)
        model.args.tie_word_embeddings = False
    else:
        _check_linear("lm_head", model.lm_head)
        head = _f64(model.lm_head.weight)
    g = _f64(inner.norm.weight)
    model.lm_head.weight = _back((head * g[None, :]) @ q, dtype)
    inner.norm.weight = mx.ones_like(inner.norm.weight)
    embed.weight = _back(e @ q, dtype)

    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for norm, readers, writer, wname in (
            (layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj), attn.o_proj, "o_proj"),
            (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj), mlp.down_proj, "down_proj"),
        ):
            g = _f64(norm.weight)
            for r in readers:
                _check_linear(f"layers.{i} reader", r)
                r.weight = _back((_f64(r.weight) * g[None, :]) @ q, dtype)  # biases are on the output side
            norm.weight = mx.ones_like(norm.weight)
            _check_linear(f"layers.{i}.{wname}", writer)
            writer.weight = _back(q.T @ _f64(writer.weight), dtype)
            if "bias" in writer:
                writer.bias = _back(_f64(writer.bias) @ q, dtype)
    mx.eval(model.parameters())
    out = dict(config)
    out["tie_word_embeddings"] = False
    return out
