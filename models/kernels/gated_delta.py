"""The gated delta rule (Qwen3.5, Qwen3-Next, Kimi Linear, OLMo hybrid...) off Metal: a CUDA kernel and a chunked
form in plain MLX ops, both computing what mlx-lm's ``gated_delta_ops`` computes.

The rule, per head, with a state S (Dv x Dk) and per token a key k, value v, query q, decay g (a scalar, or one per
key dimension) and a write strength beta::

    S <- S * g;   u = beta * (v - S k);   S <- S + u k^T;   y = S q

mlx-lm has this as a Metal kernel only; elsewhere it steps through a prompt token by token in Python (a chain of
small kernels per token and layer: ~324 prompt tokens/s for a 9B hybrid on an H200). Here:

``recurrent``  one CUDA kernel for any number of tokens (decode, a verify step, a whole prompt): each warp owns one
               value row of one head's state in registers and walks the tokens; the next token's inputs are loaded
               while this one is computed. Scalar and vector gates, an optional padding mask. A port of mlx-lm's
               Metal kernel (``_make_gated_delta_kernel``), the same arithmetic in the same order.
``chunked``    the chunkwise (WY) form of flash-linear-attention for scalar gates: a chunk of C tokens is a few
               matrix products (its in-chunk dependencies are one unit lower-triangular solve, done by a stable
               recursive block inverse, not a Neumann series), and only the state crosses from chunk to chunk. Plain
               MLX ops: it runs on the CPU (where it wins for prompts of more than a few tokens) and on CUDA.

Both are checked against ``gated_delta_ops`` on random inputs (tests/unit/test_kernels.py on the CPU for
``chunked``; ``bench/gpu_kernels.py`` on the device for ``recurrent``). Masked positions leave the state untouched
(``chunked`` turns them into g = 1, beta = 0, which is exactly that); what a masked position outputs is padding.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

__all__ = ["recurrent", "chunked", "CHUNK"]

CHUNK = 64  # tokens per chunk of the chunked form: its products are C x C and C x D

# One warp per (row b, value head, value row dv); lane l holds state elements [l*NPT, (l+1)*NPT) of that row (Dk/32
# each), as the Metal kernel does. Grid (32, Dv, B*Hv), blocks of (32, 4): four value rows a block. ON_TOKEN is the
# mask's read, or true.
_RECURRENT = r"""
  constexpr int NPT = Dk / 32;
  const int lane = threadIdx.x;
  const int dv = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z;
  const int b = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int T = k_shape[1];
  if (dv >= Dv) {
    return;
  }

  const InT* q_ = q + ((long)b * T * Hk + hk) * Dk + lane * NPT;
  const InT* k_ = k + ((long)b * T * Hk + hk) * Dk + lane * NPT;
  const InT* v_ = v + ((long)b * T * Hv + hv) * Dv + dv;
  InT* y_ = y + ((long)b * T * Hv + hv) * Dv + dv;
  const auto* g_ = VEC ? g + ((long)b * T * Hv + hv) * Dk + lane * NPT : g + (long)b * T * Hv + hv;
  const auto* beta_ = beta + (long)b * T * Hv + hv;
  const StT* i_state = state_in + ((long)n * Dv + dv) * Dk + lane * NPT;
  StT* o_state = state_out + ((long)n * Dv + dv) * Dk + lane * NPT;

  float state[NPT];
#pragma unroll
  for (int i = 0; i < NPT; ++i) {
    state[i] = static_cast<float>(i_state[i]);
  }

  // the inputs of token t, loaded one token ahead so their latency hides behind the arithmetic of the one before
  float kk[NPT], qq[NPT], gg[VEC ? NPT : 1];
  float vv = 0.f, bb = 0.f;
  bool on = true;
  auto load = [&](int t) {
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
      kk[i] = static_cast<float>(k_[(long)t * Hk * Dk + i]);
      qq[i] = static_cast<float>(q_[(long)t * Hk * Dk + i]);
    }
    if (VEC) {
#pragma unroll
      for (int i = 0; i < NPT; ++i) {
        gg[i] = static_cast<float>(g_[(long)t * Hv * Dk + i]);
      }
    } else {
      gg[0] = static_cast<float>(g_[(long)t * Hv]);
    }
    vv = static_cast<float>(v_[(long)t * Hv * Dv]);
    bb = static_cast<float>(beta_[(long)t * Hv]);
    on = ON_TOKEN;
  };
  if (T > 0) {
    load(0);
  }
  for (int t = 0; t < T; ++t) {
    float ck[NPT], cq[NPT], cg[VEC ? NPT : 1];
#pragma unroll
    for (int i = 0; i < NPT; ++i) {
      ck[i] = kk[i];
      cq[i] = qq[i];
    }
#pragma unroll
    for (int i = 0; i < (VEC ? NPT : 1); ++i) {
      cg[i] = gg[i];
    }
    const float cv = vv, cb = bb;
    const bool con = on;
    if (t + 1 < T) {
      load(t + 1);
    }
    if (con) {
      float kv_mem = 0.f;
#pragma unroll
      for (int i = 0; i < NPT; ++i) {
        state[i] = state[i] * cg[VEC ? i : 0];
        kv_mem += state[i] * ck[i];
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, off);
      }
      const float delta = (cv - kv_mem) * cb;
      float out = 0.f;
#pragma unroll
      for (int i = 0; i < NPT; ++i) {
        state[i] = state[i] + ck[i] * delta;
        out += state[i] * cq[i];
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        out += __shfl_xor_sync(0xffffffff, out, off);
      }
      if (lane == 0) {
        y_[(long)t * Hv * Dv] = static_cast<InT>(out);
      }
    } else if (lane == 0) {
      y_[(long)t * Hv * Dv] = static_cast<InT>(0.f);
    }
    STORE_STATE
  }
