"""models.mlx_compat: the private names of mlx-lm that mlx-lane relies on are all there, and mean what we use them
for. This test fails when an mlx-lm release renames or changes one of them: then models.mlx_compat (the one place
that names them) is what to fix. No module of ours outside it names one of them."""

from __future__ import annotations

import pathlib
import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from models import mlx_compat

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_private_name_is_there():
    assert mlx_compat.missing() == []


def kv(n: int, value: float = 1.0):
    return mx.full((1, 2, n, 4), value), mx.full((1, 2, n, 4), value)


def test_merge_caches_makes_left_padded_batch_caches_whose_write_index_is_the_longest_row():
    rows = []
    for n in (3, 5):
        c = KVCache()
        c.update_and_fetch(*kv(n))
        rows.append([c])
    (merged,) = mlx_compat.merge_caches(rows)
    assert type(merged) is BatchKVCache
    assert mlx_compat.batch_index(merged) == 5 and merged.left_padding.tolist() == [2, 0]
    assert mlx_compat.right_padding(merged) is None  # a decode step's cache: nothing pending


def test_the_ring_index_is_where_a_rotating_cache_writes_and_can_be_set():
    c = RotatingKVCache(max_size=4)
    c.update_and_fetch(*kv(3))
    assert mlx_compat.ring_index(c) == 3 == c.state[-1]  # cache.kvfile reads it through the public state
    mlx_compat.set_ring_index(c, 2)
    assert c.state[-1] == 2


def test_temporal_order_gives_a_wrapped_windows_positions_in_order():
    c = RotatingKVCache(max_size=4)
    for i in range(6):  # positions 0..5 one by one: the buffer holds 4, 5, 2, 3
        c.update_and_fetch(*kv(1, float(i)))
    ordered = mlx_compat.temporal_order(c, c.keys)
    assert ordered[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0]


def test_a_bpe_detokenizer_keeps_the_leading_space_when_told():
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    detok = BPEStreamingDetokenizer.__new__(BPEStreamingDetokenizer)
    detok.reset()
    assert detok._maybe_trim_space(" a") == "a"  # mlx-lm trims the first text's space
    mlx_compat.keep_leading_space(detok)
    assert detok._maybe_trim_space(" a") == " a"


@pytest.mark.parametrize("name", sorted({n for _, n in mlx_compat.NAMES}))
def test_no_module_of_ours_but_the_compat_module_names_them(name):
    pattern = re.compile(r"[.\s(]" + re.escape(name) + r"\b")
    offenders = []
    for package in ("server", "cache", "models", "spec"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "mlx_compat.py":
                continue
            for line in path.read_text().splitlines():
                code = line.split("#", 1)[0]
                if pattern.search(code) and "``" not in code:
                    offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert offenders == []


def _rope_forward_on_another_thread(module) -> str:
    """Apply `module.rope` on a new thread with its own stream, as the lane's thread does; 'ok' or the error."""
    import threading

    out: list[str] = []

    def run() -> None:
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                mx.eval(module.rope(mx.ones((1, 2, 3, 64)), offset=0))
            out.append("ok")
        except Exception as exc:  # the failure this test is about
            out.append(repr(exc))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_a_models_private_arrays_are_evaluated_at_load_so_the_lanes_thread_can_use_them():
    """YaRN's (gpt-oss) and Llama-3's RoPE keep `_freqs`, which `parameters()` leaves out: left lazy on the loading
    thread, the lane's thread cannot evaluate it ("There is no Stream(...) in current thread"): every request failed
    on the H200 once the KV price stopped running a forward on the loading thread."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import initialize_rope

    from models.runtime import evaluate_all_arrays

    class WithYarn(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = initialize_rope(64, 150000, False, {
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096, "truncate": False}, 131072)

    assert "Stream" in _rope_forward_on_another_thread(WithYarn())  # the failure, without the fix
    loaded = WithYarn()
    evaluate_all_arrays(loaded)
    assert _rope_forward_on_another_thread(loaded) == "ok"
