"""models.kernels.moe on the CPU: a mixture-of-experts layer whose (token, expert) pairs are sorted from fewer of them
than mlx-lm sorts computes mlx-lm's outputs (float32: the CPU's gather_mm), for decode batches and prompt chunks,
gpt-oss's SwiGLU with biases and a plain SwitchMLP; ``switch`` gives exactly mlx-lm's classes the sorting call. Which
is faster is the device's question (bench/gpu_moe.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models import switch_layers
from mlx_lm.models.gpt_oss import MLPBlock, ModelArgs

from models import kernels
from models.kernels import moe

HIDDEN, EXPERTS, TOP = 64, 8, 4


def gpt_oss_block() -> MLPBlock:
    cfg = ModelArgs(model_type="gpt_oss", hidden_size=HIDDEN, intermediate_size=HIDDEN, num_local_experts=EXPERTS,
                    num_experts_per_tok=TOP, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                    head_dim=16, vocab_size=32)
    mx.random.seed(1)
    block = MLPBlock(cfg)
    block.update(tree_map(lambda a: mx.random.normal(a.shape) * 0.1, block.parameters()))
    return block


@pytest.fixture
def sort_min():
    """Restores moe.SORT_MIN after a test sets it."""
    saved = moe.SORT_MIN
    yield
    moe.SORT_MIN = saved


@pytest.mark.parametrize("rows,length", [(1, 1), (3, 1), (15, 1), (16, 1), (2, 7), (1, 40)])
@pytest.mark.parametrize("threshold", [1, 8, moe.MLX_LM_SORT_MIN])
def test_sorted_from_any_count_gives_mlx_lms_outputs(rows, length, threshold, sort_min):
    block = gpt_oss_block()
    x = mx.random.normal((rows, length, HIDDEN))
    want = block(x)
    assert type(block.experts) is switch_layers.SwitchGLU
    assert moe.switch(block) == 1
    assert type(block.experts) is moe.SortedSwitchGLU
    moe.SORT_MIN = threshold
    got = block(x)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_switch_mlp_sorts_from_the_threshold_and_computes_the_same(sort_min):
    mx.random.seed(2)
    layer = switch_layers.SwitchMLP(HIDDEN, 2 * HIDDEN, EXPERTS, bias=True)
    layer.update(tree_map(lambda a: mx.random.normal(a.shape) * 0.1, layer.parameters()))
    x = mx.random.normal((5, 1, HIDDEN))
    indices = mx.random.randint(0, EXPERTS, (5, 1, 2)).astype(mx.uint32)
    want = layer(x, indices)
    moe.switch(layer)
    assert type(layer) is moe.SortedSwitchMLP
    moe.SORT_MIN = 2
    assert mx.allclose(layer(x, indices), want, atol=1e-5).item()


def test_switch_leaves_other_classes_and_objects_without_modules_alone():
    class OwnGLU(switch_layers.SwitchGLU):  # a family's own subclass keeps its own call
        pass

    holder = nn.Module()
    holder.own = OwnGLU(HIDDEN, HIDDEN, EXPERTS)
    holder.plain = nn.Linear(HIDDEN, HIDDEN)
    assert moe.switch(holder) == 0
    assert type(holder.own) is OwnGLU
    assert moe.switch(object()) == 0


def test_configure_sets_the_threshold_and_keeps_it_at_least_one(sort_min):
    kernels.configure(True, moe_sort_min=8)
    assert moe.SORT_MIN == 8
    kernels.configure(True, moe_sort_min=0)
    assert moe.SORT_MIN == 1
    kernels.configure(True)
    assert moe.SORT_MIN == moe.MLX_LM_SORT_MIN
