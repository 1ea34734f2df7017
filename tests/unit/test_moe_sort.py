"""models.kernels.moe on the CPU: a mixture-of-experts layer whose (token, expert) pairs are sorted from fewer of them
than mlx-lm sorts computes mlx-lm's outputs (float32: the CPU's gather_mm), for decode batches and prompt chunks,
gpt-oss's SwiGLU with biases and a plain SwitchMLP; so does one that computes every expert for every token (dense) up
to its token count, never over quantized experts; ``switch`` gives exactly mlx-lm's classes the sorting call. Which
is faster is the device's question (bench/gpu_moe.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map
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
    """Restores moe.SORT_MIN and moe.DENSE_MAX after a test sets them."""
    saved = moe.SORT_MIN, moe.DENSE_MAX
    yield
    moe.SORT_MIN, moe.DENSE_MAX = saved


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


@pytest.mark.parametrize("rows,length", [(1, 1), (4, 1), (15, 1), (2, 3)])
def test_every_expert_for_every_token_gives_mlx_lms_outputs(rows, length, sort_min):
    block = gpt_oss_block()
    x = mx.random.normal((rows, length, HIDDEN))
    want = block(x)
    moe.switch(block)
    moe.DENSE_MAX = rows * length
    assert moe._dense_applies(mx.zeros((rows, length, TOP)), block.experts.up_proj)
    got = block(x)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


def test_every_expert_for_every_token_trains_as_mlx_lms_sorted_gather(sort_min):
    """bench/mtp_train.py fits a mixture-of-experts MTP head dense (``--fit-experts dense``) to keep mlx's GatherMM
    gradient out of it: the dense call's gradient, experts and router alike, is mlx-lm's sorted gather_mm's (a
    training window: 2 x 40 tokens, 320 pairs, past mlx-lm's sort threshold)."""
    block = gpt_oss_block()
    x = mx.random.normal((2, 40, HIDDEN))
    target = mx.random.normal((2, 40, HIDDEN))

    def loss(module, x):
        return ((module(x) - target) ** 2).mean()

    grad = nn.value_and_grad(block, loss)
    want_loss, want = grad(block, x)
    moe.switch(block)
    moe.DENSE_MAX = 1 << 30
    got_loss, got = nn.value_and_grad(block, loss)(block, x)
    assert abs(got_loss.item() - want_loss.item()) < 1e-5
    flat_want, flat_got = dict(tree_flatten(want)), dict(tree_flatten(got))
    assert flat_want.keys() == flat_got.keys()
    assert any("experts" in k for k in flat_want)
    for k, w in flat_want.items():
        assert mx.abs(w).max().item() > 0, k  # every part trains
        assert mx.allclose(flat_got[k], w, atol=1e-5, rtol=1e-4).item(), k


def test_dense_stays_off_past_its_tokens_and_for_quantized_experts(sort_min):
    block = gpt_oss_block()
    moe.switch(block)
    moe.DENSE_MAX = 4
    indices = mx.zeros((5, 1, TOP))
    assert not moe._dense_applies(indices, block.experts.up_proj)
    assert moe._dense_applies(indices[:4], block.experts.up_proj)
    nn.quantize(block, group_size=32, bits=8, class_predicate=lambda _, m: hasattr(m, "to_quantized"))
    assert type(block.experts.up_proj) is not switch_layers.SwitchLinear
    assert not moe._dense_applies(indices[:4], block.experts.up_proj)
    x = mx.random.normal((4, 1, HIDDEN))
    assert block(x).shape == (4, 1, HIDDEN)  # the gathered (quantized) path


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
    moe.DENSE_MAX = 5  # every expert for these 5 tokens
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
    kernels.configure(True, moe_dense_max=16)
    assert moe.DENSE_MAX == 16
    kernels.configure(True)
    assert (moe.SORT_MIN, moe.DENSE_MAX) == (moe.MLX_LM_SORT_MIN, 0)


MOE_ZOO = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe", "granitemoehybrid")


@pytest.mark.parametrize("name", MOE_ZOO)
def test_every_moe_family_of_the_zoo_computes_its_logits_whatever_the_setting(name, sort_min):
    """The tiny zoo model of each MoE family (tests.fixtures.zoo, float32): a prompt and a batch of three one-token
    rows give the same logits with mlx-lm's rule, everything sorted, and everything dense."""
    from tests.fixtures import zoo

    model = zoo.build(name)
    assert moe.switch(model) > 0  # every family's experts are mlx-lm's SwitchGLU
    prompt, rows = mx.array([[5, 17, 3, 99, 42, 7, 64, 1, 200, 31, 8, 12]]), mx.array([[9], [77], [150]])
    outputs = {}
    for setting, rule in {"mlx_lm": (moe.MLX_LM_SORT_MIN, 0), "sorted": (1, 0), "dense": (1, 64)}.items():
        moe.SORT_MIN, moe.DENSE_MAX = rule
        outputs[setting] = (model(prompt), model(rows))
        mx.eval(outputs[setting])
    # float32 sums in another order: equal with the wheel's own BLAS, but OpenBLAS (the pytest-xdist workers preload
    # it, as the servers do) computes "dense"'s one product per expert otherwise than the gathered ones: qwen3_next's
    # logits (up to 19) moved by 1.2e-4 on an AMD EPYC. A wrong expert or weight moves them by whole units.
    for setting in ("sorted", "dense"):
        for got, want in zip(outputs[setting], outputs["mlx_lm"]):
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-3).item(), (name, setting)


def test_the_expert_path_says_how_a_model_reads_its_experts(sort_min):
    from tests.fixtures import zoo

    assert moe.expert_path(zoo.build("llama")) == "none"
    model = zoo.build("gpt_oss")
    assert moe.expert_path(model) == "mlx"  # mlx-lm's own classes: its rule
    moe.switch(model)
    moe.SORT_MIN, moe.DENSE_MAX = 8, 0
    assert moe.expert_path(model) == "sort>=8"
    moe.DENSE_MAX = 16
    assert moe.expert_path(model) == "dense<=16,sort>=8"
    assert moe.expert_path(object()) == "none"
