"""Many models (issue 25), model-free: the residency policy as a table, the pool's mechanism with a fake loader
(coalesced loads, in-use protection, waiting for room, TTL, pins, failed loads), and the --model flags."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from models import ModelLoadError
from server.pool.flags import parse_model_flags
from server.pool.policy import LoadPlan, ResidencyPolicy, Resident
from server.pool.pool import ModelInUse, ModelLoadFailed, ModelPool, ModelWontFit

G = 1 << 30


def R(name, gib=1.0, used=0.0, in_use=0, pinned=False):
    return Resident(name, int(gib * G), used, in_use, pinned)


# -- the policy ------------------------------------------------------------------------------------------------

POLICY_TABLE = [
    # (budget GiB, max_loaded, fixed GiB, loading GiB, resident, expected plan)
    ("room: nothing to evict", 10, 4, 2, 1, [R("a"), R("b")], LoadPlan()),
    ("count cap: the least recently used goes", 0, 2, 0, 1, [R("a", used=5), R("b", used=1)], LoadPlan(evict=("b",))),
    ("bytes cap: evict until it fits, LRU first", 6, 0, 2, 3,
     [R("a", 1, used=3), R("b", 1, used=1), R("c", 1, used=2)], LoadPlan(evict=("b", "c"))),
    ("in use is never evicted: the next idle one goes", 0, 2, 0, 1,
     [R("a", used=1, in_use=1), R("b", used=5)], LoadPlan(evict=("b",))),
    ("pinned is never evicted", 0, 2, 0, 1, [R("a", used=1, pinned=True), R("b", used=5)], LoadPlan(evict=("b",))),
    ("all in the way are in use: wait, evict nothing", 0, 2, 0, 1,
     [R("a", used=1, in_use=1), R("b", used=5, in_use=2)], LoadPlan(wait=True)),
    ("bytes: the idle one is not enough while another is in use: wait", 4, 0, 1, 2,
     [R("a", 1, used=1), R("b", 1.5, used=2, in_use=1)], LoadPlan(wait=True)),
    ("no caps at all", 0, 0, 0, 100, [R("a", 50), R("b", 50)], LoadPlan()),
]


@pytest.mark.parametrize("case", POLICY_TABLE, ids=[c[0] for c in POLICY_TABLE])
def test_the_residency_policy_plans_loads_as_its_table_says(case):
    _, budget, max_loaded, fixed, size, resident, expected = case
    policy = ResidencyPolicy(budget_bytes=int(budget * G), max_loaded=max_loaded, fixed_bytes=int(fixed * G))
    assert policy.plan_load("new", int(size * G), resident) == expected


def test_a_model_too_big_beside_the_base_and_the_pinned_ones_is_refused_with_why():
    policy = ResidencyPolicy(budget_bytes=8 * G, fixed_bytes=3 * G)
    plan = policy.plan_load("big", 4 * G, [R("p", 2, pinned=True), R("idle", 1)])
    assert not plan.go and "--memory-budget" in plan.refuse and "big" in plan.refuse
    assert policy.plan_load("fits", 3 * G, [R("p", 2, pinned=True), R("idle", 1)]) == LoadPlan(evict=("idle",))


def test_every_slot_pinned_refuses_and_says_which():
    plan = ResidencyPolicy(max_loaded=1).plan_load("b", G, [R("a", pinned=True)])
    assert "--max-loaded-models" in plan.refuse and "a" in plan.refuse


def test_the_ttl_expires_idle_models_only():
    policy = ResidencyPolicy(ttl_s=10)
    resident = [R("old", used=0), R("busy", used=0, in_use=1), R("pin", used=0, pinned=True), R("fresh", used=95)]
    assert policy.expired(resident, now=100) == ["old"]
    assert ResidencyPolicy(ttl_s=0).expired(resident, now=1e9) == []


# -- the pool -------------------------------------------------------------------------------------------------


class FakeSlot:
    def __init__(self, name):
        self.name, self.model, self.released = name, object(), False
        self.counters = None
        self.namespace = "f" * 16 + name

    def release(self):
        self.model, self.released = None, True


class FakeLoader:
    """Counts loads; each load waits on ``gate`` when set (to hold a load in flight), fails for names in ``broken``."""

    def __init__(self):
        self.loads: list[str] = []
        self.gate = None
        self.broken: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, name, spec):
        with self.lock:
            self.loads.append(name)
        if self.gate is not None:
            self.gate.wait(10)
        if name in self.broken:
            raise ModelLoadError(f"{spec}: no config.json")
        return FakeSlot(name)


@pytest.fixture(autouse=True)
def _weights_of_fakes(monkeypatch):
    import server.engine.engine as engine

    monkeypatch.setattr(engine, "weights_nbytes", lambda model: G)


def make_pool(loader, names=("a", "b", "c"), clock=time.monotonic, **policy):
    return ModelPool({n: f"/models/{n}" for n in names}, loader, ResidencyPolicy(**policy), clock=clock)


def test_a_burst_of_requests_for_an_unloaded_model_loads_it_once():
    loader = FakeLoader()
    loader.gate = threading.Event()
    pool = make_pool(loader, max_loaded=2)

    async def burst():
        tasks = [asyncio.ensure_future(pool.acquire("a")) for _ in range(8)]
        await asyncio.sleep(0.1)
        assert pool.entry("a").state == "loading"
        loader.gate.set()
        return await asyncio.gather(*tasks)

    leases = asyncio.run(burst())
    assert loader.loads == ["a"]
    assert len({id(lease.slot) for lease in leases}) == 1 and pool.entry("a").in_use == 8
    for lease in leases:
        lease.release()
        lease.release()  # idempotent
    assert pool.entry("a").in_use == 0


def test_the_least_recently_used_idle_model_is_evicted_and_a_model_in_use_is_not():
    loader = FakeLoader()
    now = [0.0]
    pool = make_pool(loader, clock=lambda: now[0], max_loaded=2)
    a = pool.acquire_sync("a")
    now[0] = 1
    pool.acquire_sync("b").release()
    now[0] = 2
    c = pool.acquire_sync("c")  # a is in use: b goes although a is older
    assert [e.state for e in pool.entries()] == ["loaded", "not_loaded", "loaded"]
    assert pool.entry("b").unloads == 1
    with pytest.raises(ModelInUse):
        pool.unload("a")
    a.release()
    c.release()
    assert pool.unload("a") and pool.entry("a").state == "not_loaded"
    assert not pool.unload("a")  # already out


def test_a_load_waits_for_a_release_when_every_model_in_the_way_is_in_use():
    loader = FakeLoader()
    pool = make_pool(loader, max_loaded=1)
    a = pool.acquire_sync("a")
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire_sync("b", timeout=10)))
    t.start()
    time.sleep(0.2)
    assert not got and pool.entry("a").state == "loaded" and loader.loads == ["a"]
    a.release()
    t.join(10)
    assert got and got[0].name == "b" and pool.entry("a").state == "not_loaded"
    got[0].release()


def test_a_failed_load_fails_every_waiter_once_and_the_next_request_tries_again():
    loader = FakeLoader()
    loader.broken.add("a")
    loader.gate = threading.Event()
    pool = make_pool(loader)

    async def burst():
        tasks = [asyncio.ensure_future(pool.acquire("a")) for _ in range(4)]
        await asyncio.sleep(0.1)
        loader.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(burst())
    assert all(isinstance(r, ModelLoadFailed) and "no config.json" in str(r) for r in results)
    assert loader.loads == ["a"] and "no config.json" in pool.entry("a").error
    loader.broken.clear()
    pool.acquire_sync("a").release()
    assert loader.loads == ["a", "a"] and pool.entry("a").error is None


def test_a_model_that_can_never_fit_is_refused_before_loading():
    loader = FakeLoader()
    pool = ModelPool({"big": "/nowhere"}, loader, ResidencyPolicy(budget_bytes=G, fixed_bytes=G))
    pool.entry("big").nbytes = G
    with pytest.raises(ModelWontFit, match="--memory-budget"):
        pool.acquire_sync("big")
    assert loader.loads == []


def test_the_ttl_sweep_unloads_idle_models_and_keeps_pinned_and_busy_ones():
    loader = FakeLoader()
    now = [0.0]
    pool = ModelPool({n: n for n in "abc"}, loader, ResidencyPolicy(ttl_s=30), clock=lambda: now[0], pinned=("c",))
    pool.start()  # loads the pinned one now
    assert loader.loads == ["c"]
    pool.acquire_sync("a").release()
    b = pool.acquire_sync("b")
    now[0] = 31
    assert pool.sweep() == ["a"]
    assert [e.state for e in pool.entries()] == ["not_loaded", "loaded", "loaded"]
    b.release()
    now[0] = 100
    assert pool.sweep() == ["b"]
    pool.stop()


def test_pinning_an_unknown_name_is_an_error_that_lists_the_models():
    with pytest.raises(ValueError, match="a, b"):
        ModelPool({"a": "a", "b": "b"}, FakeLoader(), ResidencyPolicy(), pinned=("z",))


def test_models_dir_lists_model_directories_and_gguf_files_and_finds_new_ones(tmp_path):
    (tmp_path / "coder").mkdir()
    (tmp_path / "coder" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    (tmp_path / "readme.txt").write_text("x")
    pool = ModelPool({}, FakeLoader(), ResidencyPolicy(), models_dir=str(tmp_path), reserved=frozenset({"base"}))
    assert pool.names() == ["coder", "small"]
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "config.json").write_text("{}")
    pool.refresh(max_age_s=0)  # what GET /v1/models does
    assert pool.knows("late") and not pool.knows("base") and pool.names() == ["coder", "late", "small"]


# -- the flags -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values,base,base_name,named", [
    (["default"], "default", None, {}),
    (["/m/smol"], "/m/smol", None, {}),
    (["/m/smol", "coder=/m/qwen"], "/m/smol", None, {"coder": "/m/qwen"}),
    (["coder=/m/qwen", "chat=/m/smol"], "/m/qwen", "coder", {"chat": "/m/smol"}),
    (["/m/a=b"], "/m/a=b", None, {}),  # a path with '=' stays a path
])
def test_model_flags_split_the_base_from_the_named_models(values, base, base_name, named):
    flags = parse_model_flags(values)
    assert (flags.base, flags.base_name, flags.named) == (base, base_name, named)


@pytest.mark.parametrize("values,match", [
    (["/a", "/b"], "give the others a name"),
    (["x=/a", "x=/b"], "taken"),
    (["x="], "NAME=PATH"),
])
def test_model_flags_that_cannot_mean_anything_say_what_to_write(values, match):
    with pytest.raises(ModelLoadError, match=match):
        parse_model_flags(values)


# -- names -----------------------------------------------------------------------------------------------------


def test_names_resolve_adapter_then_base_then_on_demand_then_alias_patterns_in_their_order():
    from types import SimpleNamespace

    from server.catalog import AdapterRegistry
    from server.errors import ModelNotFound
    from server.http.target import resolve

    pool = make_pool(FakeLoader(), names=("coder", "small"))
    adapters = AdapterRegistry()
    adapters.add(SimpleNamespace(name="ada"))
    rules = (("claude-*haiku*", "small"), ("claude-*", None), ("gpt-*", "coder"))
    state = SimpleNamespace(models=pool, adapters=adapters, model_names={"default", "SmolLM2"}, alias_rules=rules,
                            model_aliases=tuple(p for p, t in rules if t is None))
    assert [resolve(state, n).on_demand for n in ("coder", "ada", "default", "claude-3-5-haiku-2024",
                                                   "claude-sonnet-4", "gpt-5", None)] == [
        "coder", None, None, "small", None, "coder", None]
    assert resolve(state, "ada").adapter.name == "ada"
    assert resolve(state, "claude-sonnet-4") == resolve(state, None)  # the base model (an alias pattern)
    with pytest.raises(ModelNotFound, match="coder, small"):
        resolve(state, "llama-9")


def test_a_waiter_whose_client_left_cancels_neither_the_load_nor_the_other_waiters():
    loader = FakeLoader()
    loader.gate = threading.Event()
    pool = make_pool(loader)

    async def scenario():
        leaver = asyncio.ensure_future(pool.acquire("a"))
        stayer = asyncio.ensure_future(pool.acquire("a"))
        await asyncio.sleep(0.1)
        leaver.cancel()  # what a disconnect does to the handler awaiting the load
        await asyncio.sleep(0.05)
        loader.gate.set()
        lease = await stayer
        assert leaver.cancelled() and lease.slot is not None
        lease.release()

    asyncio.run(scenario())
    assert loader.loads == ["a"] and pool.entry("a").state == "loaded" and pool.entry("a").in_use == 0


def test_two_models_asked_for_at_once_with_one_slot_load_one_after_the_other():
    """A load in flight counts against the caps: the second model waits instead of loading beside it, and cannot
    evict the first before the request that waited for it has taken it."""
    loader = FakeLoader()
    loader.gate = threading.Event()
    pool = make_pool(loader, max_loaded=1)

    async def scenario():
        ta = asyncio.ensure_future(pool.acquire("a"))
        await asyncio.sleep(0.05)
        tb = asyncio.ensure_future(pool.acquire("b"))
        await asyncio.sleep(0.1)
        assert loader.loads == ["a"] and pool.entry("b").state == "not_loaded"  # b waits for a's slot
        loader.gate.set()
        la = await ta
        await asyncio.sleep(0.1)
        assert not tb.done() and pool.entry("a").state == "loaded"  # a is held by its request
        la.release()
        lb = await tb
        assert pool.entry("a").state == "not_loaded" and lb.slot is not None
        lb.release()

    asyncio.run(scenario())
    assert loader.loads == ["a", "b"]
