"""--kv-bits on the real default model through a live server: hits and SSD restores give the cold text.

With --kv-bits 8 every KV layer is quantized from the first prompt token, so a RAM hit, a partial hit and an SSD
restore after a restart produce exactly the greedy text a cold request with --kv-bits 8 produces; /stats shows the
scheme and the bytes per cached token; a server started with another scheme never restores those files.
"""

from __future__ import annotations

import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a careful assistant for a software engineering team."}
TURN1 = [SYSTEM, {"role": "user", "content": "Name three uses of a hash map in a compiler."}]
# SmolLM2: 30 layers x 3 KV heads x head_dim 64, keys + values, float32 scales and biases per group of 64
FLOAT32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


def chat(url, messages, max_tokens=8):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj["choices"][0]["message"]["content"], obj["usage"]


def cached(usage) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_kv8_hits_and_ssd_restore_equal_cold_and_other_schemes_never_restore(default_model_dir, tmp_path):
    kv = tmp_path / "kv"
    first = ServerProc("--model", "default", "--kv-bits", "8", "--ssd-cache", str(kv))
    try:
        cold1, u = chat(first.url, TURN1)
        assert cached(u) == 0
        warm1, u = chat(first.url, TURN1)
        assert cached(u) > 0 and warm1 == cold1

        turn2 = TURN1 + [{"role": "assistant", "content": cold1}, {"role": "user", "content": "And a fourth?"}]
        warm2, u = chat(first.url, turn2)  # extends turn 1's entry
        assert cached(u) > 0
        kvs = httpx.get(first.url + "/stats").json()["kv_cache"]
        assert kvs["scheme"] == "q8g64"
        assert kvs["bytes_per_token"] == pytest.approx(FLOAT32_BYTES_PER_TOKEN * 9 / 32)
        assert httpx.post(first.url + "/admin/cache/flush").status_code == 200
    finally:
        assert first.stop() == 0

    second = ServerProc("--model", "default", "--kv-bits", "8", "--ssd-cache", str(kv))
    try:
        assert httpx.get(second.url + "/stats").json()["ssd_cache"]["entries"] >= 1
        restored1, u = chat(second.url, TURN1)
        assert cached(u) > 0 and restored1 == cold1
        assert httpx.get(second.url + "/stats").json()["ssd_cache"]["ssd_hits"] >= 1
        hit2, u = chat(second.url, turn2)
        assert cached(u) > 0 and hit2 == warm2
    finally:
        assert second.stop() == 0

    # turn 2 with no cache at all, same scheme: the text the hits above must have produced
    cold_server = ServerProc("--model", "default", "--kv-bits", "8", "--no-ssd-cache")
    try:
        cold2, u = chat(cold_server.url, turn2)
        assert cached(u) == 0 and cold2 == warm2
    finally:
        assert cold_server.stop() == 0

    other = ServerProc("--model", "default", "--kv-bits", "4", "--ssd-cache", str(kv))
    try:
        s = httpx.get(other.url + "/stats").json()
        assert s["kv_cache"]["scheme"] == "q4g64" and s["ssd_cache"]["entries"] == 0
        _, u = chat(other.url, TURN1, max_tokens=2)
        assert cached(u) == 0
        assert httpx.get(other.url + "/stats").json()["kv_cache"]["bytes_per_token"] == pytest.approx(
            FLOAT32_BYTES_PER_TOKEN * 5 / 32)
    finally:
        assert other.stop() == 0
