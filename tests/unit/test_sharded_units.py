"""The pieces of the sharded server that need no second process: the tick plan's wire format, a job's round trip
to a follower, the cache-take agreement (with a scripted group), split checks and shard fingerprints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from cache.prompt_cache import CacheHit
from models.errors import ModelLoadError
from models.sharding import check_splits
from server.distributed import Group
from server.jobs import Job, SamplingParams
from server.replay import Leader, Plan, job_from_spec, job_spec
from server.sharded_cache import ShardedPromptCache


def test_plan_round_trips_through_bytes():
    plan = Plan(admit=[{"id": "a", "prompt": [1, 2, 3]}], cancel=["b"], waiting=True, check={"c": 4})
    assert Plan.decode(plan.encode()) == plan
    assert Plan.decode(Plan([], [], False, {}, stop=True).encode()).stop


def test_job_spec_round_trip_keeps_what_the_lane_reads():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=("\n\n", "END"),
                            logit_bias={42: -100.0, 7: 2.5}, logprobs=True, top_logprobs=2, repetition_penalty=1.1)
    job = Job(prompt=[5, 6, 7], params=params, sink=lambda e: None, session="s1")
    spec = job_spec(job, cancelled=True)
    import orjson

    back = job_from_spec(orjson.loads(orjson.dumps(spec)), tokenizer=None)
    assert back.params == params and back.prompt == job.prompt and back.session == "s1" and back.id == job.id
    assert back.cancel.is_set()


def test_grammar_travels_as_text_and_compiles_on_the_follower():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from models import ensure_default_model
    from server.grammar import GrammarSpec

    tok = load_tokenizer(Path(ensure_default_model(progress=False)))
    grammar = GrammarSpec.compile(tok, '{"grammars": [{"json_schema": {"type": "object"}}]}')
    job = Job(prompt=[1], params=SamplingParams(max_tokens=4, grammar=grammar), sink=lambda e: None)
    back = job_from_spec(job_spec(job, cancelled=False), tok)
    assert back.params.grammar is not None and back.params.grammar.grammar == grammar.grammar
    assert not back.cancel.is_set()


class ScriptedGroup:
    """A group whose collectives return what the other ranks would have contributed (scripted)."""

    def __init__(self, rank: int, leader_values=(), others_missing=0):
        self.rank = rank
        self.leader = rank == 0
        self._values = list(leader_values)
        self._missing = others_missing
        self.calls = []

    def share_int(self, value):
        self.calls.append(("share_int", value))
        return value if self.leader else self._values.pop(0)

    def count(self, flag):
        self.calls.append(("count", flag))
        return int(flag) + self._missing

    def share_bytes(self, data):
        self.calls.append(("share_bytes", data))
        return data


@dataclass
class FakeTier:
    """take() returns a hit of min(len(tokens) - 1, have) tokens; records what it was asked."""

    have: int
    asked: list = None

    def take(self, tokens, ns, session=None):
        self.asked = (self.asked or []) + [list(tokens)]
        n = min(len(tokens) - 1, self.have)
        return CacheHit(["caches"], n, "ram") if n > 0 else None

    def peek(self, tokens, ns, session=None):
        return min(len(tokens) - 1, self.have)

    def stats(self):
        return {"hits": 1}


def test_leader_uses_its_hit_when_every_rank_has_the_prefix():
    tier = FakeTier(have=5)
    cache = ShardedPromptCache(tier, ScriptedGroup(0))
    hit = cache.take(list(range(10)), "ns")
    assert hit is not None and hit.length == 5
    assert cache.stats() == {"hits": 1}  # everything else is this rank's own tier


def test_every_rank_drops_the_hit_when_one_rank_lacks_its_shard():
    leader = ShardedPromptCache(FakeTier(have=5), ScriptedGroup(0, others_missing=1))
    assert leader.take(list(range(10)), "ns") is None
    assert leader.shard_stats() == {"takes_dropped": 1, "tokens_dropped": 5}
    follower_tier = FakeTier(have=3)  # evicted at another moment: holds a shorter prefix only
    follower = ShardedPromptCache(follower_tier, ScriptedGroup(1, leader_values=[5]))
    assert follower.take(list(range(10)), "ns") is None
    assert follower_tier.asked == [list(range(6))]  # asked for exactly rank 0's prefix (plus the one to forward)


def test_follower_takes_exactly_rank_0s_prefix_even_when_it_has_more():
    tier = FakeTier(have=8)
    follower = ShardedPromptCache(tier, ScriptedGroup(1, leader_values=[5]))
    hit = follower.take(list(range(10)), "ns")
    assert hit is not None and hit.length == 5


def test_no_hit_on_rank_0_means_no_take_anywhere():
    tier = FakeTier(have=8)
    follower = ShardedPromptCache(tier, ScriptedGroup(1, leader_values=[0]))
    assert follower.take(list(range(10)), "ns") is None and tier.asked is None


def test_peek_is_rank_0s_answer():
    assert ShardedPromptCache(FakeTier(have=4), ScriptedGroup(1, leader_values=[7])).peek([1] * 10, "ns") == 7
    assert ShardedPromptCache(FakeTier(have=4), ScriptedGroup(0)).peek([1] * 10, "ns") == 4


def test_leader_hands_the_lane_views_whose_cancel_changes_only_at_a_tick_start():
    group = ScriptedGroup(0)
    leader = Leader(group)
    job = Job(prompt=[1, 2], params=SamplingParams(max_tokens=2), sink=lambda e: None)
    (view,) = leader.lead([job], [], waiting=False)
    assert view is not job and view.id == job.id and leader.origin(view) is job
    job.cancel.set()  # the client went away in the middle of a tick
    assert not view.cancel.is_set()

    @dataclass
    class Running:
        job: Job
        seq: object

    @dataclass
    class Seq:
        generated: list

    leader.lead([], [Running(view, Seq([3, 4]))], waiting=True)
    assert view.cancel.is_set()
    plan = Plan.decode(group.calls[-1][1])
    assert plan.cancel == [job.id] and plan.check == {job.id: 2} and plan.waiting


def test_tensor_split_needs_divisible_heads(tmp_path):
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3}
    check_splits(cfg, 3, "tensor", tmp_path)
    with pytest.raises(ModelLoadError, match="9 attention heads, which do not split over 2 processes.*--pipeline"):
        check_splits(cfg, 2, "tensor", tmp_path)


def test_pipeline_split_needs_a_weight_index(tmp_path):
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json"):
        check_splits({}, 2, "pipeline", tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    check_splits({}, 2, "pipeline", tmp_path)


def test_shard_fingerprints_differ_per_rank_split_and_from_the_model():
    fp = "ab" * 32
    g = Group(group=None, rank=1, size=2, mode="tensor", backend="ring")
    names = {g.shard_fingerprint(fp, r) for r in range(2)}
    names.add(Group(None, 0, 2, "pipeline", "ring").shard_fingerprint(fp))
    names.add(Group(None, 0, 3, "tensor", "ring").shard_fingerprint(fp))
    assert len(names) == 4 and fp not in names
    manifest = g.shard_manifest(fp)
    assert manifest["rank"] == 1 and manifest["ranks"][1] == g.shard_fingerprint(fp)
    assert all(len(n) == 64 and int(n, 16) >= 0 for n in names)


def test_a_single_process_starts_no_group(monkeypatch):
    from server import distributed

    for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.init_group("tensor") is None


def test_lane_without_a_group_reads_the_queue_live():
    """The single-process lane passes no plan: ``waiting`` is read when a prefill asks (unchanged behaviour)."""
    from server.lane import Lane

    class E:
        prefill_chunk = 4

    lane = Lane(E())
    assert lane.replay is None and lane._tick_waiting is None
    lane._waiting.append(object())
    assert lane._others_need_prefill()
