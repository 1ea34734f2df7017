"""PromptCache contract with stub caches (no model, no real KV): matching, storage, eviction, sessions, stats."""

import threading

import numpy as np
import pytest

import cache.prompt_cache as pc_module
from cache.prompt_cache import CacheHit, NullPromptCache, PromptCache, make_prompt_cache

PER_TOKEN = 10  # stub bytes per token per layer


class Stub:
    """A per-layer cache with the surface the RAM tier uses: offset, state, trim, is_trimmable, nbytes."""

    def __init__(self, n: int, *, trimmable: bool = True, tag: str = ""):
        self.offset = n
        self.trimmable = trimmable
        self.tag = tag

    @property
    def state(self):
        return (self.offset, self.tag)

    def is_trimmable(self):
        return self.trimmable

    def trim(self, n):
        n = min(n, self.offset)
        self.offset -= n
        return n

    @property
    def nbytes(self):
        return self.offset * PER_TOKEN


def layers(n, *, trimmable=True, tag="", count=2):
    return [Stub(n, trimmable=trimmable, tag=tag) for _ in range(count)]


def put(cache, tokens, *, ns="m", session=None, trimmable=True, tag=""):
    cache.put(tokens, layers(len(tokens), trimmable=trimmable, tag=tag), ns, session)


def big():
    return PromptCache(10**9)


# ------------------------------------------------------------------------------------------------------- matching

# (entries as (tokens, trimmable), prompt, expected hit length or None)
MATCH_CASES = [
    pytest.param([((1, 2, 3), True)], (1, 2, 3, 4), 3, id="full-prefix"),
    pytest.param([((1, 2, 3), True), ((1, 2, 9, 9, 9), True)], (1, 2, 9, 9, 7), 4, id="longest-wins"),
    pytest.param([((1, 2, 3, 4, 5), True)], (1, 2, 3, 8), 3, id="trim-longer-trimmable"),
    pytest.param([((1, 2, 3), True)], (1, 2, 3), 2, id="equal-prompt-capped-len-minus-1"),
    pytest.param([((1, 2, 3), False)], (1, 2, 3), None, id="equal-prompt-untrimmable-misses"),
    pytest.param([((1, 2, 3, 4, 5, 6), False)], (1, 2, 3, 4, 7), None, id="untrimmable-longer-misses"),
    pytest.param([((1, 2, 3), False)], (1, 2, 3, 4), 3, id="untrimmable-full-prefix-hits"),
    pytest.param([((5, 6), True)], (1, 2, 3), None, id="no-common-prefix"),
    pytest.param([((1, 2), True)], (1,), None, id="one-token-prompt"),
    pytest.param([((1, 2, 3, 4, 5, 6), False), ((1, 2), True)], (1, 2, 3, 4, 9), 2, id="untrimmable-skipped-for-shorter"),
]


@pytest.mark.parametrize("entries, prompt, expected", MATCH_CASES)
def test_match_rules(entries, prompt, expected):
    cache = big()
    for tokens, trimmable in entries:
        put(cache, tokens, trimmable=trimmable)
    hit = cache.take(prompt, "m")
    if expected is None:
        assert hit is None
    else:
        assert hit is not None and hit.length == expected and hit.source == "ram"
        assert [c.offset for c in hit.caches] == [expected, expected]  # trimmed to the hit length


def test_tie_prefers_entry_needing_no_trim():
    cache = big()
    put(cache, (1, 2, 3, 5), tag="long")
    put(cache, (1, 2, 3), trimmable=False, tag="short")  # untrimmable: supersedes nothing
    hit = cache.take((1, 2, 3, 9), "m")
    assert hit.length == 3 and hit.caches[0].tag == "short"


def test_donor_untouched_after_many_takes():
    cache = big()
    put(cache, (1, 2, 3, 4, 5, 6), tag="donor")
    for _ in range(20):
        hit = cache.take((1, 2, 3, 7), "m")
        assert hit.length == 3
        for c in hit.caches:  # the caller owns these: wreck them
            c.offset = -1
            c.tag = "taker"
    full = cache.take((1, 2, 3, 4, 5, 6, 7), "m")
    assert full.length == 6 and [c.offset for c in full.caches] == [6, 6]
    assert {c.tag for c in full.caches} == {"donor"}
    assert cache.stats()["entries"] == 1 and cache.stats()["bytes"] == 6 * PER_TOKEN * 2


