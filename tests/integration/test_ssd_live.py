"""The SSD tier on the real default model through live servers: restart, crash mid-write, corrupt files, an
unwritable dir, the flush endpoint, writes held while the lane is busy (--ssd-write-when idle). Texts are compared
with a cold server (RAM tier only, cleared each time)."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a careful assistant for a software engineering team."}
TURNS = ["What is a mutex?", "And a semaphore?", "Which one should I use for a connection pool?"]


# 4 tokens a reply (it was 8): the first is read off the restored (or recomputed) KV and three more decoded past it,
# compared with the cold text token for token, as tests/reliability/test_kill_ssd.py does
def chat(url, messages, max_tokens=4):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj["choices"][0]["message"]["content"], obj["usage"]


def cached(usage):
    return usage["prompt_tokens_details"]["cached_tokens"]


def ssd_stats(url):
    return httpx.get(url + "/stats").json()["ssd_cache"]


def flush(url, timeout=30):
    return httpx.post(url + "/admin/cache/flush", params={"timeout": timeout}, timeout=timeout + 30)


def files(root: Path, pattern: str):
    return sorted(root.rglob(pattern))


@pytest.fixture(scope="module")
def cold(server):
    """The suite's shared server (RAM tier only); callers clear it before each request, so every answer is a cold
    prefill."""
    return server


def cold_chat(cold, messages):
    assert httpx.post(cold.url + "/admin/cache/clear").status_code == 200
    text, usage = chat(cold.url, messages)
    assert cached(usage) == 0
    return text


def test_restart_restores_the_conversation_and_text_matches_cold(tmp_path, cold):
    kv = tmp_path / "kv"
    first = ServerProc("--model", "default", "--ssd-cache", str(kv), "--write-behind-debounce", "5",
                       "--ssd-write-when", "always")
    msgs = [SYSTEM, {"role": "user", "content": TURNS[0]}]
    text1, _ = chat(first.url, msgs)
    r = flush(first.url)
    assert r.status_code == 200 and r.json() == {"durable": True}  # flush endpoint once writes settle
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": TURNS[1]}]
    text2, usage2 = chat(first.url, msgs)
    # turn 2 is still inside its 5 s debounce: only the shutdown flush can make it durable
    assert first.stop() == 0, first.log()
    assert "ssd cache flushed" in first.log_path.read_text()

    # the second start, at the default --ssd-write-when (idle), writes only while the lane is idle; entries due at once
    second = ServerProc("--model", "default", "--ssd-cache", str(kv), "--write-behind-debounce", "0")
    try:
        assert ssd_stats(second.url)["entries"] >= 1
        msgs += [{"role": "assistant", "content": text2}, {"role": "user", "content": TURNS[2]}]
        text3, usage3 = chat(second.url, msgs)
        assert cached(usage3) >= usage2["prompt_tokens"]  # the whole previous context came back from disk
        s = ssd_stats(second.url)
        assert s["restores"] == 1 and s["ssd_hits"] == 1 and s["removed_at_scan"] == 0
        _writes_wait_for_an_idle_lane(second.url)
    finally:
        assert second.stop() == 0, second.log()
    # the same conversation, cold, gives the same text at every turn
    ref = [SYSTEM, {"role": "user", "content": TURNS[0]}]
    assert cold_chat(cold, ref) == text1
    ref += [{"role": "assistant", "content": text1}, {"role": "user", "content": TURNS[1]}]
    assert cold_chat(cold, ref) == text2
    ref += [{"role": "assistant", "content": text2}, {"role": "user", "content": TURNS[2]}]
    assert cold_chat(cold, ref) == text3


def _settled(url, timeout=60):
    """The SSD tier's stats once nothing is pending, the lane is idle and two reads 0.3 s apart agree (a request's
    response can reach the client before the lane schedules its entry for the disk: one quiet read is not enough)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/stats").json()
        s, lane = stats["ssd_cache"], stats["lane"]
        # (a reply's next-turn entry is computed after it, on the lane: server.core.next_turn)
        quiet = (not s["pending"] and not lane["running"] and not lane["queue_depth"]
                 and not stats["next_turn"].get("pending"))
        if quiet and last is not None and last["writes"] == s["writes"]:
            return s
        last = s if quiet else None
        time.sleep(0.3 if quiet else 0.05)
    raise AssertionError(f"the SSD tier did not settle in {timeout} s: {s}")


def _writes_wait_for_an_idle_lane(url):
    """A short request ends while a long one runs: its entry (due at once) stays pending while the lane is busy,
    the writer's polls counted, and is written once the lane is idle."""
    before = _settled(url)
    long = {"messages": [{"role": "user", "content": "Count from one to fifty in words."}], "max_tokens": 64,
            "temperature": 0}
    seen = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, url + "/v1/chat/completions", json=long, timeout=300)
        while not httpx.get(url + "/stats").json()["lane"]["running"] and not running.done():
            time.sleep(0.01)
        chat(url, [{"role": "user", "content": "Name a prime number."}], max_tokens=2)
        while not running.done():
            stats = httpx.get(url + "/stats").json()
            if stats["lane"]["running"]:  # the long one still generating (its response may lag its end)
                seen.append(stats["ssd_cache"])
            time.sleep(0.03)
        assert running.result().status_code == 200
    # the last look may straddle the lane's end: /stats reads the lane (still running) before the SSD tier, and the
    # writer may take its chance in between (a fresh-clone run saw that write): it is left out
    seen = seen[:-1]
    assert seen, "the long request ended before the short one"
    brief = [(s["pending"], s["writes"], s["write_gate_waits"]) for s in seen]
    # nothing written beside the forwards (from the first look on: an entry of the server's own work, due before the
    # long request came, may have gone out in the moment the lane was idle between them)
    odd = [(i, b) for i, b in enumerate(brief) if b[1] != brief[0][1]]
    assert not odd, f"writes while the lane ran, at looks {odd} of {len(brief)}: {brief[:3]}..."
    assert any(s["pending"] >= 1 for s in seen), brief
    after = _settled(url)
    assert after["writes"] > seen[-1]["writes"] and after["write_gate_waits"] > before["write_gate_waits"]


