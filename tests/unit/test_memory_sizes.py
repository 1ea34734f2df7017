"""server.sizes: the RAM tier's default cap against the memory budget; allocator_limits / apply_allocator_limits: on a CUDA GPU MLX's allocator gives its cache of freed
buffers back at the admission budget and keeps that cache small; on the CPU (and Metal) nothing is set. The CUDA
branch runs here against a stand-in for ``mlx.core`` that records the calls (CI has no GPU)."""

from __future__ import annotations

import types

import mlx.core as mx

from server import device_memory, sizes

GB = 10**9


def test_the_limit_is_the_budget_and_the_cache_a_twentieth_of_the_card():
    assert sizes.allocator_limits(72 * GB, 80 * GB) == (72 * GB, 4 * GB)
    # --memory-budget 0 (admission unchecked): MLX still gives its cache back at the CUDA share of the card
    assert sizes.allocator_limits(0, 80 * GB) == (48 * GB, 4 * GB)
    # a small card keeps a cache of at least 1 GiB
    assert sizes.allocator_limits(7 * GB, 8 * GB)[1] == 1 << 30


def test_nothing_is_set_on_the_cpu():
    before = mx.get_memory_limit()
    assert sizes.apply_allocator_limits(1 << 30) is None
    assert mx.get_memory_limit() == before


def test_on_cuda_both_limits_reach_mlx(monkeypatch):
    calls = {}
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_available=lambda: True), gpu="gpu", default_device=lambda: "gpu",
        set_memory_limit=lambda n: calls.setdefault("memory", n), set_cache_limit=lambda n: calls.setdefault("cache", n))
    monkeypatch.setattr(mx, "cuda", fake.cuda, raising=False)
    monkeypatch.setattr(mx, "gpu", fake.gpu)
    monkeypatch.setattr(mx, "default_device", fake.default_device)
    monkeypatch.setattr(mx, "set_memory_limit", fake.set_memory_limit)
    monkeypatch.setattr(mx, "set_cache_limit", fake.set_cache_limit)
    monkeypatch.setattr(sizes, "device_memory", lambda: (80 * GB, "device memory_size"))
    monkeypatch.setattr(sizes, "CACHE_LIMIT_SET", None)
    got = sizes.apply_allocator_limits(70 * GB)
    assert got == {"limit_bytes": 70 * GB, "cache_limit_bytes": 4 * GB, "pool_keep_bytes": None}
    assert calls == {"memory": 70 * GB, "cache": 4 * GB} and sizes.CACHE_LIMIT_SET == 4 * GB

    # --cuda-pool-keep reaches the driver's pool; where the driver refuses, the answer says nothing was kept
    kept = []
    driver = types.SimpleNamespace(set_release_threshold=lambda n: kept.append(n) or True)
    monkeypatch.setattr(device_memory, "driver", lambda: driver)
    assert sizes.apply_allocator_limits(70 * GB, pool_keep_bytes=8 * GB)["pool_keep_bytes"] == 8 * GB
    assert kept == [8 * GB]
    driver.set_release_threshold = lambda n: False
    assert sizes.apply_allocator_limits(70 * GB, pool_keep_bytes=8 * GB)["pool_keep_bytes"] is None


def test_the_ram_tier_default_is_half_of_what_the_budget_leaves_beside_the_weights(monkeypatch):
    monkeypatch.setattr(sizes, "device_memory", lambda: (80 * GB, "device memory_size"))
    assert sizes.default_cache_bytes(16 * GB) == 28 * GB  # Metal: 90% of the card, less the weights, halved
    assert sizes.default_cache_bytes(16 * GB, 60 * GB) == 22 * GB  # --memory-budget 60G
    assert sizes.default_cache_bytes(16 * GB, 120 * GB) == 28 * GB  # a budget never raises it
    assert sizes.default_cache_bytes(16 * GB, 17 * GB) == 1 << 30  # at least 1 GiB
    monkeypatch.setattr(sizes, "device_memory", lambda: (32 * GB, "physical RAM"))
    monkeypatch.setattr(sizes, "physical_ram", lambda: 64 * GB)
    assert sizes.default_cache_bytes(1 * GB) == 8 << 30  # the CPU: min(8 GiB, a quarter of RAM)
    assert sizes.default_cache_bytes(1 * GB, 9 * GB) == 4 * GB


def test_on_cuda_the_default_budget_leaves_room_for_the_memory_pools_slack(monkeypatch):
    monkeypatch.setattr(sizes, "device_memory", lambda: (80 * GB, "device memory_size"))
    monkeypatch.setattr(sizes, "on_cuda", lambda: True)
    assert sizes.gpu_budget_share() == 0.60
    assert sizes.default_memory_budget() == (48 * GB, "60% of device memory_size")
    assert sizes.default_cache_bytes(16 * GB) == 16 * GB  # (48 - 16) / 2
    monkeypatch.setattr(sizes, "on_cuda", lambda: False)  # Metal keeps 90%
    assert sizes.default_memory_budget() == (72 * GB, "90% of device memory_size")


def test_on_cuda_the_defaults_leave_out_what_other_processes_hold(monkeypatch):
    monkeypatch.setattr(sizes, "device_memory", lambda: (80 * GB, "device memory_size"))
    monkeypatch.setattr(sizes, "on_cuda", lambda: True)
    reading = {"outside_pool_bytes": 1 * GB}
    monkeypatch.setattr(device_memory, "snapshot", lambda: reading)
    # this process's own context and workspaces (up to OWN_OUTSIDE_POOL) are not another process's
    assert sizes.memory_of_others() == 0
    assert sizes.default_memory_budget() == (48 * GB, "60% of device memory_size")
    # another process holds 30 GB beside our 2 GiB: 60% of the 50 GB left
    reading["outside_pool_bytes"] = 30 * GB + sizes.OWN_OUTSIDE_POOL
    assert sizes.memory_of_others() == 30 * GB
    budget, why = sizes.default_memory_budget()
    assert budget == 30 * GB and "less 27.9 GiB other processes hold on the card" in why
    assert sizes.default_cache_bytes(16 * GB) == 7 * GB  # (30 - 16) / 2
    # a rank of mlx.launch computes on its own card, not the one the driver is read on: nothing is left out
    monkeypatch.setenv("MLX_RANK", "1")
    assert sizes.memory_of_others() == 0
    monkeypatch.delenv("MLX_RANK")
    # the driver says nothing (or there is none): nothing is left out
    monkeypatch.setattr(device_memory, "snapshot", lambda: None)
    assert sizes.memory_of_others() == 0
    monkeypatch.setattr(sizes, "on_cuda", lambda: False)
    monkeypatch.setattr(device_memory, "snapshot", lambda: reading)
    assert sizes.memory_of_others() == 0  # Metal and the CPU never ask a CUDA driver
