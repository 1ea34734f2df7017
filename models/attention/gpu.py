"""Attention of a decode batch on an NVIDIA GPU: one fused kernel over rows of different lengths, no mask.

(About 565 lines, one job: the kernel's two CUDA sources are ~200 of them, kept beside the Python that launches them,
their reference and the rules of where they apply; the composed path for verify steps is its own module, composed.py,
the segments of a RAM hit are read by shared_prefix.py's function, and the buckets for cuDNN are buckets.py.)

A decode batch holds rows of different lengths in one KV buffer: mlx-lm's ``BatchKVCache`` left-pads them to a
common end, our ``RaggedKV`` left-aligns them and masks what lies past each row's end. Either way the model passes
``mx.fast.scaled_dot_product_attention`` an *array* mask, and MLX's CUDA backend has no fused kernel for that at
decode time (``supports_sdpa_vector`` and the cuDNN decode path both refuse array masks: mlx 0.32,
``backend/cuda/scaled_dot_product_attention.cpp``), so every layer of every batched step runs the unfused fallback
(scores, a masked softmax, a second matmul, each a kernel over the whole batch's KV).

Here a batched decode (or verify) step of up to ``MAX_WIDTH`` queries per row runs one split-K ("flash decoding")
kernel instead: each block takes one row, one KV head, a slice of ``SPLIT`` key positions and up to four of that KV
head's queries (its query heads x the step's width), reads each key and value once for all of them, and keeps an
online softmax in float32; a second small kernel merges the slices. Which columns a query sees comes from the cache,
not from a mask: row b's query i sees columns ``start[b] .. last[b] + i`` (``row_ranges``), exactly what the mask
the model built says (``tests/unit/test_gpu_attention.py`` holds both layouts' ranges against their masks); a
sliding-window layer of the ragged batch (``attention_window``) narrows that to the last ``window`` columns (no
slice below the first query's window is read), and gpt-oss's attention sinks (one more logit per head, no value) enter
the merge's softmax.

``install(model)`` swaps the attention function in the model's modules (as ``models.attention.cpu`` does on the
CPU) for one that takes this path only where it applies (a CUDA device, 16-bit q/k/v, head size 64, 128 or 256, grouped
or plain heads, a batch cache whose ranges are known, a step of at most ``MAX_WIDTH`` tokens) and hands everything
else to mlx-lm's own: long prefill chunks (cuDNN takes those), single sequences (MLX's own vector kernel), quantized
KV, mlx-lm's rotating batch caches. A step of a few queries past more cached keys than queries (a single sequence's
verify step) runs ``composed.composed_attention`` instead of cuDNN (``composed.applies``): cuDNN plans every new
shape, and those steps' shapes are all new. With `--debug-gpu-attention-prefill-max N` a prompt chunk of
``MAX_WIDTH`` + 1 .. N tokens a row runs the same kernel too, its width read at run time (``prefill_ranges``: a single
sequence's, or rows prefilled together; off by default). A step whose mask is an additive array never takes the
kernel (``scores_in_mask``: multi-head latent attention, DeepSeek-V3 / GLM-4.7-Flash, passes its rotary scores as
the mask, which the kernel's ranges would drop); composed adds such a mask as MLX does. `--attention mlx`
(``configure(on=False)``) leaves mlx-lm's path in place (to compare).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from models.attention import buckets, composed
from models.attention.shared_prefix import SharedPrefixKVCache, segmented_attention
from models.hook import switch
from models.mlx_compat import batch_index, right_padding

__all__ = ["install", "row_ranges", "ranged_attention", "reference_attention", "MAX_WIDTH", "SPLIT"]

MAX_WIDTH = 8  # queries per row the kernel takes (a decode step: 1; a verify step: 1 + drafts)
# A prompt chunk of MAX_WIDTH + 1 .. PREFILL_MAX queries a row through the kernel too, its width a runtime
# value (``_RUNTIME_WIDTH``: one compiled kernel for every chunk length), instead of cuDNN, which builds an execution
# plan for each new (queries, keys) shape: ~80 ms a forward on the H100 (gpt-oss-20b agents, BENCHMARKS.md
# 2026-12-07), and nearly every forward of an agent's turn is a new shape. 0: never (the default, until measured:
# `--debug-gpu-attention-prefill-max`, bench/gpu_prefill_after_hit.py --lane-prefill-max)
PREFILL_MAX = 0
PREFILL_PARTIALS_MAX = 1 << 29  # bytes of float32 partial results one call may write (past that: cuDNN)
# Query-key pairs (rows x queries x keys) one call may take: the kernel takes 4 queries a block on CUDA cores, so its
# cost grows with chunk x context, where cuDNN's, once planned, grows far slower. Measured on the H100 (gpt-oss-20b
# after a 5k hit, BENCHMARKS.md 2026-12-07, thirteenth session): ~17 ns more a pair than a planned cuDNN call over
# the model's layers, so past ~4M pairs it costs more than a new shape's plan (~70 ms); at 330 x 5,330 (1.8M) it was
# 75 vs 117 ms, at 1,024 x 6,024 (6.2M) 196 vs 162. Past this: cuDNN.
PREFILL_PAIRS_MAX = 3_000_000
# Tuning knobs for A/B runs (bench/gpu_attention.py, bench/gpu_agents.py): `mlx-lane serve --debug-gpu-attention-split`
# / `--debug-gpu-attention-unroll`, set through ``configure`` before a model is loaded
SPLIT = 256  # key positions per block of the first pass
UNROLL = 4  # key groups a warp loads per round (1: the first version's one at a time)
_ON = True  # --attention mlx: MLX's own attention everywhere
_QUERIES_PER_BLOCK = 4  # a block's queries of one KV head (registers: 4 queries x 8 floats of q and of o per lane)
_HEAD_SIZES = (64, 128, 256)  # D/8 elements per lane, loaded 8 at a time (256: a whole warp per key, Qwen3.5's)

# Pass 1. Grid: x = key slices (SPLIT each), y = KV head x query chunk, z = row. 4 warps; a key's D elements are
# spread over D/8 lanes (one 16-byte load each), so a warp takes 256/D keys at a time and a score is a butterfly
# within D/8 lanes.
_PARTIAL = r"""
  constexpr int NW = 4;
  constexpr int EPL = 8;  // elements of a key per lane: one 16-byte load
  constexpr int LPK = D / EPL;  // lanes per key
  constexpr int KPW = 32 / LPK;  // keys a warp takes at a time
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / LPK;
  const int sl = lane % LPK;
  const int split = blockIdx.x;
  const int NS = gridDim.x;
  const int hk = blockIdx.y / NCHUNK;
  const int chunk = blockIdx.y % NCHUNK;
  const int b = blockIdx.z;
  const int Hq = q_shape[1];
  const int row_last = last[b];
  int s0 = split * SPLIT;
  const int s1 = min(s0 + SPLIT, row_last + W);
  // a sliding window of WINDOW keys (0: none): query i sees row_last + i - WINDOW + 1 .. row_last + i, so nothing
  // below the first query's window is read
  const int row_start = WINDOW > 0 ? max(start[b], row_last - WINDOW + 1) : start[b];
  s0 = max(s0, row_start);
  const float scale_log2 = scale[0] * 1.4426950408889634f;

  float qv[GC][EPL];
  float o[GC][EPL];
  float m[GC];
  float l[GC];
  int lim[GC];
  int low[GC];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    const int gg = chunk * GC + g;
    m[g] = -INFINITY;
    l[g] = 0.f;
    lim[g] = -1;
    low[g] = row_start;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      o[g][e] = 0.f;
      qv[g][e] = 0.f;
    }
    if (gg < REP * W) {
      const int r = gg / W;
      const int qi = gg % W;
      lim[g] = row_last + qi;
      low[g] = WINDOW > 0 ? max(start[b], row_last + qi - WINDOW + 1) : start[b];
      const T* qp = q + b * q_strides[0] + (hk * REP + r) * q_strides[1] + qi * q_strides[2] + sl * EPL;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        qv[g][e] = static_cast<float>(qp[e]) * scale_log2;
      }
    }
  }

  const T* kb = k + b * k_strides[0] + hk * k_strides[1] + sl * EPL;
  const T* vb = v + b * v_strides[0] + hk * v_strides[1] + sl * EPL;
  // U key groups per warp per round: all their loads are issued before any arithmetic, so U times the bytes are in
  // flight (the loop is latency-bound otherwise), and the online softmax rescales once per round, not per key.
  for (int base = s0 + warp * KPW; base < s1; base += NW * KPW * U) {  // warp-uniform: every lane takes every shuffle
    int tt[U];
    AlignedVector<T, EPL> kk[U];
    AlignedVector<T, EPL> vv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      tt[u] = base + u * NW * KPW + sub;
      const int tl = min(tt[u], s1 - 1);  // past the end: load a valid key, its weight is 0 below
      kk[u] = *reinterpret_cast<const AlignedVector<T, EPL>*>(kb + tl * k_strides[2]);
      vv[u] = *reinterpret_cast<const AlignedVector<T, EPL>*>(vb + tl * v_strides[2]);
    }
    float s[U][GC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          acc += qv[g][e] * static_cast<float>(kk[u][e]);
        }
        s[u][g] = acc;
      }
    }
