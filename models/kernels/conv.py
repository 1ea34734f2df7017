"""The short depthwise convolution of hybrids (gated delta-nets, Mamba, Mamba-2, LFM2...) as one CUDA kernel.

Every linear-attention or SSM layer of these models runs an ``nn.Conv1d`` with ``groups`` equal to its channels (a
few thousand) and a kernel of 3-4 taps over its inputs before the recurrence. mlx 0.32's CUDA backend sends every
convolution to cuDNN, whose execution plan it builds per exact input shape (``backend/cuda/conv``: an LRU cache keyed
by the shapes): a decode batch whose row count changes, and every prompt chunk of a new length, pays a plan first.
``depthwise`` is the same arithmetic as one launch that reads its shapes at run time, so no shape is ever new to it:
each thread computes one (row, position, channel) output as the sum over the taps of input times weight, in float32,
rounded once to the input's dtype.

On the CPU, ``mx.conv1d`` with one channel a group is a loop 4-6x slower than the same sum written as K shifted
products (``shifted``: 8 rows x 333 tokens of 6,144 channels 174 vs 637 ms on this CPU, bench/cpu_conv.py), and
those are the same float32 sums (the same products added in the same order: bit-identical with the wheel's own
BLAS; OpenBLAS, which the server preloads, fuses the multiply-adds of ``mx.conv1d``'s gemm, a few ulps apart), so
there float32 calls take that form.

``applies(conv, x)`` says whether a module's call is such a convolution (stride 1, no padding or dilation, one
channel a group, the input's dtype); ``DepthwiseConv1d`` is mlx's ``Conv1d`` that takes the kernel where it applies
(``ENABLED``: a CUDA device), the shifted products where ``OPS`` (the CPU) and the input is float32, else mlx's own
call; ``models.kernels.install`` switches the class of a model's depthwise convolutions and sets the flag of its
device. Checked against ``mx.conv1d`` on the device by ``bench/gpu_hybrid_parts.py`` (bit-identical on every checked
shape, float32 and bf16) and on the CPU by ``tests/unit/test_kernels.py``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["DepthwiseConv1d", "applies", "depthwise", "is_depthwise", "shifted", "switch", "ENABLED", "OPS"]

# set by models.kernels.install: ENABLED on a CUDA device (the kernel cannot run elsewhere), OPS on the CPU
ENABLED = False
OPS = False

# One thread per (channel c, output position t, row b); grid (C, L - K + 1, B) in threads. The weight is mlx's
# Conv1d layout (C, K, 1): tap k of channel c at c * K + k.
_DEPTHWISE = r"""
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int t = blockIdx.y;
  const int b = blockIdx.z;
  const int L = x_shape[1];
  const int C = x_shape[2];
  if (c >= C) {
    return;
  }
  const InT* x_ = x + ((long)b * L + t) * C + c;
  const InT* w_ = w + (long)c * K;
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    acc += static_cast<float>(x_[(long)k * C]) * static_cast<float>(w_[k]);
  }
  out[((long)b * (L - K + 1) + t) * C + c] = static_cast<InT>(acc);
"""

_kernel: Any = None
_MAX_GRID = 65535  # a CUDA grid's y and z extent: positions and rows a launch covers


def is_depthwise(conv) -> bool:
    """A Conv1d with one input channel a group (what every hybrid's short convolution is)."""
    w = getattr(conv, "weight", None)
    return (isinstance(conv, nn.Conv1d) and w is not None and w.ndim == 3 and w.shape[2] == 1
            and conv.groups == w.shape[0])


def applies(conv, x: mx.array) -> bool:
    """Does ``depthwise`` compute this module's call on ``x`` exactly as ``mx.conv1d`` would?"""
    return (ENABLED and _plain(conv, x) and x.shape[1] - conv.weight.shape[1] < _MAX_GRID
            and x.shape[0] <= _MAX_GRID and x.dtype == conv.weight.dtype
            and x.dtype in (mx.float32, mx.bfloat16, mx.float16))


def _plain(conv, x: mx.array) -> bool:
    return (is_depthwise(conv) and conv.stride == 1 and conv.padding == 0 and conv.dilation == 1 and x.ndim == 3
            and x.shape[2] == conv.weight.shape[0] and x.shape[1] >= conv.weight.shape[1])


def shifted(x: mx.array, weight: mx.array) -> mx.array:
    """``mx.conv1d(x, weight, groups=C)`` as the sum over the K taps of x shifted by the tap times its weight, in
    the order the convolution adds them. x (B, L, C), weight (C, K, 1)."""
    L, K = x.shape[1], weight.shape[1]
    taps = weight[:, :, 0].T  # (K, C)
    out = x[:, 0: L - K + 1] * taps[0]
    for k in range(1, K):
        out = out + x[:, k: L - K + 1 + k] * taps[k]
    return out


def depthwise(x: mx.array, weight: mx.array) -> mx.array:
    """x (B, L, C), weight (C, K, 1) of x's dtype -> (B, L - K + 1, C): ``mx.conv1d(x, weight, groups=C)``. CUDA
    only."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mlx_lane_depthwise_conv1d", input_names=["x", "w"],
                                      output_names=["out"], source=_DEPTHWISE)
    B, L, C = x.shape
    K = weight.shape[1]
    block = 256
    while C % block:  # a block size that divides the channels: no launch covers a partial block
        block //= 2
    return _kernel(inputs=[x, weight], template=[("InT", x.dtype), ("K", K)],
                   grid=(C, L - K + 1, B), threadgroup=(block, 1, 1),
                   output_shapes=[(B, L - K + 1, C)], output_dtypes=[x.dtype])[0]


class DepthwiseConv1d(nn.Conv1d):
    """mlx's Conv1d (the same parameters) that computes with ``depthwise`` or ``shifted`` where they apply."""

    def __call__(self, x: mx.array) -> mx.array:
        if applies(self, x):
            y = depthwise(x, self.weight)
        elif OPS and _plain(self, x) and x.dtype == mx.float32 and self.weight.dtype == mx.float32:
            y = shifted(x, self.weight)
        else:
            return super().__call__(x)
        if "bias" in self:
            y = y + self.bias
        return y


def switch(model) -> int:
    """Give ``model``'s depthwise ``nn.Conv1d`` modules the class ``DepthwiseConv1d`` (same layout, the weights stay
    where they are); returns how many."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return 0
    switched = 0
    for m in modules():
        if type(m) is nn.Conv1d and is_depthwise(m):
            m.__class__ = DepthwiseConv1d
            switched += 1
    return switched
