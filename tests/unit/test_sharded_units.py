"""The pieces of the sharded server that need no second process: the tick plan's wire format, a sequence's round
trip to a follower, the cache-take agreement (with a scripted group), split checks and shard fingerprints."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from cache.prompt_cache import CacheHit
from cache.sharded import ShardedPromptCache
from models.errors import ModelLoadError
from models.loading.sharding import check_splits
from server.engine.distributed import Group
from server.lane.events import SamplingParams
from server.lane.plan import Chunk, Start, TickPlan
from server.lane.replay import Follower, Leader, seq_from_spec, seq_spec
from server.lane.sequence import Phase, Sequence


def make(name: str, prompt=(1, 2, 3), **params) -> Sequence:
    return Sequence(prompt=list(prompt), params=SamplingParams(max_tokens=4, **params), sink=lambda e: None, id=name)


def test_a_plan_round_trips_through_bytes_onto_the_followers_own_sequences():
    running = {n: make(n) for n in ("r", "s", "t")}
    new = make("n", prompt=(9, 8, 7, 6))
    plan = TickPlan(admit=(new,), cancel=(running["t"],), prefill=((Chunk(new, 3),),), store_now=True,
                    start=(Start(None, batch=(running["r"], new)),), leave=(), decode=(None,),
                    solo=(running["s"],), make_room=123)
    data = plan.encode(seq_spec, check={"r": 5})
    mine = {n: make(n) for n in ("r", "s", "t")}  # the follower's own objects for the same ids
    back, check = TickPlan.decode_from(data, mine, lambda spec: seq_from_spec(spec))
    assert check == {"r": 5} and back.make_room == 123 and back.store_now and back.decode == (None,)
    (admitted,) = back.admit
    assert admitted is not new and admitted.id == "n" and admitted.prompt == new.prompt
    assert back.cancel == (mine["t"],) and back.solo == (mine["s"],)
    assert [(c.seq, c.tokens) for c in back.prefill[0]] == [(admitted, 3)]
    assert back.start[0].batch == (mine["r"], admitted)


def test_a_sequence_spec_round_trip_keeps_what_the_lane_reads():
    params = dict(temperature=0.5, top_k=3, seed=11, stop=("\n\n", "END"), logit_bias={42: -100.0, 7: 2.5},
                  logprobs=True, top_logprobs=2, repetition_penalty=1.1)
    seq = make("a", prompt=(5, 6, 7), **params)
    seq.session = "s1"
    seq.cancel.set()
    back = seq_from_spec(orjson.loads(orjson.dumps(seq_spec(seq))))
    assert back.params == seq.params and back.prompt == seq.prompt and back.session == "s1" and back.id == "a"
    assert back.cancel.is_set() and back.phase == Phase.WAITING


@pytest.mark.model
def test_grammar_travels_as_text_and_compiles_on_the_follower():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from models import ensure_default_model
    from server.core.grammar import GrammarSpec

    tok = load_tokenizer(Path(ensure_default_model(progress=False)))
    grammar = GrammarSpec.compile(tok, '{"grammars": [{"json_schema": {"type": "object"}}]}')
    seq = make("g", prompt=(1,), grammar=grammar)
    back = seq_from_spec(seq_spec(seq), lambda text: GrammarSpec.compile(tok, text))
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


def test_a_local_peek_is_no_collective():
    """Rank 0's scheduler sizes a new sequence's first chunk before its plan goes out: asking the other ranks then
    would deadlock them (they wait for the plan), so that estimate is this rank's own."""
    group = ScriptedGroup(0)
    assert ShardedPromptCache(FakeTier(have=4), group).peek([1] * 10, "ns", local=True) == 4
    assert group.calls == []


def test_the_leader_broadcasts_each_plan_and_a_follower_executes_it_on_its_own_sequences():
    group = ScriptedGroup(0)
    leader = Leader(group)
    r = make("r")
    r.generated = [3, 4]
    r.cancel.set()  # the client went away: the scheduler put it in this plan's cancellations
    leader.lead(TickPlan(cancel=(r,)), [r])
    data = group.calls[-1][1]

    class FollowerLane:
        def __init__(self):
            self.mine = make("r")
            self.mine.generated = [3, 4]
            self.executed = []
            self.engine = None

        def running(self):
            return [self.mine]

        def execute(self, plan):
            self.executed.append(plan)

    class Replayed:
        rank, leader = 1, False

        def __init__(self, messages):
            self.messages = list(messages)

        def share_bytes(self, data):
            return self.messages.pop(0)

    lane = FollowerLane()
    follower = Follower(Replayed([data, b'{"stop": true}']))
    follower.follow(lane)
    (plan,) = lane.executed
    assert plan.cancel == (lane.mine,) and lane.mine.cancel.is_set() and follower.diverged == 0


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
    assert all(re.fullmatch(r"[0-9a-f]{64}", n) for n in names)  # usable as SSD directory names


def test_a_single_process_starts_no_group(monkeypatch):
    from server.engine import distributed
    for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.init_group("tensor") is None


class ThreadedGroup:
    """Two ranks in two threads of this process: each collective is a sum of both ranks' contributions, as
    ``Group._sum`` is (rank 0 gives the value, the other zeros), and ``open_doorbell`` is the real one."""

    def __init__(self, rank: int, meeting: "Meeting"):
        self.rank, self.size, self.leader = rank, 2, rank == 0
        self._meeting = meeting

    def share_int(self, value):
        return self._meeting.sum(self.rank, value if self.leader else 0)

    def count(self, flag):
        return self._meeting.sum(self.rank, int(bool(flag)))

    def share_bytes(self, data):
        return self._meeting.sum(self.rank, data if self.leader else b"")

    def open_doorbell(self):
        return Group.open_doorbell(self)


