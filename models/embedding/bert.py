"""A BERT encoder in MLX (the sentence-transformers family: all-MiniLM-L6-v2 and its kin), weights as
transformers' ``BertModel`` names them.

Why our own ~80 lines and not the ``mlx-embeddings`` package: its 0.1.0 imports ``mlx_vlm`` at package import,
and mlx-vlm pulls mlx-audio, opencv-python, datasets and a web stack into a text server's runtime. A BERT encoder
is small, and the test suite checks it against transformers + torch (tests/integration/test_embeddings_live.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

__all__ = ["BertConfig", "BertEncoder"]


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_dict(cls, d: dict) -> "BertConfig":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        pos = mx.arange(ids.shape[1])[None]
        x = self.word_embeddings(ids) + self.position_embeddings(pos) + self.token_type_embeddings(mx.zeros_like(ids))
        return self.LayerNorm(x)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out, self.attn_norm = nn.Linear(h, h), nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.intermediate, self.output = nn.Linear(h, c.intermediate_size), nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.act = nn.gelu if c.hidden_act == "gelu" else nn.gelu_approx

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, h = x.shape
        d = h // self.heads

        def split(t):
            return t.reshape(b, n, self.heads, d).transpose(0, 2, 1, 3)

        a = mx.fast.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)),
                                                 scale=d ** -0.5, mask=mask)
        x = self.attn_norm(x + self.attn_out(a.transpose(0, 2, 1, 3).reshape(b, n, h)))
        return self.out_norm(x + self.output(self.act(self.intermediate(x))))


class BertEncoder(nn.Module):
    """``(ids [B, N] int32, attention_mask [B, N] 0/1) -> last hidden states [B, N, H]``."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.embeddings = _Embeddings(c)
        self.layers = [_Layer(c) for _ in range(c.num_hidden_layers)]

    def __call__(self, ids: mx.array, attention_mask: mx.array) -> mx.array:
        x = self.embeddings(ids)
        # padded keys get -inf-ish scores; every query row keeps at least its [CLS] key
        mask = ((1.0 - attention_mask.astype(x.dtype)) * -1e9)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """transformers' BertModel names -> ours (pooler and position_ids dropped: sentence-transformers does not
        use the pooler, positions are computed)."""
        out = {}
        for k, v in weights.items():
            if k.startswith("bert."):
                k = k[5:]
            if k.startswith("pooler.") or k.endswith("position_ids"):
                continue
            k = (k.replace("encoder.layer.", "layers.").replace("attention.self.", "")
                 .replace("attention.output.dense", "attn_out").replace("attention.output.LayerNorm", "attn_norm")
                 .replace("intermediate.dense", "intermediate").replace("output.dense", "output")
                 .replace("output.LayerNorm", "out_norm"))
            out[k] = v
        return out