#pragma unroll
    for (int off = 1; off < LPK; off <<= 1) {  // U x GC independent butterflies, interleaved
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int g = 0; g < GC; ++g) {
          s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], off);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float mc = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (tt[u] >= s1 || tt[u] > lim[g] || tt[u] < low[g]) {
          s[u][g] = -INFINITY;
        }
        mc = fmaxf(mc, s[u][g]);
      }
      if (mc != -INFINITY) {
        const float c = exp2f(m[g] - mc);  // 0 while m is still -inf
        float p[U];
        float ps = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          p[u] = exp2f(s[u][g] - mc);
          ps += p[u];
        }
        l[g] = l[g] * c + ps;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          float x = o[g][e] * c;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            x += p[u] * static_cast<float>(vv[u][e]);
          }
          o[g][e] = x;
        }
        m[g] = mc;
      }
    }
  }

  // the warp's KPW key groups into one (lanes LPK apart hold the same dimensions)
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    float M = m[g];
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
      M = fmaxf(M, __shfl_xor_sync(0xffffffff, M, off));
    }
    const float f = (m[g] == -INFINITY) ? 0.f : exp2f(m[g] - M);
    float lg = l[g] * f;
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
      lg += __shfl_xor_sync(0xffffffff, lg, off);
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      float x = o[g][e] * f;
#pragma unroll
      for (int off = LPK; off < 32; off <<= 1) {
        x += __shfl_xor_sync(0xffffffff, x, off);
      }
      o[g][e] = x;
    }
    m[g] = M;
    l[g] = lg;
  }

  __shared__ float sm[NW][GC];
  __shared__ float sls[NW][GC];
  __shared__ float so[NW][GC][D];
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        so[warp][g][sl * EPL + e] = o[g][e];
      }
      if (sl == 0) {
        sm[warp][g] = m[g];
        sls[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  // the block's 4 warps into one partial result per query
  for (int idx = threadIdx.x; idx < GC * D; idx += NW * 32) {
    const int g = idx / D;
    const int d = idx % D;
    const int gg = chunk * GC + g;
    if (gg >= REP * W) {
      continue;
    }
    const int r = gg / W;
    const int qi = gg % W;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      M = fmaxf(M, sm[w][g]);
    }
    float acc = 0.f;
    float L = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = (sm[w][g] == -INFINITY) ? 0.f : exp2f(sm[w][g] - M);
        acc += so[w][g][d] * f;
        L += sls[w][g] * f;
      }
    }
    const long row = ((long)(b * Hq + hk * REP + r) * W + qi) * NS + split;
    po[row * D + d] = acc;
    if (d == 0) {
      pm[row] = M;
      pl[row] = L;
    }
  }