def test_put_keeps_its_own_objects():
    cache = big()
    lane = layers(4, tag="lane")
    cache.put((1, 2, 3, 4), lane, "m")
    for c in lane:  # the lane keeps generating with its objects
        c.offset = 99
        c.tag = "mutated"
    hit = cache.take((1, 2, 3, 4, 5), "m")
    assert [c.offset for c in hit.caches] == [4, 4] and {c.tag for c in hit.caches} == {"lane"}
    assert all(c is not l for c, l in zip(hit.caches, lane))


def test_put_copies_the_token_ids():
    cache = big()
    tokens = np.array([1, 2, 3, 4])
    cache.put(tokens, layers(4), "m")
    tokens[:] = 9  # the lane reuses its buffer
    assert cache.take((1, 2, 3, 4, 5), "m").length == 4


def test_put_rejects_caches_that_disagree_with_tokens():
    cache = big()
    with pytest.raises(ValueError, match="cache offset 3 does not match 4 tokens"):
        cache.put((1, 2, 3, 4), layers(3), "m")
    assert cache.stats()["entries"] == 0


# -------------------------------------------------------------------------------------------------------- storage


def test_exact_tokens_replace():
    cache = big()
    put(cache, (1, 2, 3), tag="old")
    put(cache, (1, 2, 3), tag="new")
    assert cache.stats()["entries"] == 1 and cache.stats()["bytes"] == 3 * PER_TOKEN * 2
    assert cache.take((1, 2, 3, 4), "m").caches[0].tag == "new"


@pytest.mark.parametrize(
    "new_trimmable, entries_after, superseded",
    [pytest.param(True, 2, 2, id="trimmable-supersedes"), pytest.param(False, 4, 0, id="untrimmable-keeps-ancestors")],
)
def test_supersede_only_when_trimmable(new_trimmable, entries_after, superseded):
    cache = big()
    put(cache, (1, 2, 7))  # a sibling, not an ancestor: always kept
    put(cache, (1, 2), trimmable=False)  # untrimmable ancestors: they supersede nothing themselves
    put(cache, (1, 2, 3), trimmable=False)
    put(cache, (1, 2, 3, 4, 5), trimmable=new_trimmable)
    stats = cache.stats()
    assert stats["entries"] == entries_after and stats["superseded"] == superseded
    assert cache.take((1, 2, 7, 8), "m").length == 3


def test_superseded_entries_are_let_go_through_the_hook_and_replaced_ones_are_not():
    gone = []
    cache = PromptCache(1 << 30, on_let_go=lambda ns, tokens: gone.append((ns, tokens)))
    put(cache, (1, 2))
    put(cache, (1, 2))  # the same tokens again: the new entry holds them
    put(cache, (1, 2, 7), trimmable=False)  # untrimmable: supersedes nothing
    assert gone == []
    put(cache, (1, 2, 3, 4))
    assert gone == [("m", (1, 2))] and cache.stats()["superseded"] == 1


def test_lru_eviction_by_bytes():
    cache = PromptCache(3 * 4 * PER_TOKEN * 2)  # room for three 4-token entries
    for first in (1, 2, 3):
        put(cache, (first, 0, 0, 0), tag=str(first))
    assert cache.take((1, 0, 0, 0, 9), "m") is not None  # touch entry 1: entry 2 is now the oldest
    put(cache, (4, 0, 0, 0))
    assert cache.stats()["evictions"] == 1 and cache.stats()["entries"] == 3
    assert cache.take((2, 0, 0, 0, 9), "m") is None
    assert all(cache.take((k, 0, 0, 0, 9), "m") is not None for k in (1, 3, 4))
    assert cache.stats()["bytes"] <= cache.stats()["max_bytes"]


def test_sessions_evicted_last():
    cache = PromptCache(3 * 4 * PER_TOKEN * 2)
    put(cache, (1, 0, 0, 0), session="s")  # oldest, but session-bound
    put(cache, (2, 0, 0, 0))
    put(cache, (3, 0, 0, 0))
    put(cache, (4, 0, 0, 0))
    put(cache, (5, 0, 0, 0))
    assert cache.stats()["evictions"] == 2
    assert cache.take((2, 0, 0, 0, 9), "m") is None and cache.take((3, 0, 0, 0, 9), "m") is None
    assert cache.take((1, 0, 0, 0, 9), "m") is not None


def test_session_moving_to_a_new_entry_unbinds_the_old_one():
    cache = PromptCache(3 * 4 * PER_TOKEN * 2)
    put(cache, (1, 0, 0, 0), session="s")
    put(cache, (2, 0, 0, 0), session="u")
    put(cache, (3, 0, 0, 0), session="s")  # s moves on: (1,0,0,0) is now a plain entry
    put(cache, (4, 0, 0, 0))
    assert cache.stats()["evictions"] == 1
    assert cache.take((1, 0, 0, 0, 9), "m") is None  # the unbound entry went first, not the new plain one
    assert cache.take((4, 0, 0, 0, 9), "m") is not None
    assert cache.take((2, 0, 0, 0, 9), "m", session="u").source == "session"
    assert cache.take((3, 0, 0, 0, 9), "m", session="s").source == "session"


