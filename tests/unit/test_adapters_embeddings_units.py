"""Model-free contracts of issue 17: who may load an adapter, the adapter namespace, embedding input checks and
how an embeddings request is cut into lane tasks."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache.prefix import namespace
from server.catalog import adapter_path_for, load_refusal
from server.errors import InvalidRequest
from server.http.embeddings import _inputs, plan_tasks, tokenize_inputs


@pytest.mark.parametrize("authenticated, adapter_dir, path, allowed", [
    (True, None, "/anywhere/x", True),  # --api-key: the client was authenticated by the guard
    (False, None, "/anywhere/x", False),  # no key, no dir: never read a path an anonymous client names
    (False, "/srv/adapters", "/srv/adapters/x", True),
    (False, "/srv/adapters", "/srv/adapters", False),  # the dir itself is not an adapter
    (False, "/srv/adapters", "/srv/other/x", False),
    (False, "/srv/adapters", "/srv/adapters-evil/x", False),  # a sibling with the same prefix is outside
])
def test_who_may_load_an_adapter(authenticated, adapter_dir, path, allowed):
    why = load_refusal(Path(path), authenticated=authenticated, adapter_dir=adapter_dir)
    assert (why is None) == allowed
    if not allowed:
        assert "--api-key" in why or "--adapter-dir" in why


def test_a_dotdot_path_resolves_before_the_check(tmp_path):
    root = tmp_path / "adapters"
    root.mkdir()
    sneaky = adapter_path_for("x", str(root / ".." / "elsewhere"), None)
    assert load_refusal(sneaky, authenticated=False, adapter_dir=str(root)) is not None
    by_name = adapter_path_for("x", None, str(root))
    assert by_name == (root / "x").resolve()
    assert load_refusal(by_name, authenticated=False, adapter_dir=str(root)) is None
    with pytest.raises(ValueError, match="--adapter-dir"):
        adapter_path_for("x", None, None)


def test_adapter_namespaces_differ_from_the_base_and_from_each_other():
    base = "fp"
    a, b = namespace(base, adapter="h1"), namespace(base, adapter="h2")
    assert len({base, a, b}) == 3
    assert namespace(base, adapter="h1") == a  # stable: an SSD entry is found again after a restart
    assert namespace("fp2", adapter="h1") != a


class StubEmbedder:
    model_id = "stub"
    vocab_size = 100
    max_tokens = 6

    def tokenize(self, texts):
        return [[1, *[len(w) for w in t.split()], 2] for t in texts]

    def wrap_ids(self, ids):
        return [1, *ids, 2]


@pytest.mark.parametrize("given, expected", [
    ("one two", [[1, 3, 3, 2]]),
    (["a", "bb"], [[1, 1, 2], [1, 2, 2]]),
    ([5, 6], [[1, 5, 6, 2]]),
    ([[5], [7, 8]], [[1, 5, 2], [1, 7, 8, 2]]),
])
def test_inputs_become_token_lists(given, expected):
    assert tokenize_inputs(StubEmbedder(), _inputs(given)) == expected


@pytest.mark.parametrize("given, param", [
    ([], "input"),
    ([""], "input[0]"),
    (["ok", ""], "input[1]"),
    ([[5], []], "input[1]"),
    ([[5, 100]], "input[0]"),  # outside the vocabulary
    ([[5, -1]], "input[0]"),
    (["a b c d e"], "input[0]"),  # 7 tokens > max_tokens 6: a 400, never a silent cut
])
def test_hostile_inputs_are_400s_naming_the_input(given, param):
    with pytest.raises(InvalidRequest) as exc:
        tokenize_inputs(StubEmbedder(), _inputs(given))
    assert exc.value.param == param


def test_tasks_are_bounded_by_padded_tokens_and_cover_every_input_once():
    lengths = [5, 100, 7, 300, 6, 50]
    tasks = plan_tasks(lengths, budget=120)
    assert sorted(i for t in tasks for i in t) == list(range(len(lengths)))
    for t in tasks:
        assert max(lengths[i] for i in t) * len(t) <= 120 or len(t) == 1
    assert [3] in tasks  # longer than the budget: alone
