"""Every prefix cache the lane may be given implements the whole declared protocol (cache.protocol.PrefixCache),
so no caller needs to probe for a verb; and the verbs a tier does not need answer the protocol's neutral values."""

from __future__ import annotations

import inspect

import pytest

from cache.prompt_cache import NullPromptCache, PromptCache
from cache.protocol import PrefixCache
from cache.sharded import ShardedPromptCache
from cache.ssd_store import NullSSDStore
from cache.tiered import TieredCache

VERBS = [name for name, _ in inspect.getmembers(PrefixCache, inspect.isfunction) if not name.startswith("_")]


class Durability:
    def schedule(self, tokens, caches, ns, delay=None):
        return False

    def close(self, timeout=None):
        return True

    def sole_pending_bytes(self):
        return 0

    def drop_spills(self, nbytes):
        return 0


class Cost:
    def should_restore(self, nbytes, saved):
        return False

    def observe_prefill(self, tokens, seconds):
        pass

    def worth_writing(self, nbytes, tokens):
        return True


def implementations():
    tiered = TieredCache.build(1 << 20, NullSSDStore(), Durability(), Cost(), start_timer=False)
    return {"null": NullPromptCache(), "ram": PromptCache(1 << 20), "tiered": tiered,
            "sharded": ShardedPromptCache(PromptCache(1 << 20), group=None)}


def test_the_protocol_has_the_lanes_and_the_event_loops_verbs():
    assert set(VERBS) == {"take", "put", "peek", "ready", "prefetch", "make_room", "observe_prefill", "clear",
                          "stats"}


@pytest.mark.parametrize("name", ["null", "ram", "tiered", "sharded"])
def test_each_cache_implements_every_verb_with_the_protocols_signature(name):
    cache = implementations()[name]
    assert isinstance(cache, PrefixCache)
    for verb in VERBS:
        mine = inspect.signature(getattr(type(cache), verb))
        theirs = inspect.signature(getattr(PrefixCache, verb))
        assert list(mine.parameters) == list(theirs.parameters), (name, verb, mine, theirs)


@pytest.mark.parametrize("name", ["null", "ram", "tiered"])
def test_an_empty_cache_answers_neutrally(name):
    cache = implementations()[name]
    prompt = [1, 2, 3, 4]
    assert cache.take(prompt, "ns") is None and cache.peek(prompt, "ns") == 0 and cache.peek(prompt, "ns", local=True) == 0
    assert cache.ready(prompt, "ns") is True and cache.prefetch(prompt, "ns") is False
    assert cache.make_room(10) == 0 and cache.clear() == 0 and cache.observe_prefill(10, 0.1) is None
    assert isinstance(cache.stats(), dict)
