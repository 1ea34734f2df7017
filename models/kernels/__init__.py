"""mlx-lane's kernels for what mlx-lm computes fast on Metal only: the gated delta rule of linear-attention hybrids
and Mamba-2's decode step.

    gated_delta.py   ``recurrent`` (one CUDA kernel over any number of tokens) and ``chunked`` (the chunkwise form
                     in plain MLX ops: a chunk of 64 tokens is a few matrix products)
    ssm.py           ``step``: Mamba-2's one-token state update as a CUDA kernel (mlx-lm's prompts already go
                     through its chunked SSD form)
    conv.py          ``depthwise``: the short convolution every hybrid layer runs, as one CUDA kernel (mlx's CUDA
                     backend builds a cuDNN plan per input shape for it); ``shifted``, the same as K shifted products
                     (the CPU's conv1d loops 4-6x slower)
    moe.py           how mixture-of-experts layers read their experts: (token, expert) pairs sorted by expert from
                     ``SORT_MIN`` pairs on (mlx-lm: 64; on CUDA a sorted product reads each expert's weights once),
                     or every expert for calls of up to ``DENSE_MAX`` tokens (A/B knobs, off by default)
    positions.py     a verify forward's recurrent state at every position (``recording``), so rejected drafts are
                     taken back by choosing a state (spec.rewind) instead of feeding the kept tokens again

``install(model)`` switches the model's modules (``models.hook``) to the dispatchers below, chosen once for this
process's device: on CUDA every gated-delta call takes ``recurrent``, every Mamba-2 decode step ``ssm.step`` and
every depthwise ``Conv1d`` ``conv.depthwise``; on CUDA and the CPU, when `--debug-moe-sort-min` or
`--debug-moe-dense-max` asks, every ``SwitchGLU`` / ``SwitchMLP`` reads its experts that way (models.kernels.moe); on
the CPU a float32 depthwise ``Conv1d`` takes ``conv.shifted`` and a gated-delta prompt of at least
``CPU_CHUNKED_MIN`` tokens takes ``chunked`` (scalar gates; vector gates and short steps stay on mlx-lm's ops); on
Metal nothing is switched: mlx-lm's own kernels stay. ``configure(False)`` (`--kernels mlx`) leaves mlx-lm's functions
everywhere, to compare. ``kernel_path(model)`` says what a loaded model runs (/stats, the start-up line).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import mlx.core as mx

from models import hook
from models.kernels import conv, gated_delta, moe, positions, ssm
from models.kernels.moe import expert_path

__all__ = ["configure", "install", "kernel_path", "expert_path", "mlx_lm_kernels", "CPU_CHUNKED_MIN"]

GATED_DELTA = "gated_delta_update"
SSM = "ssm_update"
# On the CPU a prompt of this many tokens or more takes the chunked form (below it, mlx-lm's per-token ops cost
# about the same: tests/unit/test_kernels.py holds both to the same outputs, bench/cpu_kernels.py times them)
CPU_CHUNKED_MIN = 16
_ON = True
_CONV = True


def configure(on: bool = True, conv: bool = True, moe_sort_min: int = moe.MLX_LM_SORT_MIN,
              moe_dense_max: int = 0) -> None:
    """``on`` False (`--kernels mlx`): models keep mlx-lm's own functions; ``conv`` False
    (`--debug-no-conv-kernel`): depthwise convolutions keep mlx's conv1d; ``moe_sort_min``
    (`--debug-moe-sort-min`): the pairs from which a mixture-of-experts layer sorts them; ``moe_dense_max``
    (`--debug-moe-dense-max`): the tokens up to which it computes every expert (set before a model is loaded)."""
    global _ON, _CONV
    _ON, _CONV = on, conv
    moe.SORT_MIN = max(1, int(moe_sort_min))
    moe.DENSE_MAX = max(0, int(moe_dense_max))


def _device() -> str:
    """``cuda``, ``metal`` or ``cpu``: where this process's default device computes."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    try:
        return "cuda" if mx.cuda.is_available() else "cpu"
    except AttributeError:
        return "cpu"


