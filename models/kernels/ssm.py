"""Mamba-2's one-token state update (nemotron_h, falcon_h1, granitemoehybrid, mamba2, plamo2) as a CUDA kernel.

mlx-lm's ``ssm_update`` runs a Metal kernel for a decode step and its chunked SSD form (``ssm_attn``, 256 tokens a
step: already matrix products) for prompts; off Metal a decode step goes through ``ssm_attn`` too, a dozen small
kernels for one token. ``step`` is mlx-lm's Metal kernel (``make_ssm_kernel``) ported to CUDA, the same arithmetic:
per head h and state row d, ``state = exp(A dt) state + dt x B``, ``y = state . C + D x``. Checked against
``ssm_attn`` on the device by ``bench/gpu_kernels.py``.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx

__all__ = ["step"]

# One warp per (row, head, state row d): lane l holds Ds/32 state elements. Grid (32, Dh, B*H), blocks (32, 8).
_STEP = r"""
  constexpr int NPT = Ds / 32;
  const int lane = threadIdx.x;
  const int d_idx = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z;
  if (d_idx >= Dh) {
    return;
  }
  const int h_idx = n % H;
  const int g_idx = n / G;
  const auto* x = X + (long)n * Dh;
  auto* y = out + (long)n * Dh;
  const auto* i_state = state_in + (long)n * Dh * Ds;
  auto* o_state = state_out + (long)n * Dh * Ds;
  const auto* C_ = C + (long)g_idx * Ds;
  const auto* B_ = B + (long)g_idx * Ds;

  const float dt_ = static_cast<float>(dt[n]);
  const float A = -expf(static_cast<float>(A_log[h_idx]));
  const float dA = expf(A * dt_);
  const float x_ = static_cast<float>(x[d_idx]);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < NPT; ++i) {
    const int s_idx = NPT * lane + i;
    const long idx = (long)d_idx * Ds + s_idx;
    const float state = dA * static_cast<float>(i_state[idx]) + x_ * dt_ * static_cast<float>(B_[s_idx]);
    o_state[idx] = static_cast<U>(state);
    acc += state * static_cast<float>(C_[s_idx]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    acc += __shfl_xor_sync(0xffffffff, acc, off);
  }
  if (lane == 0) {
    y[d_idx] = static_cast<T>(acc + x_ * static_cast<float>(D[h_idx]));
  }
"""

_kernel = None


def applies(state: mx.array) -> bool:
    """The kernel's shapes: a state dimension that is a multiple of 32."""
    return state.shape[-1] % 32 == 0 and state.shape[-1] <= 256


def step(hidden_states: mx.array, A_log: mx.array, B: mx.array, C: mx.array, D: mx.array, dt: mx.array,
         state: mx.array) -> Tuple[mx.array, mx.array]:
    """One token: hidden_states (n, 1, h, d), B/C (n, 1, groups, ds), dt (n, 1, h) already through mlx-lm's
    ``compute_dt``, state (n, h, d, ds). Returns y (n, 1, h, d) and the new state. CUDA only."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mlx_lane_ssm_step", input_names=["X", "A_log", "B", "C", "D", "dt",
                                                                              "state_in"],
                                      output_names=["out", "state_out"], source=_STEP)
    n, _, h, d = hidden_states.shape
    hb, ds = B.shape[-2:]
    return _kernel(
        inputs=[hidden_states, A_log, B, C, D, dt, state],
        template=[("T", hidden_states.dtype), ("U", state.dtype), ("Dh", d), ("Ds", ds), ("H", h), ("G", h // hb)],
        grid=(32, d, h * n), threadgroup=(32, 8, 1),
        output_shapes=[(n, 1, h, d), state.shape], output_dtypes=[hidden_states.dtype, state.dtype])