#pragma unroll
  for (int i = 0; i < NPT; ++i) {
    o_state[i] = static_cast<StT>(state[i]);
  }
"""

# with ``every_state``: the state after token t goes to states[b, t, hv, dv, lane*NPT ...] (what a verify forward's
# rejected drafts are taken back to: models.kernels.positions)
_STORE_STATE = r"""
    {
      StT* s_ = states + ((((long)b * T + t) * Hv + hv) * Dv + dv) * Dk + lane * NPT;
#pragma unroll
      for (int i = 0; i < NPT; ++i) {
        s_[i] = static_cast<StT>(state[i]);
      }
    }
"""

_kernels: dict = {}


def _recurrent_kernel(masked: bool, every_state: bool = False):
    key = (masked, every_state)
    if key not in _kernels:
        names = ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if masked else [])
        source = _RECURRENT.replace("ON_TOKEN", "static_cast<bool>(mask[(long)b * T + t])" if masked else "true")
        _kernels[key] = mx.fast.cuda_kernel(
            name="mlx_lane_gated_delta" + ("_masked" if masked else "") + ("_states" if every_state else ""),
            input_names=names, output_names=["y", "state_out"] + (["states"] if every_state else []),
            source=source.replace("STORE_STATE", _STORE_STATE if every_state else ""))
    return _kernels[key]


def recurrent_applies(k: mx.array) -> bool:
    """The CUDA kernel's shapes: key heads of a multiple of 32 (each lane holds Dk/32 of a row)."""
    return k.shape[-1] % 32 == 0 and k.shape[-1] <= 256


