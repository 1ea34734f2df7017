"""cache.rates.CostModel: restore only when reading beats recomputing, with measured rates."""

from __future__ import annotations

import pytest

from cache.rates import CostModel

GB = 1_000_000_000


def test_priors_hold_until_measured():
    m = CostModel(prefill_tok_s=100.0, read_bytes_s=500e6)
    s = m.stats()
    assert (s["prefill_tok_s"], s["read_mb_s"], s["prefill_measured"], s["read_measured"]) == (100.0, 500.0, False,
                                                                                               False)
    # 1 GB at 500 MB/s = 2 s; 300 tokens at 100 tok/s = 3 s -> restore; 100 tokens = 1 s -> recompute
    assert m.should_restore(GB, 300) is True
    assert m.should_restore(GB, 100) is False


def test_slow_disk_recomputes_fast_disk_restores():
    # The H200 case from the design: 32k tokens of an 8B model prefill in 2.0 s, their 4.3 GB of KV read in 4.0 s.
    h200 = CostModel()
    h200.observe_prefill(32_768, 2.0)
    h200.observe_restore(int(4.3 * GB), 4.0)
    assert h200.should_restore(int(4.3 * GB), 32_768) is False
    fast = CostModel()
    fast.observe_prefill(32_768, 2.0)
    fast.observe_restore(int(4.3 * GB), 1.0)  # 4.3 GB/s
    assert fast.should_restore(int(4.3 * GB), 32_768) is True
    assert h200.stats()["decisions_recompute"] == 1 and fast.stats()["decisions_restore"] == 1


def test_injected_priors_decide_before_any_measurement():
    assert CostModel(prefill_tok_s=20_000, read_bytes_s=1e9).should_restore(4 * GB, 32_768) is False
    assert CostModel(prefill_tok_s=85, read_bytes_s=1e9).should_restore(100_000_000, 2_000) is True


def test_moving_average_follows_new_samples():
    m = CostModel(alpha=0.5)
    m.observe_prefill(100, 1.0)  # first sample replaces the prior
    assert m.stats()["prefill_tok_s"] == 100.0
    m.observe_prefill(300, 1.0)
    assert m.stats()["prefill_tok_s"] == 200.0
    m.observe_restore(GB, 1.0)
    m.observe_restore(3 * GB, 1.0)
    assert m.stats()["read_mb_s"] == 2000.0


@pytest.mark.parametrize("tokens,seconds", [(0, 1.0), (100, 0.0), (-5, 1.0)])
def test_degenerate_samples_are_ignored(tokens, seconds):
    m = CostModel(prefill_tok_s=42.0)
    m.observe_prefill(tokens, seconds)
    m.observe_restore(tokens, seconds)
    assert (m.stats()["prefill_tok_s"], m.stats()["prefill_measured"], m.stats()["read_measured"]) == (42.0, False,
                                                                                                       False)


def test_nothing_saved_never_restores():
    m = CostModel()
    assert m.should_restore(1, 0) is False
    assert m.stats()["decisions_recompute"] == 1


@pytest.mark.parametrize("kw", [{"prefill_tok_s": 0}, {"read_bytes_s": -1}, {"alpha": 0}, {"alpha": 1.5}])
def test_bad_parameters(kw):
    with pytest.raises(ValueError):
        CostModel(**kw)


def test_snapshot_carries_measured_rates_across_a_restart():
    from cache.rates import CostModel

    fresh = CostModel()
    assert fresh.snapshot() == {}  # priors are never persisted
    gpu = CostModel()
    gpu.observe_prefill(32768, 2.0)  # 16.4k tok/s
    gpu.observe_restore(int(4.3e9), 4.0)  # 1.07 GB/s
    restarted = CostModel.from_snapshot(gpu.snapshot())
    assert restarted.stats()["prefill_measured"] and restarted.stats()["read_measured"]
    # first decision after the restart: recompute 32k tokens (2.0 s) rather than read 4.3 GB (4.0 s)
    assert restarted.should_restore(int(4.3e9), 32768) is False
    assert CostModel().should_restore(int(4.3e9), 32768) is True  # what the priors alone would have done
    assert CostModel.from_snapshot({"prefill_tok_s": "x", "read_bytes_s": -1}).snapshot() == {}


def test_the_rates_file_round_trips_and_a_missing_or_broken_one_gives_the_priors(tmp_path):
    from cache.rates import load_cost_model, save_cost_model

    path = tmp_path / "rates" / "fp.json"
    assert load_cost_model(path).snapshot() == {}  # no file yet: the priors
    save_cost_model(path, CostModel())
    assert not path.exists()  # nothing measured: nothing written
    gpu = CostModel()
    gpu.observe_prefill(32768, 2.0)
    save_cost_model(path, gpu)
    assert load_cost_model(path, mode="never").snapshot() == gpu.snapshot()
    assert load_cost_model(path, mode="never").mode == "never"
    path.write_text("{not json")
    assert load_cost_model(path).snapshot() == {}


def test_mode_overrides_the_rule_but_rates_are_still_measured():
    # a read this slow never wins under "auto"; "always" restores anyway, "never" recomputes a sure win
    slow = {"prefill_tok_s": 1e6, "read_bytes_s": 1.0}
    assert CostModel(**slow).should_restore(10**9, 10) is False
    always = CostModel(**slow, mode="always")
    assert always.should_restore(10**9, 10) is True
    assert always.should_restore(10**9, 0) is False  # nothing to gain: never a restore
    never = CostModel(prefill_tok_s=1.0, read_bytes_s=1e12, mode="never")
    assert never.should_restore(1, 10**6) is False
    never.observe_restore(10**6, 0.5)
    assert never.stats()["read_measured"] and never.stats()["mode"] == "never"
    assert CostModel.from_snapshot({"prefill_tok_s": 5.0}, mode="always").mode == "always"
    with pytest.raises(ValueError):
        CostModel(mode="sometimes")
