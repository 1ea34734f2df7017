"""Hybrid models (recurrent state beside attention) batched exactly (issue 35): rows of a tiny random qwen3-next of
different lengths, joining and leaving at different steps, each give the tokens they give alone; a row moves
between its solo decoder and the batch without a token fed twice (recurrent state cannot take one back: neither
side runs ahead); what leaves covers exactly its history but the next input. Before, a row that migrated from
solo decoding into the batch had its caches "trimmed" by a token they silently kept (mlx-lm's trim refuses an
ArraysCache), so it fed that token twice and its text differed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from server.engine.batch import BatchKind, CacheFacts, Layout, Row, choose, joins, moves
from server.engine.batch.ragged import RaggedBatch
from server.engine.batch.solo import SoloBatch


def tiny_qwen3_next(seed: int = 0, vocab: int = 97):
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs.from_dict({
        "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4,
        "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096, "full_attention_interval": 2, "tie_word_embeddings": False})
    mx.random.seed(seed)
    model = qwen3_next.Model(args)
    weights = dict(tree_flatten(model.parameters()))
    weights["model.embed_tokens.weight"] = mx.random.normal(weights["model.embed_tokens.weight"].shape)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model():
    m = tiny_qwen3_next()
    kinds = {type(c) for c in make_prompt_cache(m)}
    assert kinds == {KVCache, ArraysCache}  # a hybrid: attention and recurrent layers
    return m


class Seq:
    def __init__(self, prompt, max_tokens=64):
        self.prompt, self.generated = list(prompt), []
        self.params = type("P", (), {"max_tokens": max_tokens})()


def own_caches(model, tokens):
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=caches))
    return caches


def alone(model, prompt, n):
    caches = own_caches(model, prompt[:-1])
    return [int(t) for t, _ in generate_step(mx.array(prompt[-1:]), model, max_tokens=n, prompt_cache=caches)]


def submit(lane, name, prompt, n=10):
    """A greedy request of ``n`` tokens into the real lane (its namespace as the server gives it)."""
    from server.lane.events import SamplingParams
    from server.lane.sequence import Sequence

    target = lane.engine.base_target()
    params = SamplingParams(max_tokens=n, temperature=0.0)
    seq = Sequence(prompt=list(prompt), params=params, sink=lambda e: None, id=name, target=target,
                   ns=lane.engine.namespace_for(target, params))
    lane.submit(seq)
    return seq


PROMPTS = [list(range(3, 40)), list(range(50, 57)), [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, list(range(60, 64))]
HYBRID = CacheFacts(plain_kv=False, mergeable=True, recurrent=True, ragged=True)


def test_a_hybrid_batches_in_the_ragged_layout_and_leaves_it_for_solo_only_where_nothing_runs_ahead():
    cpu, gpu = Layout(), Layout(gpu=True, fused_attention=True)
    assert choose(cpu, HYBRID, False) == choose(gpu, HYBRID, False) == BatchKind.RAGGED
    assert moves(BatchKind.RAGGED, HYBRID, cpu) and not moves(BatchKind.MLX, HYBRID, cpu)
    # on a GPU the ragged batch pipelines: a hybrid row joins it from solo decoding but leaves only when it finishes
    assert not moves(BatchKind.RAGGED, HYBRID, gpu) and joins(BatchKind.RAGGED, HYBRID)
    assert not joins(BatchKind.MLX, HYBRID)
    assert choose(Layout(gpu=True), HYBRID, False) == BatchKind.MLX  # no fused kernel (Metal): mlx-lm's batch


def test_hybrid_rows_joining_and_leaving_at_different_steps_give_their_alone_tokens(model):
    want = {i: alone(model, p, 12) for i, p in enumerate(PROMPTS)}
    batch = RaggedBatch(model)
    seqs = [Seq(p) for p in PROMPTS]
    joins = {0: [0, 1], 3: [2], 5: [3]}
    for step in range(40):
        for i in joins.get(step, []):
            batch.add([Row(seqs[i], own_caches(model, PROMPTS[i][:-1]), PROMPTS[i])])
        for out in batch.step():
            out.seq.generated.append(out.token)
        done = [s for s in seqs if s in batch and len(s.generated) >= 12]
        for s, cov in zip(done, batch.remove(done)):
            assert cov.tokens == s.prompt + s.generated[:-1]  # its history but the next input, exactly
            assert all(c.offset == len(cov.tokens) for c in cov.caches if isinstance(c, KVCache))
            assert any(isinstance(c, ArraysCache) and c.cache[0] is not None for c in cov.caches)
        if not len(batch) and step > 5:
            break
    for i, s in enumerate(seqs):
        assert s.generated[:12] == want[i], i


def test_a_hybrid_row_moves_solo_to_batch_to_solo_without_feeding_a_token_twice(model):
    """The lane's moves: a row decodes alone (the non-pipelined solo decoder), joins the batch beside another,
    leaves it again: its tokens are those it makes alone all the way."""
    prompt, other = PROMPTS[0], PROMPTS[1]
    want = alone(model, prompt, 15)
    a, b = Seq(prompt), Seq(other)
    solo = SoloBatch(model, pipelined=False)
    solo.add([Row(a, own_caches(model, prompt[:-1]), prompt)])
    for _ in range(5):
        (out,) = solo.step()
        a.generated.append(out.token)
    (cov,) = solo.remove([a])
    history = a.prompt + a.generated
    assert cov.tokens == history[:-1]  # nothing ran ahead: no token to take back
    batch = RaggedBatch(model)
    batch.add([Row(a, cov.caches, history), Row(b, own_caches(model, other[:-1]), other)])
    for _ in range(5):
        for out in batch.step():
            out.seq.generated.append(out.token)
    (cov,) = batch.remove([a])
    history = a.prompt + a.generated
    assert cov.tokens == history[:-1]
    solo = SoloBatch(model, pipelined=False)
    solo.add([Row(a, cov.caches, history)])
    for _ in range(5):
        (out,) = solo.step()
        a.generated.append(out.token)
    assert a.generated == want
    assert b.generated == alone(model, other, 5)


def test_on_the_lane_four_hybrid_requests_arriving_at_different_times_make_their_alone_tokens(model):
    """The real engine and lane: the first request decodes alone (solo), the next ones join it in the ragged batch
    as they arrive, the batch shrinks as they end; every request makes the tokens it makes alone, and each stored
    entry covers exactly what it computed (nothing is refused as "caches cover N tokens, expected N-1")."""
    from types import SimpleNamespace

    from cache.prompt_cache import PromptCache
    from server.engine.engine import Engine, EngineConfig
    from server.lane.lane import Lane
    from server.lane.sequence import Phase
    from server.stats import ServingStats
    from tests.fixtures.tiny_models import IdTokenizer

    def lane_of(max_batch):
        loaded = SimpleNamespace(model=model, tokenizer=IdTokenizer(), fingerprint="h" * 16)
        cache, stats = PromptCache(1 << 26), ServingStats()
        engine = Engine(loaded, cache, stats, EngineConfig(prefill_chunk=16))
        engine.bind_stream()
        return Lane(engine, cache, stats, max_batch=max_batch), cache

    want = {}
    for i, p in enumerate(PROMPTS):
        lane, _ = lane_of(1)
        s = submit(lane, str(i), p)
        while not lane.idle():
            lane.tick()
        want[i] = list(s.generated)
        assert want[i] == alone(model, p, 10)
    lane, cache = lane_of(8)
    ARRIVALS = [0, 5, 7, 9]  # the first decodes alone by the time the second arrives
    seqs, phases = {}, set()
    for tick in range(200):
        if tick in ARRIVALS:
            i = ARRIVALS.index(tick)
            seqs[i] = submit(lane, str(i), PROMPTS[i])
        if lane.idle() and len(seqs) == 4:
            break
        lane.tick()
        phases |= {(s.id, s.phase) for s in seqs.values()}
    assert {("0", Phase.SOLO), ("0", Phase.BATCHED)} <= phases  # the first moved from solo into the batch
    for i, s in seqs.items():
        assert list(s.generated) == want[i], i
        assert s.stored == len(s.prompt) + 10 - 1  # its whole run was stored (all but the last token, unfed)
    for i, s in seqs.items():  # the run, with a checkpoint at the prompt's end (it superseded the boundary entry)
        key = tuple(s.prompt + s.generated[:-1])
        assert (s.ns, key) in set(cache.keys()) and (s.ns, tuple(s.prompt[:-1])) not in set(cache.keys()), i
        with cache._lock:
            assert len(s.prompt) - 1 in cache._by_ns[s.ns][key].trimmable, i


def test_a_turn_that_parts_inside_the_last_entry_reuses_its_checkpoint_and_gives_the_cold_tokens(model, tmp_path):
    """A hybrid's recurrent state cannot be cut back, so its entries used to serve only prompts that extend all of
    their tokens: a turn whose template re-renders the previous reply (or whose generation prompt opened a think
    block) parted inside and recomputed everything. With a checkpoint where the conversation ended (and at each
    chunk's end), the next turn takes the longest checkpoint before the parting, and its tokens are the cold run's.
    The same entry restored from SSD (a restart) serves it the same way."""
    from types import SimpleNamespace

    from cache.checkpoints import Checkpointed
    from cache.kvfile import load, save
    from cache.prompt_cache import NullPromptCache, PromptCache
    from server.engine.engine import Engine, EngineConfig
    from server.lane.events import Finished, SamplingParams
    from server.lane.lane import Lane
    from server.lane.sequence import Sequence
    from server.stats import ServingStats
    from tests.fixtures.tiny_models import IdTokenizer

    history = list(range(3, 45))  # the conversation so far
    turn1 = history + [90, 91]  # + a generation prompt that opens a think block, say
    turn2 = history + [70, 71, 72, 73, 90, 91]  # the previous reply rendered without it, a new user turn

    def lane_of(cache):
        loaded = SimpleNamespace(model=model, tokenizer=IdTokenizer(), fingerprint="c" * 16)
        stats = ServingStats()
        engine = Engine(loaded, cache, stats, EngineConfig(prefill_chunk=16))
        engine.bind_stream()
        return Lane(engine, cache, stats, max_batch=4)

    def run(lane, prompt, checkpoints=()):
        events = []
        target = lane.engine.base_target()
        params = SamplingParams(max_tokens=6, temperature=0.0)
        seq = Sequence(prompt=list(prompt), params=params, sink=events.append, id=str(len(prompt)), target=target,
                       ns=lane.engine.namespace_for(target, params), checkpoints=checkpoints)
        lane.submit(seq)
        while not lane.idle():
            lane.tick()
        return seq, next(e for e in events if isinstance(e, Finished))

    cold, _ = run(lane_of(NullPromptCache()), turn2)
    cache = PromptCache(1 << 26)
    lane = lane_of(cache)
    first, _ = run(lane, turn1, checkpoints=(len(history),))
    second, done = run(lane, turn2, checkpoints=(len(history) + 4,))
    assert done.cached_tokens == len(history)  # the checkpoint where the conversation ended
    assert list(second.generated) == list(cold.generated)
    stats = cache.stats()
    assert stats["checkpoint_hits"] == 1 and stats["checkpoint_tokens"] == len(history)  # what /stats shows
    # the first turn's entry carries its checkpoints; the prompt-boundary entry it extends was superseded
    entry = max(cache.keys(), key=lambda k: len(k[1]) if k[1][:len(turn1)] == tuple(turn1) else -1)
    assert (first.ns, tuple(turn1[:-1])) not in cache.keys()
    with cache._lock:
        stored = cache._by_ns[first.ns][entry[1]]
    ckpt = [c for c in stored.caches if isinstance(c, Checkpointed)]
    assert ckpt and len(history) in stored.trimmable and len(turn1) - 1 in stored.trimmable

    # through the SSD format: the same entry restored serves the second turn from the same checkpoint
    save(tmp_path / "e.safetensors", entry[1], stored.caches, fingerprint="f", ns=first.ns)
    back = load(tmp_path / "e.safetensors")
    assert back.meta.trimmable == stored.trimmable
    fresh = PromptCache(1 << 26)
    fresh.put(list(back.tokens), back.caches, first.ns)
    again, done = run(lane_of(fresh), turn2, checkpoints=(len(history) + 4,))
    assert done.cached_tokens == len(history) and list(again.generated) == list(cold.generated)


def test_pipelined_hybrid_rows_leaving_mid_run_keep_everyones_tokens_and_their_caches_continue_alone(model):
    """The GPU's mode: rows leave while a forward is in flight, and the last rows move into their holes. The rows that
    stay make their alone tokens, and the caches a leaver takes away continue as caches computed over its history
    alone do."""
    n = 14
    want = {i: alone(model, p, n) for i, p in enumerate(PROMPTS)}
    batch = RaggedBatch(model, pipelined=True)
    seqs = [Seq(p) for p in PROMPTS]
    batch.add([Row(s, own_caches(model, p[:-1]), p) for s, p in zip(seqs, PROMPTS)])
    left = []
    for step in range(40):
        for out in batch.step():
            out.seq.generated.append(out.token)
        if step == 4:  # rows 0 and 1 leave mid-run: the last rows move into their holes
            left = list(zip(seqs[:2], batch.remove(seqs[:2])))
        batch.remove([s for s in seqs[2:] if s in batch and len(s.generated) >= n])
        if not len(batch):
            break
    for i, s in enumerate(seqs[2:], 2):
        assert s.generated[:n] == want[i], i
    for i, (s, cov) in enumerate(left):
        history = s.prompt + s.generated
        assert cov.tokens == history  # pipelined: the forward in flight had fed its last token
        assert len(s.generated) >= 4
        nxt = 11  # any next input: the caches continue exactly as caches computed over the history alone
        got = [int(t) for t, _ in generate_step(mx.array([nxt]), model, max_tokens=6, prompt_cache=cov.caches)]
        assert got == alone(model, history + [nxt], 6), i


def test_a_leave_moves_one_rows_state_into_its_hole_in_place_not_every_rows():
    """RaggedStates.release: the last row's state fills the hole, the others stay where they are, and what is
    allocated meanwhile is about the moved row's copy, not a second copy of every row's state."""
    from server.engine.batch.ragged_states import RaggedStates

    rows, shape = 8, (1, 32, 64, 64)  # 512 KiB a row per array, float32
    row_bytes = 4 * 32 * 64 * 64
    states = RaggedStates([2])
    caches = []
    for r in range(rows):
        c = ArraysCache(2)
        c.cache = [mx.full(shape, float(r)), mx.full(shape, float(100 + r))]
        caches.append([c])
    states.extend(caches)
    del caches
    mx.eval(states.layers[0][0], states.layers[0][1])
    mx.synchronize()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    states.release([2], [7], rows - 1)  # row 2 left; row 7 moves into its hole
    a, b = states.layers[0][0], states.layers[0][1]
    mx.eval(a, b)
    mx.synchronize()
    grown = mx.get_peak_memory() - active
    assert a.shape[0] == b.shape[0] == rows - 1 and states.rows == rows - 1
    assert [float(a[i].max()) for i in range(rows - 1)] == [0, 1, 7, 3, 4, 5, 6]
    assert [float(b[i].min()) for i in range(rows - 1)] == [100, 101, 107, 103, 104, 105, 106]
    assert grown <= 4 * row_bytes, (grown, row_bytes)  # a gather of the 7 live rows would be 14 rows' worth


@pytest.mark.parametrize("kind", ["hybrid", "window"])
def test_a_request_speculating_alone_joins_the_batch_when_others_arrive_and_keeps_its_tokens(model, kind):
    """A hybrid (or a sliding-window model) cannot speculate in a batch, so a request that arrives alone speculates on
    its own (n-gram drafts here) and one that arrives with company decodes plainly. When company comes, the lone one
    joins the plain batch and drafts no more (``SeqFacts.yields``): its solo decoder hands its caches over with its
    next input unfed (recurrent state cannot take a fed token back, nor a wrapped window: the zoo's gpt-oss has 16-token
    windows, the prompts wrap them). Every request makes its alone greedy tokens, the first one moved from solo into
    the batch, and its stored run covers exactly what it computed."""
    from types import SimpleNamespace

    if kind == "window":
        from tests.fixtures import zoo

        model = zoo.build("gpt_oss", vocab=97, seed=3)

    from cache.prompt_cache import PromptCache
    from server.engine.engine import Engine, EngineConfig
    from server.engine.speculation import SpecTotals, Speculation
    from server.lane.lane import Lane
    from server.lane.sequence import Phase
    from server.stats import ServingStats
    from spec import NgramProvider
    from tests.fixtures.tiny_models import IdTokenizer

    loaded = SimpleNamespace(model=model, tokenizer=IdTokenizer(), fingerprint="h" * 16)
    cache, stats = PromptCache(1 << 26), ServingStats()
    speculation = Speculation(NgramProvider(), num_draft_tokens=3, kind="ngram")
    engine = Engine(loaded, cache, stats, EngineConfig(prefill_chunk=16, speculation=speculation))
    engine.bind_stream()
    lane = Lane(engine, cache, stats, max_batch=8)
    lane.stats.spec = SpecTotals("ngram", 3)

    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, list(range(50, 57)), list(range(3, 40))]
    arrivals = [0, 6, 6]  # the first speculates alone for a few steps; then two arrive with company
    seqs, phases, facts = {}, set(), {}
    for tick in range(300):
        for i, at in enumerate(arrivals):
            if tick == at:
                seqs[i] = submit(lane, str(i), prompts[i], 14)
        if lane.idle() and len(seqs) == len(prompts):
            break
        lane.tick()
        phases |= {(s.id, s.phase) for s in seqs.values()}
        facts.setdefault("0", []).append((seqs[0].phase, seqs[0].facts.drafting))
    first = seqs[0]
    assert (Phase.SOLO, True) in facts["0"]  # it speculated alone ...
    assert (Phase.BATCHED, False) in facts["0"]  # ... then decoded in the batch, drafting no more
    assert ("1", Phase.BATCHED) in phases and ("2", Phase.BATCHED) in phases
    assert not seqs[1].facts.drafting and not seqs[2].facts.drafting  # arrived with company: plain from the start
    for i, s in seqs.items():
        assert list(s.generated) == alone(model, prompts[i], 14), i
    assert first.stored == len(first.prompt) + 14 - 1
    assert (first.ns, tuple(first.prompt + first.generated[:-1])) in set(cache.keys())
    spec = lane.stats.spec.as_dict()
    assert spec["solo_joined_batch"] == 1
