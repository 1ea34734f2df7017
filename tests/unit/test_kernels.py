"""models.kernels on the CPU: the chunked gated delta rule against mlx-lm's per-token ops on random inputs, the
dispatcher a model's modules are switched to, and switching back (the CUDA kernels' own comparison runs on the device:
bench/gpu_kernels.py).

Tolerance: float32 throughout; the chunked form sums in another order (products of 64-token chunks), so outputs and
states agree to 1e-5 absolute on inputs of unit scale (measured: ~1e-7), which is what a greedy decode needs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta as mlx_gated_delta
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

from models import kernels
from models.kernels import gated_delta

TOL = 1e-5


def inputs(B, T, Hk, Hv, Dk, Dv, *, correlated=False, seed=0):
    """What a gated delta-net layer hands the rule: L2-normed q/k with the readout scale folded in, gates in (0, 1),
    beta in (0, 1), a state from earlier tokens."""
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    if correlated:  # nearly the same key every token: the in-chunk triangle is far from the identity
        k = 0.05 * k + mx.random.normal((B, 1, Hk, Dk))
    q, k = normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    g = compute_g(0.5 * mx.random.normal((Hv,)), mx.random.normal((B, T, Hv)), mx.random.normal((Hv,)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    return q, k, v, g, beta, state


def max_diff(a, b, where=None):
    d = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
    if where is not None:
        d = mx.where(where, d, 0.0)
    return d.max().item()


def taps_in_order(x: mx.array, w: mx.array):
    """A depthwise convolution's float32 sums in NumPy, tap after tap, each product rounded before it is added (no
    fused multiply-add): what ``conv.shifted`` promises to compute, bit for bit."""
    xn, taps = np.array(x), np.array(w)[:, :, 0].T
    L, K = xn.shape[1], taps.shape[0]
    out = xn[:, 0: L - K + 1] * taps[0]
    for k in range(1, K):
        out = out + xn[:, k: L - K + 1 + k] * taps[k]
    return out


# mx.conv1d against those sums: equal to the bit with the wheel's own BLAS; OpenBLAS (which the servers preload, and
# tests/conftest.py the pytest-xdist workers) fuses the multiply-adds of its gemm, a few float32 ulps apart
# (measured up to 1.4e-7 of the largest output on an AMD EPYC, 2026-12-07)
CONV_RTOL = 1e-6


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,chunk,correlated", [
    (1, 1, 2, 2, 32, 32, 64, False),  # one token
    (2, 100, 2, 4, 32, 32, 64, False),  # grouped heads, a tail that pads the last chunk
    (1, 128, 2, 2, 64, 32, 64, False),  # whole chunks, Dk != Dv
    (2, 130, 2, 4, 64, 64, 64, True),  # correlated keys: the Neumann series would blow up here
    (1, 40, 1, 2, 32, 32, 16, False),  # a small chunk
    (1, 300, 4, 8, 128, 128, 64, False),  # a 9B layer's head sizes
])
def test_the_chunked_form_matches_mlx_lms_per_token_ops(B, T, Hk, Hv, Dk, Dv, chunk, correlated):
    q, k, v, g, beta, state = inputs(B, T, Hk, Hv, Dk, Dv, correlated=correlated)
    y0, s0 = gated_delta_ops(q, k, v, g, beta, state)
    y1, s1 = gated_delta.chunked(q, k, v, g, beta, state, chunk=chunk)
    assert y1.shape == y0.shape and s1.shape == s0.shape and y1.dtype == q.dtype
    assert max_diff(y0, y1) < TOL
    assert max_diff(s0, s1) < TOL


def test_masked_positions_leave_the_state_as_it_was_and_real_ones_match():
    B, T = 3, 70
    q, k, v, g, beta, state = inputs(B, T, 2, 4, 32, 32, seed=3)
    # left padding (a batch's shorter rows), right padding, none
    pos = mx.arange(T)[None, :]
    mask = mx.concatenate([pos >= 9, pos < 50, pos >= 0], axis=0)
    y0, s0 = gated_delta_ops(q, k, v, g, beta, state, mask)
    y1, s1 = gated_delta.chunked(q, k, v, g, beta, state, mask)
    assert max_diff(y0, y1, where=mask[:, :, None, None]) < TOL
    assert max_diff(s0, s1) < TOL
    # a row that is all padding keeps its state exactly
    none = mx.zeros((1, T), dtype=mx.bool_)
    _, s_none = gated_delta.chunked(q[:1], k[:1], v[:1], g[:1], beta[:1], state[:1], none)
    assert max_diff(s_none, state[:1]) == 0.0


def test_gates_that_underflow_to_zero_wipe_the_state_as_mlx_lms_ops_do():
    q, k, v, g, beta, state = inputs(2, 80, 2, 4, 32, 32, seed=11)
    t = mx.arange(80)[None, :, None]
    g = mx.where(t % 7 == 3, 0.0, mx.where(t % 5 == 1, 1e-30, g))  # exactly 0 (log -inf) and nearly so
    y0, s0 = gated_delta_ops(q, k, v, g, beta, state)
    y1, s1 = gated_delta.chunked(q, k, v, g, beta, state)
    assert not mx.isnan(y1).any().item()
    assert max_diff(y0, y1) < TOL and max_diff(s0, s1) < TOL


def test_the_chunked_form_carries_its_state_across_calls_as_one_call_does():
    q, k, v, g, beta, state = inputs(1, 90, 2, 2, 32, 32, seed=5)
    y, s = gated_delta.chunked(q, k, v, g, beta, state)
    ya, sa = gated_delta.chunked(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    yb, sb = gated_delta.chunked(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], sa)
    assert max_diff(mx.concatenate([ya, yb], axis=1), y) < TOL
    assert max_diff(sb, s) < TOL


def test_the_chunked_form_refuses_vector_gates_and_odd_chunks():
    q, k, v, g, beta, state = inputs(1, 8, 2, 2, 32, 32)
    with pytest.raises(ValueError, match="scalar gates"):
        gated_delta.chunked(q, k, v, mx.broadcast_to(g[..., None], (*g.shape, 32)), beta, state)
    with pytest.raises(ValueError, match="power of two"):
        gated_delta.chunked(q, k, v, g, beta, state, chunk=48)


def test_the_unit_lower_inverse_is_the_inverse():
    mx.random.seed(1)
    m = mx.tril(mx.random.normal((3, 16, 16)), -1) + mx.eye(16)
    assert max_diff(gated_delta._unit_lower_inverse(m) @ m, mx.broadcast_to(mx.eye(16), m.shape)) < 1e-4


def test_install_switches_a_models_modules_to_the_dispatcher_and_mlx_lm_kernels_switches_back():
    from tests.fixtures import zoo

    model = zoo.build("qwen3_5", 64)
    module = zoo._module("qwen3_5")
    try:
        assert kernels.install(model) >= 1
        assert module.gated_delta_update is not mlx_gated_delta.gated_delta_update
        assert module.gated_delta_update.mlx_lane_original is mlx_gated_delta.gated_delta_update
        assert kernels.kernel_path(model) == "chunked"  # on this CPU
        assert kernels.install(model) >= 1  # a second load of the architecture: already switched, not wrapped twice
        assert module.gated_delta_update.mlx_lane_original is mlx_gated_delta.gated_delta_update
        with kernels.mlx_lm_kernels(model):
            assert module.gated_delta_update is mlx_gated_delta.gated_delta_update
        assert module.gated_delta_update is not mlx_gated_delta.gated_delta_update
    finally:
        kernels.hook.restore(model, kernels.GATED_DELTA)
    assert kernels.kernel_path(zoo.build("llama", 64)) == "none"


def test_the_dispatcher_gives_mlx_lms_outputs_for_prompts_and_single_steps():
    dispatch = kernels._gated_delta_dispatch(mlx_gated_delta.gated_delta_update, "cpu")
    mx.random.seed(7)
    B, Hk, Hv, D = 2, 2, 4, 32
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    for T in (1, kernels.CPU_CHUNKED_MIN - 1, kernels.CPU_CHUNKED_MIN, 77):
        q, k = normalize_qk(mx.random.normal((B, T, Hk, D)), mx.random.normal((B, T, Hk, D)),
                            inv_scale=D ** -0.5, eps=1e-6)
        v = mx.random.normal((B, T, Hv, D))
        a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
        for state in (None, 0.1 * mx.random.normal((B, Hv, D, D))):
            y0, s0 = mlx_gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
            y1, s1 = dispatch(q, k, v, a, b, A_log, dt_bias, state)
            assert max_diff(y0, y1) < TOL and max_diff(s0, s1) < TOL, T


def test_depthwise_convolutions_switch_class_and_compute_as_mlx_does_where_the_kernel_cannot_run():
    """The class switch keeps every parameter and output; ``applies`` holds the kernel to what it computes exactly
    (the kernel itself is compared with ``mx.conv1d`` on the device: bench/gpu_hybrid_parts.py)."""
    import mlx.nn as nn

    from models.kernels import conv, positions
    from tests.fixtures import zoo

    model = zoo.build("qwen3_5", 64)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv1d)]
    assert convs and all(conv.is_depthwise(c) for c in convs)
    mx.random.seed(3)
    x = mx.random.normal((2, 9, convs[0].weight.shape[0]))
    before = convs[0](x)
    assert conv.switch(model) == len(convs)
    assert all(type(c) is conv.DepthwiseConv1d for c in convs)
    assert positions.watch(model) == len(convs)  # a gated-delta layer's convolution is watched and keeps the kernel
    assert all(isinstance(c, conv.DepthwiseConv1d) for c in convs)
    was, ops_was = conv.ENABLED, conv.OPS
    try:
        conv.ENABLED, conv.OPS = False, False
        assert max_diff(convs[0](x), before) == 0.0  # mlx's own call
        conv.OPS = True  # the CPU's form: the taps' float32 sums in order, bit for bit, and mlx's within its BLAS
        got = convs[0](x)
        want = taps_in_order(x, convs[0].weight)
        if "bias" in convs[0]:
            want = want + np.array(convs[0].bias)
        assert (np.array(got) == want).all()
        assert max_diff(got, before) <= CONV_RTOL * mx.abs(before).max().item()
        conv.ENABLED = True
        assert conv.applies(convs[0], x)
        assert not conv.applies(convs[0], x.astype(mx.bfloat16))  # another dtype than the weight's
        assert not conv.applies(convs[0], x[:, :2])  # fewer positions than taps
        assert not conv.applies(nn.Conv1d(8, 8, 3, groups=2), mx.zeros((1, 5, 8)))  # not one channel a group
        padded = nn.Conv1d(8, 8, 3, padding=1, groups=8)
        assert conv.is_depthwise(padded) and not conv.applies(padded, mx.zeros((1, 5, 8)))
    finally:
        conv.ENABLED, conv.OPS = was, ops_was
    assert conv.switch(zoo.build("llama", 64)) == 0


@pytest.mark.parametrize("B,L,C,K", [(1, 4, 64, 4), (16, 4, 8192, 4), (3, 333, 512, 4), (2, 40, 96, 3), (1, 2, 8, 2)])
def test_the_shifted_form_is_the_taps_float32_sums_in_order_and_mlxs_depthwise_convolution(B, L, C, K):
    from models.kernels import conv

    mx.random.seed(B * L + C)
    x, w = mx.random.normal((B, L, C)), mx.random.normal((C, K, 1))
    got = conv.shifted(x, w)
    assert (np.array(got) == taps_in_order(x, w)).all()
    mlx_conv = mx.conv1d(x, w, groups=C)
    assert max_diff(got, mlx_conv) <= CONV_RTOL * mx.abs(mlx_conv).max().item()