def recurrent(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
              mask: Optional[mx.array] = None, every_state: bool = False) -> tuple[mx.array, ...]:
    """The gated delta rule over all of ``q``'s tokens in one CUDA kernel (call it only on a CUDA device).

    q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv); g: (B, T, Hv) or (B, T, Hv, Dk); beta: (B, T, Hv); state: (B, Hv, Dv,
    Dk); mask: (B, T) bool or None. Returns y (B, T, Hv, Dv) in q's dtype and the new state in state's dtype; with
    ``every_state`` also the state after each token, (B, T, Hv, Dv, Dk) (what ``states[:, -1]`` is, the new state
    is)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    inputs = [q, k, v, g, beta, state]
    if mask is not None:
        inputs.append(mask.astype(mx.bool_))
    shapes, dtypes = [(B, T, Hv, Dv), state.shape], [q.dtype, state.dtype]
    if every_state:
        shapes.append((B, T, *state.shape[1:]))
        dtypes.append(state.dtype)
    return tuple(_recurrent_kernel(mask is not None, every_state)(
        inputs=inputs,
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk),
                  ("Hv", Hv), ("VEC", g.ndim == 4)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=shapes, output_dtypes=dtypes))


def _unit_lower_inverse(m: mx.array) -> mx.array:
    """The inverse of unit lower-triangular matrices ``m`` (..., C, C), C a power of two, by recursive block
    inversion: [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]], from 1x1 blocks up, every block of a level in
    one product. Stable where the Neumann series (I - N + N^2 ...) is not: correlated keys make N's powers huge."""
    C = m.shape[-1]
    lead = m.shape[:-2]
    inv = mx.ones((*lead, C, 1, 1), dtype=m.dtype)  # the 1x1 diagonal blocks of a unit triangle
    s = 1
    while s < C:
        nb = C // (2 * s)
        # the diagonal blocks of size 2s of m: (..., nb, 2s, 2s)
        blocks = mx.diagonal(m.reshape(*lead, nb, 2 * s, nb, 2 * s), axis1=-4, axis2=-2)  # (..., 2s, 2s, nb)
        blocks = mx.moveaxis(blocks, -1, -3)
        lower = blocks[..., s:, :s]
        a_inv = inv[..., 0::2, :, :]
        d_inv = inv[..., 1::2, :, :]
        off = -(d_inv @ lower @ a_inv)
        zeros = mx.zeros_like(off)
        top = mx.concatenate([a_inv, zeros], axis=-1)
        bottom = mx.concatenate([off, d_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv.reshape(*lead, C, C)


def chunked(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: Optional[mx.array] = None,
            mask: Optional[mx.array] = None, chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a prompt, chunk by chunk (scalar gates only: g of shape (B, T, Hv)).

    Shapes as ``recurrent``. Within a chunk (positions t, i; gamma_t = the product of the chunk's gates up to t):

        U = (I + A)^-1 diag(beta) (V - diag(gamma) K S0^T),  A[t, i] = beta_t (gamma_t / gamma_i) k_t.k_i, i < t
        Y = diag(gamma) Q S0^T + (Q K^T * gamma_t / gamma_i, i <= t) U
        S = gamma_C S0 + U^T diag(gamma_C / gamma) K

    Everything but S0 is computed for all chunks at once; the loop over chunks carries only the state. float32
    throughout; y in q's dtype, the state float32."""
    if g.ndim != 3:
        raise ValueError("chunked: scalar gates only (g of shape (B, T, Hv)); vector gates take recurrent")
    if chunk & (chunk - 1):
        raise ValueError(f"chunked: the chunk ({chunk}) must be a power of two")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    f32 = mx.float32
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=f32)
    if (rep := Hv // Hk) > 1:
        q = mx.repeat(q, rep, -2)
        k = mx.repeat(k, rep, -2)
    # (B, H, T, D) and (B, H, T)
    q, k, v = (x.astype(f32).transpose(0, 2, 1, 3) for x in (q, k, v))
    # log(0) = -inf would meet 0 in the sums below (NaN); exp(-200) is 0 in float32 as g = 0 is
    log_g = mx.maximum(mx.log(g.astype(f32)), -200.0).transpose(0, 2, 1)
    beta = beta.astype(f32).transpose(0, 2, 1)
    if mask is not None:
        on = mask[:, None, :]
        log_g = mx.where(on, log_g, 0.0)
        beta = mx.where(on, beta, 0.0)
    # the tail padded to whole chunks: g = 1, beta = 0, zero keys leave the state as it is
    pad = -T % chunk
    if pad:
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        log_g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (log_g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, Hv, n, chunk, -1) for x in (q, k, v))
    log_g, beta = (x.reshape(B, Hv, n, chunk) for x in (log_g, beta))

    pos = mx.arange(chunk)
    incl = pos[:, None] >= pos[None, :]
    # gamma_t / gamma_i for i <= t as exp(the sum of log g over (i, t]), summed term by term: a difference of two
    # running sums loses the digits that matter once the sums are large (fast-decaying heads); 0 above the diagonal
    terms = mx.where(pos[:, None] > pos[None, :], log_g[..., :, None], 0.0)  # [j, i]: log g_j where j > i
    ratio = mx.where(incl, mx.exp(mx.cumsum(terms, axis=-2)), 0.0)
    kk = k @ k.swapaxes(-1, -2)
    a = mx.where(pos[:, None] > pos[None, :], beta[..., :, None] * kk * ratio, 0.0)
    t_inv = _unit_lower_inverse(a + mx.eye(chunk, dtype=f32))
    gamma = mx.exp(mx.cumsum(log_g, axis=-1))  # gamma_t: the chunk's gates up to t
    w = t_inv @ ((beta * gamma)[..., None] * k)  # (B, H, n, C, Dk)
    u0 = t_inv @ (beta[..., None] * v)  # (B, H, n, C, Dv)
    attn = (q @ k.swapaxes(-1, -2)) * ratio  # (B, H, n, C, C)
    qg = q * gamma[..., None]
    kd = k * ratio[..., -1, :, None]  # decay from each position to the chunk's end
    g_last = gamma[..., -1][..., None, None]  # (B, H, n, 1, 1)

    s = state.astype(f32)
    ys = []
    for c in range(n):
        st = s.swapaxes(-1, -2)  # (B, H, Dk, Dv)
        u = u0[:, :, c] - w[:, :, c] @ st
        ys.append(qg[:, :, c] @ st + attn[:, :, c] @ u)
        s = g_last[:, :, c] * s + u.swapaxes(-1, -2) @ kd[:, :, c]
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return y.transpose(0, 2, 1, 3).astype(out_dtype), s