def test_replace_keeps_the_sessions_of_the_replaced_entry():
    cache = big()
    put(cache, (1, 2, 3), session="t", tag="old")
    put(cache, (1, 2, 3), tag="new")
    hit = cache.take((1, 2, 3, 4), "m", session="t")
    assert hit.source == "session" and hit.caches[0].tag == "new"


def test_entry_bigger_than_cap_not_kept():
    cache = PromptCache(5 * PER_TOKEN * 2)
    put(cache, (1, 2, 3))
    put(cache, (1, 2, 3, 4, 5, 6))
    stats = cache.stats()
    assert stats["rejected_too_big"] == 1 and stats["entries"] == 1 and stats["evictions"] == 0
    assert cache.take((1, 2, 3, 4), "m").length == 3


def test_namespaces_isolated():
    cache = big()
    put(cache, (1, 2, 3), ns="a", tag="a")
    assert cache.take((1, 2, 3, 4), "b") is None
    put(cache, (1, 2, 3), ns="b", tag="b")
    put(cache, (1, 2, 3, 4, 5), ns="b")  # trimmable: supersedes only within "b"
    assert cache.stats()["entries"] == 2
    assert cache.take((1, 2, 3, 4), "a").caches[0].tag == "a"


# ------------------------------------------------------------------------------------------------------- sessions


def test_session_hit_is_o1(monkeypatch):
    cache = big()
    for first in range(50):
        put(cache, (first, 1, 2, 3))
    put(cache, (9, 9, 9, 9, 9), session="s", trimmable=False)
    calls = []
    real = pc_module.best_match  # the prefix rule's scan (cache.prefix.best_match)
    monkeypatch.setattr(pc_module, "best_match", lambda *a: calls.append(1) or real(*a))
    hit = cache.take((9, 9, 9, 9, 9, 4), "m", session="s")
    assert hit.source == "session" and hit.length == 5 and calls == []  # no scan
    assert cache.stats()["session_hits"] == 1


@pytest.mark.parametrize(
    "prompt, expected",
    [
        pytest.param((9, 9, 9, 1, 1, 1), ("ram", 3), id="diverged-scan-trims"),
        pytest.param((9, 9, 9, 9, 9), ("ram", 4), id="equal-prompt-needs-trim"),
        pytest.param((1, 2, 3), None, id="nothing-matches"),
    ],
)
def test_session_falls_back_to_scan(prompt, expected):
    cache = big()
    put(cache, (9, 9, 9, 9, 9), session="s")
    hit = cache.take(prompt, "m", session="s")
    assert (None if hit is None else (hit.source, hit.length)) == expected
    assert cache.stats()["session_hits"] == 0


def test_session_is_per_namespace():
    cache = big()
    put(cache, (1, 2, 3), ns="a", session="s")
    assert cache.take((1, 2, 3, 4), "b", session="s") is None


# -------------------------------------------------------------------------------------------- stats, clear, null


def test_stats_counters_and_rates():
    cache = big()
    put(cache, (1, 2, 3, 4), session="s")
    cache.take((1, 2, 3, 4, 5, 6), "m", session="s")  # session hit, 4 of 6
    cache.take((1, 2, 8, 8), "m")  # scan hit, 2 of 4
    cache.take((7, 7), "m")  # miss, 0 of 2
    cache.take((1, 2, 3, 4), "other")  # other namespace: miss, 0 of 4
    stats = cache.stats()
    assert {k: stats[k] for k in ("queries", "hits", "tokens_queried", "tokens_hit", "session_hits")} == {
        "queries": 4,
        "hits": 2,
        "tokens_queried": 16,
        "tokens_hit": 6,
        "session_hits": 1,
    }
    assert stats["request_hit_rate"] == pytest.approx(0.5)
    assert stats["token_hit_rate"] == pytest.approx(6 / 16)
    assert stats["entries"] == 1 and stats["bytes"] == 4 * PER_TOKEN * 2 and stats["enabled"] is True


def test_rates_zero_without_queries():
    stats = big().stats()
    assert stats["request_hit_rate"] == 0.0 and stats["token_hit_rate"] == 0.0