class Meeting:
    """Where the two ranks' collectives meet: each call blocks until both ranks made it."""

    def __init__(self):
        import threading
        self._cond = threading.Condition()
        self._round, self._values, self._result = 0, {}, None

    def sum(self, rank, value):
        with self._cond:
            mine = self._round
            self._values[rank] = value
            if len(self._values) == 2:
                self._result, self._values = self._values[0] + self._values[1], {}
                self._round += 1
                self._cond.notify_all()
            else:
                assert self._cond.wait_for(lambda: self._round > mine, timeout=10), "the other rank never came"
            return self._result


def opened_pair(follower_group=None):
    """A Leader and a Follower over a ThreadedGroup pair, each past ``open`` (the follower's in a thread)."""
    import threading

    meeting = Meeting()
    leader = Leader(ThreadedGroup(0, meeting))
    follower = Follower((follower_group or ThreadedGroup)(1, meeting))
    opened = threading.Thread(target=follower.open)
    opened.start()
    leader.open()
    opened.join(10)
    return leader, follower


class IdleLane:
    """A follower's lane with nothing running, that records the plans it executes."""

    engine = None

    def __init__(self):
        self.executed = []

    def running(self):
        return []

    def execute(self, plan):
        self.executed.append(plan)


def test_leader_host_is_rank_0s_address_from_the_launchers_variables(tmp_path):
    from server.engine.doorbell import leader_host

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[["10.0.0.2:5000", "10.0.0.2:5001"], ["10.0.0.3:5002"]]')
    assert leader_host({"MLX_HOSTFILE": str(hostfile)}) == "10.0.0.2"
    assert leader_host({"MLX_HOSTFILE": '[["127.0.0.1:6000"], ["127.0.0.1:6001"]]'}) == "127.0.0.1"
    assert leader_host({"NCCL_HOST_IP": "192.168.1.7"}) == "192.168.1.7"
    assert leader_host({"MLX_HOSTFILE": str(tmp_path / "gone.json")}) is None
    assert leader_host({}) is None


def test_idle_followers_block_on_the_doorbell_and_wake_for_the_next_plan(monkeypatch):
    """Rank 0's lane goes idle: the follower leaves the broadcast (which polls a core on MLX's ring backend) for a
    blocking socket read, and the next plan rings it back; stop rings too."""
    import threading
    import time

    monkeypatch.setenv("MLX_HOSTFILE", '[["127.0.0.1:1"], ["127.0.0.1:2"]]')
    leader, follower = opened_pair()
    assert leader.doorbell is not None and follower.doorbell is not None
    assert leader.describe() == {"idle_followers": "doorbell"}

    waits = []
    real_wait = follower.doorbell.wait
    follower.doorbell.wait = lambda: (waits.append("in"), real_wait(), waits.append("out"))

    lane = IdleLane()
    following = threading.Thread(target=follower.follow, args=(lane,))
    following.start()
    leader.rest()
    leader.rest()  # already resting: no second broadcast
    deadline = time.monotonic() + 10
    while waits != ["in"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waits == ["in"] and following.is_alive()  # blocked on the doorbell
    leader.lead(TickPlan(), [])
    leader.rest()
    leader.stop()
    following.join(10)
    assert not following.is_alive()
    assert waits == ["in", "out", "in", "out"] and len(lane.executed) == 1


def test_a_group_without_rank_0s_address_keeps_polling(monkeypatch):
    for k in ("MLX_HOSTFILE", "NCCL_HOST_IP"):
        monkeypatch.delenv(k, raising=False)
    leader, follower = opened_pair()
    assert leader.doorbell is None and follower.doorbell is None
    assert leader.describe() == {"idle_followers": "polling"}
    leader.rest()  # no doorbell: nothing is broadcast, the followers wait in the next plan's broadcast as before
    assert not leader.resting


def test_a_stranger_that_connects_first_takes_no_followers_place(monkeypatch):
    """Rank 0's doorbell port is open to anyone while the followers connect: a connection that does not say this
    start's secret is closed, and the follower's own is the one rank 0 rings."""
    import socket
    import threading
    import time

    monkeypatch.setenv("MLX_HOSTFILE", '[["127.0.0.1:1"], ["127.0.0.1:2"]]')
    strangers = []

    class FollowerGroup(ThreadedGroup):
        def share_int(self, value):
            got = super().share_int(value)
            if not strangers:  # the port: a stranger connects before the follower does
                strangers.append(socket.create_connection(("127.0.0.1", got), timeout=10))
                strangers[0].sendall(b"12345 1\n")
            return got

    leader, follower = opened_pair(FollowerGroup)
    assert leader.doorbell is not None and follower.doorbell is not None
    assert strangers[0].recv(1) == b""  # rank 0 closed it

    lane = IdleLane()
    following = threading.Thread(target=follower.follow, args=(lane,))
    following.start()
    leader.rest()
    time.sleep(0.05)
    leader.lead(TickPlan(), [])
    leader.stop()
    following.join(10)
    assert not following.is_alive() and len(lane.executed) == 1
