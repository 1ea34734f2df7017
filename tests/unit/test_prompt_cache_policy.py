"""LruSessionLast alone: eviction order without any cache."""

import pytest

from cache.policy import LruSessionLast


def _drain(policy: LruSessionLast) -> list:
    out = []
    while (key := policy.victim()) is not None:
        out.append(key)
        policy.remove(key)
    return out


def test_lru_order_oldest_first():
    policy = LruSessionLast()
    for key in "abc":
        policy.add(key, session_bound=False)
    assert list(policy.order()) == ["a", "b", "c"]
    assert _drain(policy) == ["a", "b", "c"]
    assert len(policy) == 0


def test_touch_moves_to_most_recent():
    policy = LruSessionLast()
    for key in "abc":
        policy.add(key, session_bound=False)
    policy.touch("a")
    assert _drain(policy) == ["b", "c", "a"]


def test_session_bound_go_last_even_when_older():
    policy = LruSessionLast()
    policy.add("s1", session_bound=True)
    policy.add("p1", session_bound=False)
    policy.add("s2", session_bound=True)
    policy.add("p2", session_bound=False)
    policy.touch("p1")
    assert _drain(policy) == ["p2", "p1", "s1", "s2"]


def test_set_session_bound_moves_between_queues():
    policy = LruSessionLast()
    policy.add("a", session_bound=False)
    policy.add("b", session_bound=False)
    policy.set_session_bound("a", True)
    assert list(policy.order()) == ["b", "a"]
    policy.set_session_bound("a", False)  # unbound again: now the most recent plain key
    assert list(policy.order()) == ["b", "a"]
    policy.set_session_bound("b", True)
    assert list(policy.order()) == ["a", "b"]


def test_readd_replaces_and_remove_is_idempotent():
    policy = LruSessionLast()
    policy.add("a", session_bound=True)
    policy.add("a", session_bound=False)
    assert len(policy) == 1 and "a" in policy
    policy.remove("a")
    policy.remove("a")
    assert "a" not in policy and policy.victim() is None


@pytest.mark.parametrize("call", [lambda p: p.touch("x"), lambda p: p.set_session_bound("x", True)])
def test_unknown_key_raises(call):
    with pytest.raises(KeyError):
        call(LruSessionLast())