"""

# Pass 2. One block per (row, query head, query); thread d merges dimension d over the key slices.
_MERGE = r"""
  const int idx = blockIdx.x;
  const int d = threadIdx.x;
  const int NS = pm_shape[3];
  const float* ms = pm + (long)idx * NS;
  const float* ls = pl + (long)idx * NS;
  const float* os = po + (long)idx * NS * D;
  float M = -INFINITY;
  for (int s = 0; s < NS; ++s) {
    M = fmaxf(M, ms[s]);
  }
  float acc = 0.f;
  float L = 0.f;
  for (int s = 0; s < NS; ++s) {
    const float f = (ms[s] == -INFINITY) ? 0.f : exp2f(ms[s] - M);
    acc += os[(long)s * D + d] * f;
    L += ls[s] * f;
  }
  SINK_TERM
  out[(long)idx * D + d] = static_cast<T>(L > 0.f ? acc / L : 0.f);
"""
# gpt-oss's attention sinks: one more logit per query head (natural-log units, like the scaled scores) that takes
# part of the softmax's mass and adds no value; ``idx / W % Hq`` is the block's query head
_SINK_TERM = r"""
  {
    const int h = (idx / W) % HQ;
    const float sink2 = static_cast<float>(sinks[h]) * 1.4426950408889634f;
    const float M2 = fmaxf(M, sink2);
    const float f = (M == -INFINITY) ? 0.f : exp2f(M - M2);
    acc *= f;
    L = L * f + exp2f(sink2 - M2);
  }
