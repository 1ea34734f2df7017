"""--debug-keep-prefill-buffers (server.engine.prefill.KEEP_BUFFERS): a gathered prefill forward hands MLX's freed
buffers back (mlx-lm's ``PromptProcessingBatch`` calls ``mx.clear_cache`` after its step and after rolling the padding
away) unless the knob keeps them; either way the rows' caches are the same, and ``mx.clear_cache`` is itself again
afterwards."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from server.engine import prefill
from tests.fixtures.tiny_models import tiny_llama


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: calls.append(1) or real())
    return calls


def gathered(model):
    rows = []
    for p in (list(range(10, 30)), list(range(40, 47))):
        caches = make_prompt_cache(model)
        model(mx.array(p)[None], cache=caches)
        mx.eval([c.state for c in caches])
        rows.append(caches)
    out = prefill.forward_together(model, rows, [[5, 6, 7], [8]])  # right-padded: the padding rolled away after
    return [[(c.keys[..., : c.offset, :], c.offset) for c in row] for row in out]


@pytest.mark.parametrize("keep", [False, True])
def test_a_gathered_forward_hands_buffers_back_unless_kept_and_computes_the_same(counted, monkeypatch, keep):
    model = tiny_llama(seed=3)
    want = gathered(model)
    counted.clear()
    counter = mx.clear_cache
    monkeypatch.setattr(prefill, "KEEP_BUFFERS", keep)
    got = gathered(model)
    assert (len(counted) == 0) == keep and (keep or len(counted) >= 2), counted
    assert mx.clear_cache is counter  # put back after the forward, not left as the knob's no-op
    for row_w, row_g in zip(want, got):
        for (kw, ow), (kg, og) in zip(row_w, row_g):
            assert ow == og and mx.array_equal(kw, kg).item()


def test_the_knob_is_set_by_configure():
    try:
        prefill.configure(keep_buffers=True)
        assert prefill.KEEP_BUFFERS is True
    finally:
        prefill.configure()
    assert prefill.KEEP_BUFFERS is False
