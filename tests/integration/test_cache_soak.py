"""Requests with random shared prefixes under a small --cache-bytes: the cap holds, RSS stays bounded.

24 requests under a 24 MiB cap in the suite (full from the 2nd on: an entry's KV is allocated 256 tokens at a time,
11 MiB; the RSS baseline is taken after 8, the cap already evicting, and the last 16 measure the growth against a
full cache); `make soak` runs 1,000 (MLX_LANE_SOAK_REQUESTS) under 48 MiB (MLX_LANE_SOAK_CAP_MIB) and writes the RSS
and cache-bytes curve to $MLX_LANE_SOAK_CURVE when set. (The suite ran 36 with the baseline after 12: ~0.7 s of
CPU a request on a 2-core CI machine, for no more than the full cache these show.)
"""

from __future__ import annotations

import json
import os
import random

import httpx
import pytest

from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

CAP = int(os.environ.get("MLX_LANE_SOAK_CAP_MIB", "24")) << 20
REQUESTS = int(os.environ.get("MLX_LANE_SOAK_REQUESTS", "24"))
WARMUP = 8  # requests before the RSS baseline: the cache has filled to its cap by then
SYSTEMS = [
    "You are a terse code reviewer.",
    "You are a helpful shell assistant. Answer with one command.",
    "You translate English to French.",
    "You are a unit-test generator for Python functions.",
]
WORDS = "alpha beta gamma delta epsilon zeta theta lambda kappa sigma omega vector queue stack heap".split()


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_soak_requests_cap_and_rss(default_model_dir):
    rng = random.Random(7)
    srv = ServerProc("--model", "default", "--cache-bytes", str(CAP), "--no-ssd-cache")
    try:
        biggest_seen = 0
        rss_after_warmup = None
        curve = []
        for i in range(REQUESTS):
            system = rng.choice(SYSTEMS)
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    "max_tokens": 1, "temperature": 0}
            if rng.random() < 0.3:
                body["user"] = f"agent-{rng.randint(0, 5)}"
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            pc = httpx.get(srv.url + "/stats").json()["prompt_cache"]
            assert pc["bytes"] <= pc["max_bytes"] == CAP, pc
            biggest_seen = max(biggest_seen, pc["bytes"])
            if i == WARMUP - 1:
                assert pc["evictions"] > 0, pc  # the baseline is taken against a full cache
                rss_after_warmup = rss_kib(srv.proc.pid)
            if i % 10 == 9:
                curve.append({"request": i + 1, "rss_mib": round(rss_kib(srv.proc.pid) / 1024, 1),
                              "cache_bytes": pc["bytes"], "entries": pc["entries"]})
        final = httpx.get(srv.url + "/stats").json()["prompt_cache"]
        if os.environ.get("MLX_LANE_SOAK_CURVE"):
            with open(os.environ["MLX_LANE_SOAK_CURVE"], "w") as f:
                json.dump({"requests": REQUESTS, "cap": CAP, "final": final, "curve": curve}, f, indent=1)
        assert final["evictions"] > 0  # the cap was actually exercised
        assert final["hits"] > 0  # shared system prompts were reused
        growth_mib = (rss_kib(srv.proc.pid) - rss_after_warmup) / 1024
        # the cache may fill up to its cap after the warm-up; anything beyond cap + slack is a leak
        assert growth_mib < CAP / (1 << 20) + 96, growth_mib
    finally:
        assert srv.stop() == 0, srv.log()