def _gated_delta_dispatch(original, device: str):
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g, gated_delta_ops

    def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state: Optional[mx.array] = None,
                           mask: Optional[mx.array] = None, *, use_kernel: bool = True,
                           lower_bound: float | None = None, allow_neg_eigval: bool = False):
        # the same gates as mlx-lm's gated_delta_update (mlx_lm/models/gated_delta.py), then our path
        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        g = compute_g(A_log, a, dt_bias) if lower_bound is None else compute_lower_bound_g(A_log, a, dt_bias,
                                                                                           lower_bound)
        state_in = state
        if state is None:
            B, _, _, Dk = q.shape
            Hv, Dv = v.shape[-2:]
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        if (rec := positions.active()) is not None:  # a verify forward: the state after every token too
            y, state, states = _every_state(q, k, v, g, beta, state, mask, device)
            rec.delta_rule(state_in, states)
            return y, state
        if device == "cuda" and gated_delta.recurrent_applies(k):
            return gated_delta.recurrent(q, k, v, g, beta, state, mask)
        if device == "cpu" and g.ndim == 3 and q.shape[1] >= CPU_CHUNKED_MIN:
            chunk = min(gated_delta.CHUNK, 1 << (q.shape[1] - 1).bit_length())
            return gated_delta.chunked(q, k, v, g, beta, state, mask, chunk=chunk)
        return gated_delta_ops(q, k, v, g, beta, state, mask)

    gated_delta_update.mlx_lane_original = original
    gated_delta_update.mlx_lane_path = "cuda" if device == "cuda" else "chunked"
    return gated_delta_update


def _every_state(q, k, v, g, beta, state, mask, device: str):
    """The delta rule's output, final state and the state after each token (models.kernels.positions)."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    if device == "cuda" and gated_delta.recurrent_applies(k):
        return gated_delta.recurrent(q, k, v, g, beta, state, mask, every_state=True)
    ys, states = [], []
    for t in range(q.shape[1]):  # what gated_delta_ops does, one token a call, keeping each state
        y, state = gated_delta_ops(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                   beta[:, t : t + 1], state, None if mask is None else mask[:, t : t + 1])
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), state, mx.stack(states, axis=1)


def _ssm_dispatch(original):
    from mlx_lm.models.ssm import compute_dt

    def ssm_update(hidden_states, A_log, B, C, D, dt, dt_bias, state: Optional[mx.array] = None,
                   time_step_limit=(0.001, 100.0), mask: Optional[mx.array] = None,
                   lengths: Optional[mx.array] = None):
        # mlx-lm takes its Metal kernel for exactly these calls (one token, a state), mask or not: the one new
        # token of a decode step is a real token in every row
        if hidden_states.shape[1] == 1 and state is not None and ssm.applies(state):
            return ssm.step(hidden_states, A_log, B, C, D, compute_dt(dt, dt_bias, time_step_limit), state)
        return original(hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask=mask,
                        lengths=lengths)

    ssm_update.mlx_lane_original = original
    ssm_update.mlx_lane_path = "cuda"
    return ssm_update


def install(model) -> int:
    """Switch ``model``'s gated delta rule and Mamba-2 step to this room's kernels where they apply on this device;
    returns how many model modules were switched (0 on Metal, for a model without them, or after
    ``configure(False)``)."""
    if not _ON:
        return 0
    device = _device()
    if device == "metal":
        return 0
    from mlx_lm.models import gated_delta as mlx_gated_delta
    from mlx_lm.models import ssm as mlx_ssm

    if _CONV:  # before ``watch``: a watched convolution keeps the kernel
        conv.ENABLED, conv.OPS = device == "cuda", device == "cpu"
        conv.switch(model)
    switched = hook.switch(model, lambda fn: _gated_delta_dispatch(fn, device), name=GATED_DELTA,
                           original=mlx_gated_delta.gated_delta_update)
    if switched:
        positions.watch(model)
    if device == "cuda":
        switched += hook.switch(model, _ssm_dispatch, name=SSM, original=mlx_ssm.ssm_update)
    # not counted: an MoE layer computes mlx-lm's sums, read another way. Only when a knob asks (on the CPU too, so
    # that the zoo's live tests run the knobs against mlx-lm's text): at the defaults mlx-lm's own class stays, and a
    # later mlx-lm's SwitchGLU body with it
    if moe.SORT_MIN != moe.MLX_LM_SORT_MIN or moe.DENSE_MAX:
        moe.switch(model)
    return switched


def kernel_path(model) -> str:
    """What ``model``'s recurrent layers run: ``cuda`` (this room's CUDA kernels), ``chunked`` (the chunked form on
    the CPU), ``mlx`` (mlx-lm's own), ``none`` (no such layers), or ``mixed``."""
    fns = hook.switched_functions(model, GATED_DELTA) + hook.switched_functions(model, SSM)
    if not fns:
        return "none"
    paths = {getattr(fn, "mlx_lane_path", "mlx") for fn in fns}
    return paths.pop() if len(paths) == 1 else "mixed"


@contextmanager
def mlx_lm_kernels(model) -> Iterator[None]:
    """Within the block ``model``'s modules run mlx-lm's own functions (an oracle computes with them this way)."""
    undone = hook.restore(model, GATED_DELTA) + hook.restore(model, SSM)
    convolving, conv.ENABLED, conv.OPS = (conv.ENABLED, conv.OPS), False, False
    try:
        yield
    finally:
        conv.ENABLED, conv.OPS = convolving
        for module, ours in undone:
            setattr(module, getattr(ours, "__name__"), ours)