def _plant_corrupt_files(folder: Path, fingerprint: str, ns: str) -> int:
    """Six files the start-up scan must delete; returns how many."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from cache import kvfile

    def tiny():
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)))
        return [c]

    folder.mkdir(parents=True, exist_ok=True)
    name = iter(f"{i:032x}.safetensors" for i in range(1, 100))
    kvfile.save(folder / next(name), [1, 2, 3, 4], tiny(), fingerprint="00" * 32, ns=ns)  # another model's
    truncated = folder / next(name)
    kvfile.save(truncated, [1, 2, 3, 4], tiny(), fingerprint=fingerprint, ns=ns)
    truncated.write_bytes(truncated.read_bytes()[:-40])
    version = folder / next(name)
    kvfile.save(version, [1, 2, 3, 4], tiny(), fingerprint=fingerprint, ns=ns)
    raw = version.read_bytes()
    assert b'\\"version\\":1,' in raw  # the metadata JSON is a string inside the header JSON: escaped
    version.write_bytes(raw.replace(b'\\"version\\":1,', b'\\"version\\":7,'))
    (folder / next(name)).write_bytes(os.urandom(4096))
    mx.save_safetensors(str(folder / next(name)), {"weight": mx.zeros((4, 4))})  # a foreign safetensors
    (folder / (next(name) + ".tmp")).write_bytes(b"half a write")
    return 6


def test_kill_mid_write_and_corrupt_files_never_load(tmp_path, default_model_dir):
    """kill -9 while a write is in progress, plus corrupt files planted next to a good entry: the next server
    removes every partial or unusable file at start, loads none of them, and the good entry still hits."""
    from cache import kvfile

    kv = tmp_path / "kv"
    msgs = [SYSTEM, {"role": "user", "content": "Name three sorting algorithms."}]
    first = ServerProc("--model", "default", "--ssd-cache", str(kv))
    text, usage = chat(first.url, msgs)  # a cold answer: the first request of a server on an empty dir
    assert flush(first.url).status_code == 200
    fingerprint = httpx.get(first.url + "/stats").json()["fingerprint"]
    assert first.stop() == 0, first.log()
    complete = files(kv, "*.safetensors")
    assert len(complete) == 1

    # MLX_LANE_TEST_WRITE_DELAY: every write pauses between fsync and rename (test seam, tests/seamed_server.py)
    slow = ServerProc("--model", "default", "--ssd-cache", str(kv), "--write-behind-debounce", "0.1",
                      env={"MLX_LANE_TEST_WRITE_DELAY": "120"})
    try:
        chat(slow.url, [SYSTEM, {"role": "user", "content": "Name three hash functions."}])
        r = flush(slow.url, timeout=0.5)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["error"]["code"] == "not_durable" and body["pending"] and body["pending"][0]["tokens"] > 0
        for _ in range(600):  # a bound on waiting for the writer, not a timing assertion
            if files(kv, "*.tmp"):
                break
            time.sleep(0.1)
        assert files(kv, "*.tmp"), "the slowed write never started"
    finally:
        slow.kill()

    folder = kv / fingerprint / kvfile.ns_hash(fingerprint)  # the server's namespace is its fingerprint
    planted = _plant_corrupt_files(folder, fingerprint, fingerprint)
    third = ServerProc("--model", "default", "--ssd-cache", str(kv))
    try:
        assert files(kv, "*.tmp") == []
        s = ssd_stats(third.url)
        assert s["removed_at_scan"] == planted + 1 and s["entries"] == 1  # + the killed write's temp file
        assert files(kv, "*.safetensors") == complete
        again, u = chat(third.url, msgs)
        assert cached(u) == usage["prompt_tokens"] - 1 and again == text
        assert ssd_stats(third.url)["restores"] == 1
    finally:
        assert third.stop() == 0, third.log()


def test_unwritable_cache_dir_keeps_serving_and_counts_the_failure(tmp_path, default_model_dir):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file: nothing can be created under it, even by root")
    # every write fails: the writer's retries (4 attempts an entry) without the product's 2.6 s of waits between them,
    # which the flush below and the shutdown flush sat through for each entry (~10 s of the test)
    srv = ServerProc("--model", "default", "--ssd-cache", str(blocker / "kv"), "--write-behind-debounce", "0.1",
                     env={"MLX_LANE_TEST_RETRY_BACKOFF": "0,0,0"})
    try:
        msgs = [SYSTEM, {"role": "user", "content": "What is a queue?"}]
        text, _ = chat(srv.url, msgs)
        r = flush(srv.url, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_durable"
        s = ssd_stats(srv.url)
        assert s["failed"] >= 1 and s["writes"] == 0 and s["entries"] == 0
        again, usage = chat(srv.url, msgs)  # the RAM tier still serves
        assert again == text and cached(usage) > 0
    finally:
        assert srv.stop() == 0, srv.log()
