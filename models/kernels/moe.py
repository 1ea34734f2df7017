"""How a mixture-of-experts layer reads its experts: (token, expert) pairs sorted by expert from fewer pairs than
mlx-lm sorts them, or, for a few tokens, every expert computed for every token.

mlx-lm's ``SwitchGLU`` and ``SwitchMLP`` (every MoE family: gpt-oss, Qwen3-MoE, DeepSeek, GLM, Mixtral...) multiply
each pair with ``mx.gather_mm``, and sort the pairs by expert first only from 64 of them on (``indices.size >= 64``:
16 decode rows of 4 experts a token). On CUDA, mlx 0.32's ``GatherMM`` runs a one-token pair that is not sorted as
its own matrix-vector product (``gather_mv``: every pair reads its expert's whole weights, so two rows routed to one
expert read it twice), and sorted ones as ``gather_mm_rhs`` (each expert's weights read once for the run of pairs
routed to it). A decode step is bound by those reads: 15 gpt-oss rows give 60 pairs over ~28 distinct experts, so
unsorted they read about twice the bytes that sorted they would (~3.0 vs ~1.4 GB a layer).

``SortedSwitchGLU`` / ``SortedSwitchMLP`` are mlx-lm's classes whose call sorts from ``SORT_MIN`` pairs on (mlx-lm's
body otherwise, its own ``_gather_sort`` / ``_scatter_unsort``), and, for a call of at most ``DENSE_MAX`` tokens over
plain (not quantized) experts, computes every expert for every token as batched matrix products and takes each
token's own (no gather at all: a small decode batch touches most experts anyway, 87% of gpt-oss's 32 at 15 rows).
``switch(model)`` gives a model's switch layers that class (the weights stay where they are). Sorted, unsorted and
dense products are the same sums in other kernels, so the outputs agree to the dtype's rounding, not bit for bit (as
in mlx-lm itself between a batch of 15 rows and one of 16). ``models.kernels.install`` switches them on CUDA and the
CPU when a knob differs from mlx-lm's rule (at the defaults mlx-lm's class stays: a later mlx-lm's body with it);
on the CPU the three came out bit-identical in float32, and the zoo's live gpt-oss server runs dense and sorted calls
against mlx-lm's text; ``bench/gpu_moe.py`` times them on the device.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import switch_layers

__all__ = ["SortedSwitchGLU", "SortedSwitchMLP", "switch", "expert_path", "SORT_MIN", "MLX_LM_SORT_MIN", "DENSE_MAX"]

MLX_LM_SORT_MIN = 64  # mlx-lm 0.32's rule: ``indices.size >= 64``
# Pairs from which a call sorts (set by models.kernels.configure: --debug-moe-sort-min; 64 = mlx-lm's rule)
SORT_MIN = MLX_LM_SORT_MIN
# Tokens up to which a call over plain experts computes them all densely (--debug-moe-dense-max; 0: never)
DENSE_MAX = 0


def _sorted_input(x: mx.array, indices: mx.array):
    """``(x, indices, inverse order or None, sorted)``: the pairs sorted by expert when there are ``SORT_MIN`` or more
    (mlx-lm's own ``_gather_sort``), else as they came."""
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    if indices.size >= SORT_MIN:
        return (*switch_layers._gather_sort(x, indices), True)
    return x, indices, None, False


def _unsorted_output(x: mx.array, inv_order, shape) -> mx.array:
    if inv_order is not None:
        x = switch_layers._scatter_unsort(x, inv_order, shape)
    return x.squeeze(-2)


def _dense_applies(indices: mx.array, *layers) -> bool:
    """A call of at most DENSE_MAX tokens whose projections are all plain ``SwitchLinear`` (not quantized, no LoRA)."""
    tokens = indices.size // indices.shape[-1] if indices.ndim else 0
    return 0 < tokens <= DENSE_MAX and all(type(layer) is switch_layers.SwitchLinear for layer in layers)


def _every_expert(layer, h: mx.array) -> mx.array:
    """``h`` (1 or E, T, in) through every expert of ``layer``: (E, T, out), with its bias."""
    y = mx.matmul(h, layer.weight.swapaxes(-1, -2))
    return y + mx.expand_dims(layer.bias, 1) if "bias" in layer else y


def _take_routed(y: mx.array, indices: mx.array) -> mx.array:
    """From every expert's output (E, T, H), each token's routed ones, shaped ``indices.shape + (H,)``."""
    k = indices.shape[-1]
    routed = mx.take_along_axis(y.transpose(1, 0, 2), indices.reshape(-1, k)[..., None], axis=1)
    return routed.reshape(*indices.shape, y.shape[-1])


class SortedSwitchGLU(switch_layers.SwitchGLU):
    def __call__(self, x, indices) -> mx.array:
        if _dense_applies(indices, self.up_proj, self.gate_proj, self.down_proj):
            h = x.reshape(1, -1, x.shape[-1])
            h = self.activation(_every_expert(self.up_proj, h), _every_expert(self.gate_proj, h))
            return _take_routed(_every_expert(self.down_proj, h), indices)
        x, idx, inv_order, do_sort = _sorted_input(x, indices)
        x_up = self.up_proj(x, idx, sorted_indices=do_sort)
        x_gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        x = self.down_proj(self.activation(x_up, x_gate), idx, sorted_indices=do_sort)
        return _unsorted_output(x, inv_order, indices.shape)


class SortedSwitchMLP(switch_layers.SwitchMLP):
    def __call__(self, x, indices) -> mx.array:
        if _dense_applies(indices, self.fc1, self.fc2):
            h = self.activation(_every_expert(self.fc1, x.reshape(1, -1, x.shape[-1])))
            return _take_routed(_every_expert(self.fc2, h), indices)
        x, idx, inv_order, do_sort = _sorted_input(x, indices)
        x = self.fc2(self.activation(self.fc1(x, idx, sorted_indices=do_sort)), idx, sorted_indices=do_sort)
        return _unsorted_output(x, inv_order, indices.shape)


_SORTED = {switch_layers.SwitchGLU: SortedSwitchGLU, switch_layers.SwitchMLP: SortedSwitchMLP}


def switch(model) -> int:
    """Give ``model``'s ``SwitchGLU`` / ``SwitchMLP`` modules (exactly those classes: a family's own subclass keeps its
    call) the sorting class; returns how many."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return 0
    switched = 0
    for m in modules():
        cls = _SORTED.get(type(m))
        if cls is not None:
            m.__class__ = cls
            switched += 1
    return switched


def expert_path(model) -> str:
    """How ``model``'s mixture-of-experts layers read their experts (/stats ``lane.experts``): ``none`` (no such
    layer), ``mlx`` (mlx-lm's own classes: sorted from 64 pairs), or this module's rule, ``sort>=N`` or
    ``dense<=D,sort>=N``."""
    modules = getattr(model, "modules", None)
    kinds = {type(m) for m in modules()} if modules is not None else set()
    if kinds & set(_SORTED.values()):
        return (f"dense<={DENSE_MAX}," if DENSE_MAX else "") + f"sort>={SORT_MIN}"
    return "mlx" if kinds & set(_SORTED) else "none"
