"""bench/mtp_train.py's chained fit (issue 44 item 5): a head's depth-d entries, computed for every window position in
one forward (``chain_forward``), equal what inference computes drafting one position at a time on the head's own
caches (spec.mtp's ``draft_lazy``: the depth-1 entries up to the position, then the chain's), so the fit trains the
drafts the server makes. Tiny random targets with their MTP layer (tests.fixtures.zoo_mtp), float32: a qwen3_5 (a
Qwen-family head, mlx-vlm's layer) and a glm4_moe_lite (a DeepSeek-style head: the target's decoder layer, its
multi-head latent attention)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import mtp_train  # noqa: E402

from models.mtp.heads import DEEPSEEK, QWEN  # noqa: E402
from tests.fixtures import zoo_mtp  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_5", "glm4_moe_lite"])
def built(request):
    from models.mtp import tap

    model, head = zoo_mtp.build(request.param, vocab=97)
    assert head.family == (QWEN if request.param == "qwen3_5" else DEEPSEEK)
    return model, head, tap(model)


def _causal(n):
    return mx.tril(mx.ones((n, n), dtype=mx.bool_))[None, None]


def _window(model, t, n=14, seed=3):
    mx.random.seed(seed)
    s = mx.random.randint(0, 97, (1, n))
    logits = model(s)
    return s, t.last, mx.argmax(logits, axis=-1)


def test_each_chained_depth_equals_drafting_one_position_at_a_time(built):
    model, head, t = built
    s, h, a = _window(model, t)
    caches = head.make_caches()
    tok, hid = s[:, 1:-1], h[:, :-2]
    embed = head.embed
    out1 = mtp_train.SHAPES_FOR_TEST(head)(head.module, embed(tok), hid, caches, _causal(tok.shape[1]))
    L = out1.shape[1]
    e1 = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
    # the chain at once: depth 2 and 3 for every j, teacher-forced on the target's tokens
    out2, made2 = mtp_train.chain_forward(head.family, head.module, embed(a[:, 1: 1 + L]), out1, e1, [], 2)
    out3, _ = mtp_train.chain_forward(head.family, head.module, embed(a[:, 2: 2 + L]), out2, e1, [made2], 3)
    for j in (0, 3, L // 2, L - 2):
        # inference: the depth-1 entries of positions 0..j, then one entry per further draft
        kv = []
        for c in caches:
            k = KVCache()
            k.update_and_fetch(c.keys[..., : j + 1, :], c.values[..., : j + 1, :])
            kv.append(k)
        g2 = head.forward(a[:, j + 1: j + 2], out1[:, j: j + 1], kv, None)
        g3 = head.forward(a[:, j + 2: j + 3], g2, kv, None)
        assert mx.allclose(g2[0, 0], out2[0, j], atol=1e-4, rtol=1e-4).item(), j
        assert mx.allclose(g3[0, 0], out3[0, j], atol=1e-4, rtol=1e-4).item(), j


def test_the_chained_loss_trains_the_deeper_drafts(built):
    model, head, t = built
    (seq,) = mtp_train.continuations(model, [[5, 9, 2, 7]], 20)  # the target's greedy tokens after a prompt
    s = mx.array([seq])
    a = mx.argmax(model(s), axis=-1)
    h = t.last
    caches = head.make_caches()
    out1 = mtp_train.SHAPES_FOR_TEST(head)(head.module, head.embed(s[:, 1:-1]), h[:, :-2], caches,
                                           _causal(s.shape[1] - 2))
    loss = mtp_train.chain_losses(head.family, head.module, head.embed, head.logits, caches, s, a, out1, mx.float32,
                                  4)
    assert loss.item() > 0  # depths 2..4 of an untrained head are wrong somewhere
    # a window whose sequence never took the target's token has nothing to train beyond depth 1
    other = (a + 1) % 97
    assert mtp_train.chain_losses(head.family, head.module, head.embed, head.logits, caches, other, a, out1,
                                  mx.float32, 4).item() == 0.0


def test_a_mixture_of_experts_head_trains_alike_with_experts_gathered_or_dense():
    """``fit(..., experts="dense")`` (``bench/mtp_fit.py --fit-experts dense``) computes the head's experts without
    mlx's gather_mm, and its first step's gradient, group by group, is the gathered fit's (the same head, the same
    windows), and the module's rule is restored after."""
    from types import SimpleNamespace

    from models.kernels import moe
    from models.mtp import tap

    rule = moe.DENSE_MAX
    norms, heads = {}, {}
    for experts in ("gather", "dense"):
        model, head = zoo_mtp.build("glm4_moe_lite", vocab=97)
        sequences = mtp_train.continuations(model, [[5, 9, 2, 7], [3, 1, 4, 1]], 24)
        got = mtp_train.fit(SimpleNamespace(model=model), head, tap(model), sequences, steps=1, depth=2, batch=2,
                            experts=experts)
        assert got["experts"] == experts and got.get("expert_layers_dense", 1) >= 1
        norms[experts], heads[experts] = got["grad_norms"], head
    assert heads["dense"] is not heads["gather"]
    experts_groups = [k for k in norms["gather"] if "switch_mlp" in k]
    assert experts_groups and all(norms["gather"][k] > 0 for k in experts_groups)
    assert norms["dense"].keys() == norms["gather"].keys()
    for k, v in norms["gather"].items():
        assert abs(norms["dense"][k] - v) <= 1e-4 * max(1.0, v), (k, v, norms["dense"][k])
    assert moe.DENSE_MAX == rule
