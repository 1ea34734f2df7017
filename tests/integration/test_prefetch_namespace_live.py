"""Regression (issue 12): with a draft model the cache namespace includes the draft's identity, and the SSD
prefetch must look there too. It used to look under the bare model fingerprint, so a two-model server never
prefetched a restart's entries (the lane then read them on its own clock). The tiny random llama with the default
model's tokenizer (``tiny_llama_dir``, tests/conftest.py) drafts for itself: what is checked is where the prefetch
looks, not the text (the default model twice was ~12 s of CPU a start here)."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures.tiny_models import MECHANICS_FLAGS
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

TURN = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]


def test_two_model_server_prefetches_in_the_namespace_it_takes_from(tmp_path, tiny_llama_dir):
    kv = tmp_path / "kv"
    # the model drafts for itself: same tokenizer, a real two-model setup at no extra download
    args = ("--model", str(tiny_llama_dir), "--draft-model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--ssd-cache",
            str(kv))
    first = ServerProc(*args)
    try:
        r = httpx.post(first.url + "/v1/chat/completions", timeout=300,
                       json={"messages": TURN, "max_tokens": 2, "temperature": 0})  # (the prefetch needs no more)
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]["content"]
        assert httpx.post(first.url + "/admin/cache/flush", timeout=120).status_code == 200
    finally:
        assert first.stop() == 0, first.log()
    second = ServerProc(*args)
    try:
        turn2 = TURN + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And in Asia?"}]
        r = httpx.post(second.url + "/v1/chat/completions", timeout=300,
                       json={"messages": turn2, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        ssd = httpx.get(second.url + "/stats").json()["ssd_cache"]
        assert ssd["prefetches"] >= 1, ssd  # the handler found the entry in the speculative namespace
        assert ssd["ssd_hits"] >= 1 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        assert second.stop() == 0, second.log()
