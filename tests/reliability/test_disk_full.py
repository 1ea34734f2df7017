"""The SSD cache directory fills up mid-run, then gets its space back: serving never stops, the failures are counted,
no temp file is left behind, and writes succeed again afterwards. A real uvicorn on a tiny random llama with the
default model's tokenizer (the ``tiny_llama_dir`` fixture, tests/conftest.py): what is checked is the SSD tier's
behaviour, not the text.

Two ways to fill it:
  * a real full disk: a small tmpfs mounted as --ssd-cache and filled with a file (needs root and a kernel that lets
    this process mount; skipped with the reason otherwise);
  * MLX_LANE_TEST_DISK_FULL (test seam, tests/seamed_server.py): while a flag file exists, every SSD write fails with
    ENOSPC after writing its temp file. Runs where the real one cannot (the same checks: one of the two runs).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny_models import MECHANICS_FLAGS
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a careful assistant for a software engineering team."}
# a write that fails is still tried 4 times before it is abandoned, without the product's 2.6 s of waits between the
# tries (tests/seamed_server.py), which each of the two flushes of a full disk below sat through
NO_WAITS = {"MLX_LANE_TEST_RETRY_BACKOFF": "0,0,0"}


def conversation(topic: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"In one sentence: what is {topic}?"}]


def chat(url: str, messages: list) -> tuple[str, int]:
    r = httpx.post(url + "/v1/chat/completions", timeout=300,
                   json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj["choices"][0]["message"]["content"], obj["usage"]["prompt_tokens_details"]["cached_tokens"]


def flush(url: str) -> httpx.Response:
    return httpx.post(url + "/admin/cache/flush", params={"timeout": 60}, timeout=120)


def ssd(url: str) -> dict:
    return httpx.get(url + "/stats").json()["ssd_cache"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def serve_through_a_full_disk(srv: ServerProc, kv: Path, fill, free) -> None:
    """The scenario both tests share; `fill()` takes the space away, `free()` gives it back."""
    first = conversation("a mutex")
    text1, _ = chat(srv.url, first)  # the server's first request: a cold answer
    assert flush(srv.url).status_code == 200  # writes work before the disk fills
    before = ssd(srv.url)
    # exactly one: a CI run once counted 3 here, the flush's sync having indexed the file the writer was renaming,
    # which the writer then deleted as an ancestor of itself (tests/unit/test_ssd_store.py has that race alone)
    assert before["writes"] == 1 and before["failed"] == 0 and before["pending"] == 0, before

    fill()
    second = conversation("a semaphore")
    text2, _ = chat(srv.url, second)
    r = flush(srv.url)  # waits out the writer's retries (4 attempts)
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_durable", r.text
    full = ssd(srv.url)
    assert full["errors"].get("ENOSPC", 0) >= 1 and full["failed"] >= 1, full
    assert full["writes_abandoned"] >= 1 and full["writes"] == before["writes"], full
    assert metric(srv.url, "mlx_lane:ssd_cache_failed_total") == full["failed"]
    assert list(kv.rglob("*.tmp")) == []
    again1, cached1 = chat(srv.url, first)  # serving goes on, from RAM
    again2, cached2 = chat(srv.url, second)
    assert (again1, again2) == (text1, text2) and cached1 > 0 and cached2 > 0
    assert httpx.post(srv.url + "/admin/cache/clear").status_code == 200
    cold2, cached = chat(srv.url, second)  # RAM cleared and no file of it: recomputed (bar the shared prefix)
    assert cached < cached2 and cold2 == text2
    assert flush(srv.url).status_code == 503  # its write failed too; the writer is idle again

    free()
    failed = ssd(srv.url)["failed"]
    chat(srv.url, first)  # back in RAM (restored from its file), then
    chat(srv.url, second)  # written again now that there is room
    third, _ = chat(srv.url, conversation("a deadlock"))
    assert third
    r = flush(srv.url)
    assert r.status_code == 200 and r.json() == {"durable": True}, r.text
    after = ssd(srv.url)
    assert after["writes"] >= before["writes"] + 2 and after["failed"] == failed, after
    assert list(kv.rglob("*.tmp")) == []


def test_disk_full_seam_keeps_serving_counts_failures_and_recovers(tmp_path, tiny_llama_dir):
    probe = tmp_path / "probe"
    if _mount_tmpfs(probe, "1m") is None:  # the same run on a real full disk is possible here: it is the one run
        subprocess.run(["umount", str(probe)], check=True, timeout=60)
        pytest.skip("a real full disk is tested here (test_real_full_disk_tmpfs_keeps_serving_counts_failures_and_"
                    "recovers); the seam stands in for it where mounting is not permitted")
    kv, flag = tmp_path / "kv", tmp_path / "disk-full"
    # the cap pinned as in the tmpfs test: the default (25% of the free space at start) depends on the machine's
    # disk, and a small one evicts (and rewrites) entries instead of filling up
    srv = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--ssd-cache", str(kv),
                     "--ssd-cache-bytes", "1G", "--write-behind-debounce", "0.05",
                     env={"MLX_LANE_TEST_DISK_FULL": str(flag), **NO_WAITS})
    try:
        serve_through_a_full_disk(srv, kv, fill=flag.touch, free=flag.unlink)
    finally:
        assert srv.stop() == 0, srv.log()


def _mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs at `path`; None when it worked, else why not."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    path.mkdir(parents=True)
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    return None if out.returncode == 0 else f"mount not permitted here: {out.stderr.strip() or out.returncode}"


def _fill(path: Path) -> None:
    """Write `path` until the file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == 28, exc  # ENOSPC
    assert os.statvfs(path.parent).f_bavail == 0


def test_real_full_disk_tmpfs_keeps_serving_counts_failures_and_recovers(tmp_path, tiny_llama_dir):
    kv = tmp_path / "kv"
    why = _mount_tmpfs(kv, "16m")  # room for entries; the filler takes every byte left
    if why:
        pytest.skip(f"no real full disk to test on: {why}")
    filler = kv / "filler"
    try:
        # a cap above the file system's size: the disk fills up, not the cap (the default, 25% of the free
        # space at start, would evict instead)
        srv = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--ssd-cache", str(kv),
                         "--ssd-cache-bytes", "1G", "--write-behind-debounce", "0.05", env=NO_WAITS)
        try:
            serve_through_a_full_disk(srv, kv, fill=lambda: _fill(filler), free=filler.unlink)
        finally:
            assert srv.stop() == 0, srv.log()
    finally:
        subprocess.run(["umount", str(kv)], check=True, timeout=60)
