"""server.device_memory: the card's used memory and the memory pool's reserved / used bytes, read from the CUDA
driver through ctypes. CI has no GPU: the driver here is a stand-in that answers as libcuda does (status 0, values
written through the pointers it is handed), so the ctypes plumbing and the arithmetic run; on the CPU ``driver()`` is
None and every reading is None."""

from __future__ import annotations

import ctypes

from server import device_memory

GB = 10**9


class FakeDriver:
    """libcuda's calls the module makes; ``fail`` names one that answers an error status."""

    def __init__(self, free=20 * GB, total=85 * GB, reserved=60 * GB, used=50 * GB, fail=""):
        self.free, self.total, self.fail = free, total, fail
        self.attrs = {4: 0, 5: reserved, 6: reserved + 1, 7: used, 8: used + 1}
        self.trimmed_to = None
        self.bound = 0

    def _status(self, name):
        return 1 if name == self.fail else 0

    def cuInit(self, flags):
        return self._status("cuInit")

    def cuDeviceGet(self, dev, ordinal):
        dev._obj.value = ordinal
        return self._status("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        ctx._obj.value = 1234
        return self._status("cuDevicePrimaryCtxRetain")

    def cuDeviceGetDefaultMemPool(self, pool, dev):
        pool._obj.value = 5678
        return self._status("cuDeviceGetDefaultMemPool")

    def cuCtxSetCurrent(self, ctx):
        self.bound += 1
        return self._status("cuCtxSetCurrent")

    def cuMemGetInfo_v2(self, free, total):
        free._obj.value, total._obj.value = self.free, self.total
        return self._status("cuMemGetInfo_v2")

    def cuMemPoolGetAttribute(self, pool, attr, value):
        assert pool.value == 5678
        value._obj.value = self.attrs[attr]
        return self._status("cuMemPoolGetAttribute")

    def cuDeviceGetGraphMemAttribute(self, dev, attr, value):
        value._obj.value = {0: 1 * GB, 2: 2 * GB, 3: 3 * GB}[attr]
        return self._status("cuDeviceGetGraphMemAttribute")

    def cuDeviceGraphMemTrim(self, dev):
        self.graphs_trimmed = True
        return self._status("cuDeviceGraphMemTrim")

    def cuMemPoolSetAttribute(self, pool, attr, value):
        assert pool.value == 5678
        self.attrs[attr] = value._obj.value
        return self._status("cuMemPoolSetAttribute")

    def cuMemPoolTrimTo(self, pool, keep):
        self.trimmed_to = keep.value if isinstance(keep, ctypes.c_size_t) else keep
        return self._status("cuMemPoolTrimTo")


def test_a_snapshot_splits_the_card_into_the_pool_and_what_lies_outside_it():
    fake = FakeDriver()
    snap = device_memory.snapshot(device_memory.DeviceMemory(fake))
    assert snap == {"used_bytes": 65 * GB, "total_bytes": 85 * GB, "pool_reserved_bytes": 60 * GB,
                    "pool_used_bytes": 50 * GB, "pool_reserved_high_bytes": 60 * GB + 1,
                    "pool_used_high_bytes": 50 * GB + 1, "pool_keep_bytes": 0, "outside_pool_bytes": 5 * GB,
                    "graph_reserved_bytes": 2 * GB, "graph_reserved_high_bytes": 3 * GB, "graph_used_bytes": 1 * GB}
    assert fake.bound >= 5  # every call binds MLX's primary context to the calling thread first


def test_trim_asks_the_driver_to_keep_what_it_is_told():
    fake = FakeDriver()
    assert device_memory.DeviceMemory(fake).trim_pool(3 * GB) is True
    assert fake.trimmed_to == 3 * GB and fake.graphs_trimmed


def test_the_pool_is_told_how_much_freed_memory_to_keep():
    fake = FakeDriver()
    dm = device_memory.DeviceMemory(fake)
    assert dm.set_release_threshold(8 * GB) is True
    assert fake.attrs[4] == 8 * GB  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, a 64-bit value handed by pointer
    assert dm.pool(4) == 8 * GB
    assert device_memory.DeviceMemory(FakeDriver(fail="cuMemPoolSetAttribute")).set_release_threshold(1) is False
    assert device_memory.DeviceMemory(FakeDriver(fail="cuDeviceGetDefaultMemPool")).set_release_threshold(1) is False


def test_a_driver_without_pools_still_reads_the_card():
    snap = device_memory.snapshot(device_memory.DeviceMemory(FakeDriver(fail="cuDeviceGetDefaultMemPool")))
    assert snap["used_bytes"] == 65 * GB and snap["pool_reserved_bytes"] is None
    assert snap["outside_pool_bytes"] is None


def test_a_failed_card_reading_is_no_snapshot():
    assert device_memory.snapshot(device_memory.DeviceMemory(FakeDriver(fail="cuMemGetInfo_v2"))) is None
    assert device_memory.DeviceMemory(FakeDriver(fail="cuCtxSetCurrent")).trim_pool() is False


def test_on_the_cpu_there_is_no_driver_and_trimming_only_empties_mlxs_cache():
    device_memory.driver.cache_clear()
    assert device_memory.driver() is None
    assert device_memory.snapshot() is None
    assert device_memory.trim_pool() is False