"""

# The same two passes with the step's width (and the first pass's query chunks) read at run time, not compiled in:
# a prompt chunk's length is new nearly every forward, and a template value would compile a kernel for each
_RUNTIME_WIDTH = "  const int W = q_shape[2];\n  const int NCHUNK = gridDim.y / k_shape[1];\n"
_MERGE_RUNTIME_WIDTH = "  const int W = po_shape[2];\n"

_kernels: dict = {}


def _kernel(name: str):
    """``partial``, ``merge``, ``merge_sinks``; with a ``_runtime`` suffix, the same with the width read at run
    time (``kernel_sources``)."""
    if name not in _kernels:
        base = name.removesuffix("_runtime")
        inputs = {"partial": ["q", "k", "v", "start", "last", "scale"], "merge": ["po", "pm", "pl"],
                  "merge_sinks": ["po", "pm", "pl", "sinks"]}[base]
        outputs = ["po", "pm", "pl"] if base == "partial" else ["out"]
        _kernels[name] = mx.fast.cuda_kernel(
            name=f"mlx_lane_ranged_attention_{name}", input_names=inputs, output_names=outputs,
            source=kernel_sources(runtime_width=name != base)[base], ensure_row_contiguous=base != "partial")
    return _kernels[name]


def kernel_sources(runtime_width: bool = False) -> dict[str, str]:
    """The kernels' CUDA bodies: ``partial``, ``merge``, ``merge_sinks``. With ``runtime_width`` the width ``W`` (and
    the first pass's ``NCHUNK``) are locals read from the arrays' shapes and the grid, not template values."""
    partial, merge = _PARTIAL, _MERGE
    if runtime_width:
        partial, merge = _RUNTIME_WIDTH + partial, _MERGE_RUNTIME_WIDTH + merge
    return {"partial": partial, "merge": merge.replace("SINK_TERM", ""),
            "merge_sinks": merge.replace("SINK_TERM", _SINK_TERM)}


def ranged_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, start: mx.array,
                     last: mx.array, window: int = 0, sinks: Optional[mx.array] = None,
                     runtime_width: bool = False) -> mx.array:
    """``softmax(q k^T * scale) v`` where row b's query i sees key columns ``start[b] .. last[b] + i`` (both int32,
    shape (B,)), and within a sliding ``window`` (> 0) only the last ``window`` of them (``last[b] + i - window + 1``
    on); ``sinks`` (H,): one more logit per query head in the softmax, with no value (gpt-oss). ``queries`` (B, H,
    W, D), ``keys``/``values`` (B, KV, S, D) with H a multiple of KV, any strides with the head dimension contiguous
    (views into a cache's buffers are not copied). The fused CUDA kernel: call it only where ``_applies`` (a decode
    or verify step) or ``prefill_ranges`` (``runtime_width``: a prompt chunk, its width not compiled in) says so."""
    B, H, W, D = queries.shape
    kv, S = keys.shape[1], keys.shape[2]
    rep = H // kv
    gc = _QUERIES_PER_BLOCK
    chunks = -(-rep * W // gc)
    splits = max(1, -(-S // SPLIT))
    suffix = "_runtime" if runtime_width else ""
    width = [] if runtime_width else [("W", W)]
    po, pm, pl = _kernel("partial" + suffix)(
        inputs=[queries, keys, values, start, last, mx.array([scale], dtype=mx.float32)],
        template=[("T", queries.dtype), ("D", D), ("GC", gc), *width, ("REP", rep),
                  *([] if runtime_width else [("NCHUNK", chunks)]), ("SPLIT", SPLIT), ("U", UNROLL),
                  ("WINDOW", int(window))],
        grid=(splits * 128, kv * chunks, B), threadgroup=(128, 1, 1),
        output_shapes=[(B, H, W, splits, D), (B, H, W, splits), (B, H, W, splits)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    merge, inputs = ("merge", [po, pm, pl]) if sinks is None else ("merge_sinks", [po, pm, pl, sinks])
    (out,) = _kernel(merge + suffix)(
        inputs=inputs, template=[("T", queries.dtype), ("D", D), *width, ("HQ", H)],
        grid=(B * H * W * D, 1, 1), threadgroup=(D, 1, 1),
        output_shapes=[(B, H, W, D)], output_dtypes=[queries.dtype])
    return out


def reference_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, start: mx.array,
                        last: mx.array, window: int = 0, sinks: Optional[mx.array] = None) -> mx.array:
    """What ``ranged_attention`` computes, with MLX ops and a mask (float32): the oracle of the tests and of
    ``bench/gpu_attention.py``."""
    B, H, W, D = queries.shape
    S = keys.shape[2]
    cols = mx.arange(S)[None, None, :]
    lo = start[:, None, None]
    hi = last[:, None, None] + mx.arange(W)[None, :, None]
    if window > 0:
        lo = mx.maximum(lo, hi - window + 1)
    mask = ((cols >= lo) & (cols <= hi))[:, None]  # (B, 1, W, S)
    return mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32), scale=scale,
        mask=mask, sinks=None if sinks is None else sinks.astype(mx.float32)).astype(queries.dtype)


def row_ranges(cache, width: int) -> Optional[tuple[mx.array, mx.array]]:
    """For a batch cache that has just taken a forward's ``width`` new positions (``update_and_fetch`` done): each
    row's first visible column and the last column its first query sees, as int32 arrays of shape (B,). None for a
    cache whose columns this does not know (the caller keeps the mask).

    - a layer that says it (``models.attention.RowRanges``: the ragged batch's layers);
    - mlx-lm's ``BatchKVCache``: row b sees ``left_padding[b] .. _idx - width + i`` (its ``make_mask``), unless a
      right padding is pending (a batched prefill, never a decode step)."""
    ranges = getattr(cache, "attention_ranges", None)
    if ranges is not None:
        return ranges(width)
    from mlx_lm.models.cache import BatchKVCache

    if type(cache) is BatchKVCache and right_padding(cache) is None:
        B = cache.left_padding.shape[0]
        last = mx.full((B,), batch_index(cache) - width, dtype=mx.int32)
        return cache.left_padding.astype(mx.int32), last
    return None


def _applies(queries: mx.array, keys: mx.array, values: mx.array, cache) -> bool:
    """A batch's decode or verify step (B > 1, 1..MAX_WIDTH queries a row) the kernel takes."""
    return (_kinds_apply(queries, keys, values, cache) and 1 <= queries.shape[2] <= MAX_WIDTH
            and queries.shape[0] > 1)


def _kinds_apply(queries: mx.array, keys: mx.array, values: mx.array, cache) -> bool:
    """Head size, dtypes and grouping the kernel takes; KV not quantized."""
    if hasattr(cache, "bits") or queries.ndim != 4 or keys.ndim != 4:
        return False
    H, D = queries.shape[1], queries.shape[3]
    return (D in _HEAD_SIZES and values.shape[-1] == D and keys.shape[-1] == D and H % keys.shape[1] == 0
            and queries.dtype in (mx.bfloat16, mx.float16) and keys.dtype == queries.dtype
            and values.dtype == queries.dtype)


def prefill_ranges(queries: mx.array, keys: mx.array, values: mx.array,
                   cache) -> Optional[tuple[mx.array, mx.array, int]]:
    """Where a prompt chunk of ``MAX_WIDTH`` + 1 .. ``PREFILL_MAX`` queries a row takes the kernel (``runtime_width``):
    ``(start, last, window)`` of its rows, else None (cuDNN takes it, as before).

    The chunk's keys are what its layer's ``update_and_fetch`` returned, the chunk's own positions last:
    - a lone sequence over mlx-lm's ``KVCache`` (the buffer's first ``offset`` columns): query i sees columns
      ``0 .. S - W + i``, the model's ``"causal"`` mask aligned to the last key;
    - a lone sequence over ``RotatingKVCache`` without kept tokens (a chunk of more than one token goes through its
      ``_update_concat``: the window's last ``max_size - 1`` positions, then the chunk's, in position order): the same
      within the last ``max_size`` columns, ``create_causal_mask(W, S - W, window_size=max_size)``;
    - rows prefilled together in mlx-lm's ``BatchKVCache`` (``PromptProcessingBatch``: left-padded, shorter chunks
      right-padded): row b's query i sees ``left_padding[b] .. _idx - W + i``, its mask (which has no right padding:
      a row's padded tail comes after its real queries, so they never see it; finalize rolls it away);
    - and in ``BatchRotatingKVCache`` (its ``_update_concat``: position order, the window's last ``max_size - 1``
      columns, then the chunk's; ``left_padding`` moved by what it trimmed): the same within the last ``max_size``
      columns, what its mask says for every real query (a padded query may see other columns: its output is
      discarded, its keys rolled away).
    Also within ``PREFILL_PARTIALS_MAX`` bytes of partial results, ``PREFILL_PAIRS_MAX`` query-key pairs (past that
    the kernel's arithmetic costs more than cuDNN's plan) and the grid's 65,535 blocks in y."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

    B, H, W, D = queries.shape
    if not (PREFILL_MAX and MAX_WIDTH < W <= PREFILL_MAX and _kinds_apply(queries, keys, values, cache)):
        return None
    S, kv = keys.shape[2], keys.shape[1]
    splits = -(-S // SPLIT)
    chunks = -(-(H // kv) * W // _QUERIES_PER_BLOCK)
    if (S < W or B * H * W * splits * (D + 2) * 4 > PREFILL_PARTIALS_MAX or kv * chunks > 65535
            or B * W * S > PREFILL_PAIRS_MAX):
        return None
    kind = type(cache)
    if kind in (BatchKVCache, BatchRotatingKVCache) and batch_index(cache) == S:
        window = int(cache.max_size) if kind is BatchRotatingKVCache else 0
        return cache.left_padding.astype(mx.int32), mx.full((B,), S - W, dtype=mx.int32), window
    if B != 1:
        return None
    if kind is KVCache:
        window = 0
    elif kind is RotatingKVCache and cache.keep == 0:
        window = int(cache.max_size)
    else:
        return None
    return mx.array([0], dtype=mx.int32), mx.array([S - W], dtype=mx.int32), window


def scores_in_mask(mask) -> bool:
    """An additive (not boolean) array mask: it may carry scores of its own, not only who sees whom (multi-head
    latent attention, DeepSeek-V3 / GLM-4.7-Flash, passes its rotary part's scores as the mask), so the kernel, which
    replaces a mask by each row's visible columns, must not take it. mlx-lm's and the batches' masks are boolean or
    ``"causal"``."""
    return isinstance(mask, mx.array) and mask.dtype != mx.bool_


def reads_segments(queries: mx.array, cache) -> bool:
    """A step of at most ``MAX_WIDTH`` queries (a decode or verify step) over a RAM hit's ``SharedPrefixKVCache``, its
    scores (B x H x L x S) under ``composed.MAX_SCORES``: read where the cached entry lies (``segmented_attention``),
    instead of the one buffer MLX's kernels want, which the first new token would fill by copying the whole prefix
    (~4.3 GB at 32k tokens of Llama-3-8B: issue 45). Longer chunks take the segments' concatenation (one copy, as a
    ``KVCache`` growing past its room makes) and the paths below."""
    if not isinstance(cache, SharedPrefixKVCache) or queries.ndim != 4:
        return False
    B, H, L, _ = queries.shape
    return L <= MAX_WIDTH and B * H * L * cache.offset <= composed.MAX_SCORES


def _wrap(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if reads_segments(queries, cache):  # keys / values: the segments' lazy concatenation, then left unused
            out = segmented_attention(queries, cache.segments(), scale, mask, sinks)
            if out is not None:  # None: a mask with a head axis (latent attention), taken below
                return out
        if scores_in_mask(mask):  # composed adds it as MLX's fallback does; else mlx-lm's
            if composed.applies(queries, keys, cache):
                return composed.composed_attention(queries, keys, values, scale, mask, sinks)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if _applies(queries, keys, values, cache):
            ranges = row_ranges(cache, queries.shape[2])
            if ranges is not None:  # a window layer of the ragged batch says its window (0: none)
                return ranged_attention(queries, keys, values, scale, *ranges,
                                        window=getattr(cache, "attention_window", 0), sinks=sinks)
        prefill = prefill_ranges(queries, keys, values, cache) if PREFILL_MAX else None
        if prefill is not None:
            start, last, window = prefill
            return ranged_attention(queries, keys, values, scale, start, last, window=window, sinks=sinks,
                                    runtime_width=True)
        if composed.applies(queries, keys, cache):
            return composed.composed_attention(queries, keys, values, scale, mask, sinks)
        if not hasattr(cache, "bits") and buckets.applies(queries, keys, values, mask):  # a chunk for cuDNN
            return buckets.padded_attention(queries, keys, values, scale, mask, sinks,
                                            lambda q, k, v, **kw: original(q, k, v, cache=cache, **kw))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.mlx_lane_original = original
    scaled_dot_product_attention.mlx_lane_path = "cuda"
    scaled_dot_product_attention.mlx_lane_reads_segments = True  # models.attention.reads_segments
    return scaled_dot_product_attention


def configure(on: bool = True, split: int = 256, unroll: int = 4, composed_max: int = 8, prefill_max: int = 0) -> None:
    """The process's settings (server.serve, from `--attention` and the `--debug-gpu-attention-*` flags); kernels
    compiled before keep theirs. ``composed_max`` 0: every multi-query step goes to mlx-lm's (cuDNN);
    ``prefill_max``: ``PREFILL_MAX``."""
    global _ON, SPLIT, UNROLL, PREFILL_MAX
    if split < 32 or unroll < 1 or prefill_max < 0:
        raise ValueError(f"GPU attention split {split} (at least 32), unroll {unroll} (at least 1) or prefill max "
                         f"{prefill_max} (at least 0) out of range")
    _ON, SPLIT, UNROLL, PREFILL_MAX = bool(on), int(split), int(unroll), int(prefill_max)
    composed.configure(composed_max)


def enabled() -> bool:
    """True where ``install`` switches models: MLX's CUDA backend is the default device, and the process did not
    choose MLX's own attention (``configure(on=False)``: `--attention mlx`)."""
    if not _ON:
        return False
    if mx.default_device() != mx.gpu:
        return False
    try:
        return mx.cuda.is_available()
    except AttributeError:
        return False


def install(model) -> int:
    """On a CUDA GPU, route the attention of ``model``'s modules through ``ranged_attention`` where it applies;
    returns how many model modules were switched (0 elsewhere, or after ``configure(on=False)``)."""
    if not enabled():
        return 0
    return switch(model, _wrap)
