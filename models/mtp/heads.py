"""A checkpoint's multi-token-prediction heads behind one small shape: ``MtpHead``.

An MTP module (DeepSeek-V3, GLM-4.7-Flash, Qwen3.5 / Qwen3-Next, Nemotron-H) takes, at each position, the embedding of
a token and the target's hidden state at the position before it, mixes them (two norms, a projection of their
concatenation), runs one or a few transformer layers of its own (with a KV cache of its own), normalises, and reads
the target's output head: the logits of the token after. Fed its own output as the next "hidden state", it drafts
several tokens ahead. Each family names its parts differently; ``MtpHead`` is what the draft source
(spec.mtp) needs of any of them:

    head.make_caches()                          # one mlx-lm KVCache per attention layer of the module
    out = head.forward(tokens, hidden, caches, mask)   # (B, L) tokens, (B, L, H) hiddens -> (B, L, H) normed output
    logits = head.logits(out)                   # the target's own output head (shared weights)

``mask`` is the attention mask over the layers' cache columns (the source builds it: see spec.mtp). The layers are
the families' own classes: mlx-vlm's drafters for Qwen3.5 and Nemotron-H (``Qwen3_5MTPDraftModel``,
``NemotronHMTPDraftModel``, wrapped as they come), mlx-lm's decoder layer of the target's own module for the
DeepSeek-style module (``DeepseekStyleMtp``: mlx-vlm 0.7.10 has no drafter class for it). Embeddings and the output
head are always the target's: DeepSeek checkpoints ship copies of both in the MTP layer, identical and large.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

__all__ = ["MtpHead", "DeepseekStyleMtp", "target_embed_and_head", "SHAPES", "QWEN", "NEMOTRON", "DEEPSEEK"]

QWEN, NEMOTRON, DEEPSEEK = "qwen", "nemotron", "deepseek"  # the module shapes below


def target_embed_and_head(model) -> tuple[Any, Any]:
    """The target's token embedding and output head (a tied model's embedding as a linear map)."""
    inner = getattr(model, "model", None) or getattr(model, "backbone", None)
    embed = getattr(inner, "embed_tokens", None) or getattr(inner, "embeddings", None)
    if embed is None:
        raise ValueError(f"{type(model).__name__} has no token embedding an MTP head could share")
    lm = getattr(model, "language_model", model)
    head = getattr(lm, "lm_head", None) or getattr(model, "lm_head", None) or embed.as_linear
    return embed, head


@dataclass(frozen=True, eq=False)
class MtpHead:
    """One checkpoint's MTP module, bound to its target (see the module docstring). ``module`` holds the weights;
    ``family`` says which of the shapes below computes it; ``layers`` its KV caches; ``params`` its own parameter
    count (the target's shared embedding and head excluded: what a draft step costs beyond them)."""

    family: str
    module: Any
    embed: Any
    head: Any
    layers: int
    hidden_size: int
    embed_scale: float = 1.0

    @property
    def params(self) -> int:
        leaves: Any = tree_flatten(self.module.parameters())
        return sum(v.size for _, v in leaves)

    def make_caches(self) -> list:
        return [KVCache() for _ in range(self.layers)]

    def forward(self, tokens: mx.array, hidden: mx.array, caches: list, mask: Optional[mx.array]) -> mx.array:
        e = self.embed(tokens)
        if self.embed_scale != 1.0:
            e = e * self.embed_scale
        return SHAPES[self.family](self.module, e, hidden.astype(e.dtype), caches, mask)

    def logits(self, out: mx.array) -> mx.array:
        return self.head(out)


def _qwen(d, e, hidden, caches, mask):
    """mlx-vlm's ``Qwen3_5MTPDraftModel._forward_hidden`` with the source's mask (positions from the caches'
    offsets)."""
    h = d.fc(mx.concatenate([d.pre_fc_norm_embedding(e), d.pre_fc_norm_hidden(hidden)], axis=-1))
    for layer, c in zip(d.layers, caches):
        h = layer(h, mask=mask, cache=c, position_ids=None)
    return d.norm(h)


def _nemotron(d, e, hidden, caches, mask):
    """mlx-vlm's ``NemotronHMTPDraftModel._forward_hidden`` with the source's mask: attention blocks read a cache each,
    MoE blocks none."""
    first, last = d.layers[0], d.layers[-1]
    h = first.eh_proj(mx.concatenate([first.enorm(e), first.hnorm(hidden)], axis=-1))
    i = 0
    for layer in d.layers:
        c = None
        if layer.block_type == "*":
            c, i = caches[i], i + 1
        h = layer(h, mask=mask, cache=c)
    return last.final_layernorm(h)


class DeepseekStyleMtp(nn.Module):
    """DeepSeek-V3's MTP module (also GLM-4.7-Flash's): ``enorm`` / ``hnorm`` / ``eh_proj``, one decoder layer of the
    target's own class (``block``), ``shared_head.norm`` as ``norm``. Checkpoint names: ``model.layers.<N>.*``, N the
    target's layer count (models.mtp.load)."""

    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


def _deepseek(d, e, hidden, caches, mask):
    h = d.eh_proj(mx.concatenate([d.enorm(e), d.hnorm(hidden)], axis=-1))
    h = d.block(h, mask, caches[0])
    return d.norm(h)


SHAPES = {QWEN: _qwen, NEMOTRON: _nemotron, DEEPSEEK: _deepseek}