def test_clear():
    cache = big()
    put(cache, (1, 2, 3), session="s")
    put(cache, (4, 5, 6))
    cache.take((1, 2, 3, 4), "m")
    assert cache.clear() == 2
    stats = cache.stats()
    assert stats["entries"] == 0 and stats["bytes"] == 0 and stats["sessions"] == 0
    assert stats["hits"] == 1  # counters are cumulative
    assert cache.take((1, 2, 3, 4), "m", session="s") is None
    assert cache.clear() == 0


def test_null_prompt_cache():
    cache = make_prompt_cache(0)
    assert isinstance(cache, NullPromptCache)
    put(cache, (1, 2, 3))
    assert cache.take((1, 2, 3, 4), "m") is None
    assert cache.clear() == 0
    assert cache.stats()["enabled"] is False and cache.stats()["entries"] == 0


def test_make_prompt_cache_sizes():
    assert isinstance(make_prompt_cache(1000), PromptCache)
    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        make_prompt_cache(-1)
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        PromptCache(0)


def test_cache_hit_is_frozen():
    hit = CacheHit(caches=[], length=1, source="ram")
    with pytest.raises(AttributeError):
        hit.length = 2


def test_concurrent_stats_and_clear_while_lane_works():
    cache = PromptCache(20 * 8 * PER_TOKEN * 2)
    stop = threading.Event()
    errors = []

    def http_thread():
        try:
            while not stop.is_set():
                stats = cache.stats()
                assert 0 <= stats["bytes"] <= stats["max_bytes"]
                cache.clear()
        except Exception as exc:  # surfaced below: an assertion in a thread would be lost
            errors.append(exc)

    thread = threading.Thread(target=http_thread)
    thread.start()
    try:
        for i in range(2000):
            tokens = (i % 37, 1, 2, 3, 4, 5, 6, 7)
            put(cache, tokens, session=f"s{i % 5}")
            hit = cache.take(tokens + (9,), "m", session=f"s{i % 5}")
            assert hit is None or hit.length == 8
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert cache.stats()["queries"] == 2000


# -------------------------------------------------------------------------------------------------------- anchors


def test_an_anchor_is_not_superseded_by_the_entries_that_extend_it():
    cache = big()
    cache.put((1, 2, 3), layers(3), "m", anchor=True)  # a shared system prompt (a cache breakpoint)
    put(cache, (1, 2, 3, 4, 5))  # one conversation's turn: a plain entry would supersede its prefix
    assert set(cache.keys()) == {("m", (1, 2, 3)), ("m", (1, 2, 3, 4, 5))}
    put(cache, (1, 2))  # a plain prefix of the anchor is superseded as usual by a later, longer put
    put(cache, (1, 2, 3, 4, 5, 6))
    assert set(cache.keys()) == {("m", (1, 2, 3)), ("m", (1, 2, 3, 4, 5, 6))}  # (1, 2) and the old turn went
    assert cache.stats()["superseded"] == 2


def test_anchors_are_evicted_after_every_plain_entry():
    cache = PromptCache(2 * 3 * PER_TOKEN * 2)  # room for 12 tokens' worth of two layers... about two entries
    cache.put((1, 2, 3), layers(3), "m", anchor=True)
    put(cache, (7, 8, 9))
    put(cache, (4, 5, 6))  # over the cap: the oldest PLAIN entry goes, not the older anchor
    assert ("m", (1, 2, 3)) in cache.keys() and ("m", (7, 8, 9)) not in cache.keys()
    cache.put((1, 2, 3), layers(3), "m")  # stored again without the flag: it stays an anchor
    put(cache, (10, 11, 12))
    assert ("m", (1, 2, 3)) in cache.keys()


def test_entries_are_counted_per_namespace():
    cache = PromptCache(1 << 30)
    assert cache.entries_by_namespace() == {} and NullPromptCache().entries_by_namespace() == {}
    put(cache, [1, 2, 3], ns="a")
    put(cache, [4, 5, 6, 7], ns="a")
    put(cache, [1, 2, 3], ns="b")
    assert cache.entries_by_namespace() == {"a": 2, "b": 1}


def test_an_entry_with_checkpoints_is_superseded_only_by_one_that_reaches_each_of_them():
    """cache.prefix.supersedes: a longer entry that can be cut back to the old one's length but not to one of its
    checkpoints would lose that checkpoint's reuse (a turn parting there); it supersedes once it reaches them all."""
    from cache.prefix import ids, supersedes

    old, new = ids(range(10)), ids(range(20))
    assert supersedes(new, (4, 10), old, old_trimmable=(4,))
    assert not supersedes(new, (10,), old, old_trimmable=(4,))
    assert supersedes(new, True, old, old_trimmable=(4,))
    assert supersedes(new, (10,), old, old_trimmable=False)  # the old one reached nothing inside it
