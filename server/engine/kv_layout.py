"""The KV cache's layout as the engine sees it: the quantization scheme (issue 8), measured bytes per token, and how
many tokens a list of layer caches covers."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

# -- KV-cache quantization (issue 8) ----------------------------------------------------------------------------
# With kv_bits set, every plain KVCache layer is a QuantizedKVCache (mlx-lm) from the FIRST prompt token: prefill,
# decode, a RAM hit and an SSD restore all attend over the same quantized keys/values (each token's K/V is quantized
# on its own, along head_dim), so a cache hit computes what a cold request computes. Converting after prefill
# instead would give cold requests float attention over the prompt and hits quantized attention over the prefix.
# Other cache classes (RotatingKVCache, ArraysCache) stay as they are; mlx-lm cannot quantize them. The scheme is
# part of the namespace (`cache.prefix.namespace(..., kv_scheme=kv_scheme(bits, group))`), so an entry of one scheme
# never seeds another, in RAM or on SSD.


def kv_scheme(kv_bits: int | None, kv_group_size: int = 64) -> str:
    return "float" if kv_bits is None else f"q{kv_bits}g{kv_group_size}"


def state_nbytes(caches: list) -> int:
    """Bytes the caches hold for their tokens (KV buffers are allocated in steps of 256 tokens; the padding past
    `offset` on the token axis is not counted)."""
    from mlx.utils import tree_flatten

    total = 0
    for c in caches:
        n = getattr(c, "offset", None)
        for _, x in tree_flatten(c.state):
            if not isinstance(x, mx.array):
                continue
            if x.ndim == 4 and isinstance(n, int) and 0 < n < x.shape[2]:
                total += x.nbytes // x.shape[2] * n
            else:
                total += x.nbytes
    return total


def quantize_fresh(caches: list, bits: int, group_size: int) -> list:
    return [QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in caches]


def covered_length(caches: list) -> int | None:
    offsets = {getattr(c, "offset", None) for c in caches}
    offsets.discard(None)
    return offsets.pop() if len(offsets) == 1 else None
