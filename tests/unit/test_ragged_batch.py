"""The plain decode batch on the ragged layout (server.engine.batch.ragged over server.engine.batch.ragged_kv), on a tiny
random model: rows join into free slots and leave by moving the last row into the hole, never copying the others;
rows of mixed lengths and rows that share a prefix get exactly their own logits; the batch returns the same tokens
as mlx-lm's GenerationBatch (server.engine.batch.mlx.MlxBatch) for greedy rows, seeded sampled rows and rows with
penalties, logit bias and a grammar, whatever joins and leaves around them."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from server.engine.batch import LogitsRules, Row
from server.engine.batch.mlx import MlxBatch
from server.engine.batch.ragged import RaggedBatch
from server.engine.batch.ragged_kv import RaggedKV
from server.engine.sampling import build_sampler
from server.lane.events import SamplingParams
from tests.fixtures.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


def own_caches(model, tokens):
    caches = make_prompt_cache(model)
    if tokens:
        model(mx.array(tokens)[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def alone(model, tokens, nxt):
    """The logits of `nxt` after `tokens`, computed on a cache of its own."""
    return model(mx.array([[nxt]]), cache=own_caches(model, tokens))[0, -1]


def test_joins_fill_free_slots_and_leaves_move_only_the_last_row(model):
    prompts = [list(range(5, 30)), list(range(40, 47)), list(range(60, 63))]
    kv = RaggedKV.from_rows([own_caches(model, p) for p in prompts[:2]])
    assert kv.slots == 2 and kv.lengths == [25, 7]
    kv.extend([own_caches(model, prompts[2])])  # a third row: the buffers grow by half again, to 3 slots
    assert kv.slots == 3 and kv.lengths == [25, 7, 3]
    logits = model(mx.array([[1], [2], [3]]), cache=kv.layers)[:, -1]
    kv.commit([1, 1, 1])
    for i, (p, t) in enumerate(zip(prompts, (1, 2, 3))):
        assert mx.allclose(logits[i], alone(model, p, t), atol=1e-5)
    held = kv.nbytes
    layer0 = kv.layers[0].keys
    assert held == 2 * len(kv.layers) * layer0.nbytes  # keys + values of every layer, at full capacity
    order = kv.release([0])  # row 0 leaves: the last row (2) moves into its slot, row 1 stays where it is
    assert order == [2, 1] and kv.lengths == [4, 8] and kv.slots == 3
    assert kv.nbytes == held  # the free slot keeps its memory (what the memory budget counts: Scheduler.reserved)
    histories = [prompts[2] + [3], prompts[1] + [2]]
    logits = model(mx.array([[9], [8]]), cache=kv.layers)[:, -1]  # two live rows in three slots
    kv.commit([1, 1])
    assert mx.allclose(logits[0], alone(model, histories[0], 9), atol=1e-5)
    assert mx.allclose(logits[1], alone(model, histories[1], 8), atol=1e-5)
    kv.extend([own_caches(model, prompts[0])])  # joins the free slot: no growth
    assert kv.slots == 3 and kv.lengths == [5, 9, 25]
    out = kv.extract(1)
    assert out[0].offset == 9
    assert mx.allclose(model(mx.array([[4]]), cache=out)[0, -1], alone(model, histories[1] + [8], 4), atol=1e-5)
    assert kv.release([0, 1, 2]) == [] and len(kv) == 0 and kv.slots == 0


def test_rows_sharing_a_prefix_and_rows_of_mixed_lengths_see_only_their_own_history(model):
    shared = list(range(100, 140))
    prompts = [shared + [1, 2, 3], shared + [7], list(range(3, 6)), shared + list(range(150, 190))]
    kv = RaggedKV.from_rows([own_caches(model, p) for p in prompts])
    logits = model(mx.array([[11], [12], [13], [14]]), cache=kv.layers)[:, -1]
    for i, (p, t) in enumerate(zip(prompts, (11, 12, 13, 14))):
        assert mx.allclose(logits[i], alone(model, p, t), atol=1e-5)


def run(batch_cls, model, script, steps=14):
    """Drive a batch through `script` ({step: [("join", name, prompt, opts) | ("leave", name)]}); every row's
    returned tokens, and what `remove` handed back for the rows that left."""
    batch = batch_cls(model)
    seqs, tokens, covered = {}, {}, {}
    for step in range(steps):
        for action in script.get(step, []):
            if action[0] == "join":
                _, name, prompt, opts = action
                seqs[name] = SimpleNamespace(name=name)
                tokens[name] = []
                batch.add([Row(seqs[name], own_caches(model, prompt[:-1]), prompt, **opts())])
            else:
                (cov,) = batch.remove([seqs[action[1]]])
                covered[action[1]] = (cov.tokens, cov.caches[0].offset)
        for out in batch.step():
            assert out.logprobs.shape == (model.args.vocab_size,)
            tokens[out.seq.name].append(out.token)
    return tokens, covered


class StepGrammar:
    """A stand-in for GrammarProcessor (both of its faces: mlx-lm's processor call and ``allowed``): after token t it
    allows only t + 1 .. t + 4 (mod the vocabulary); at first, tokens 20-23."""

    def __init__(self, vocab: int):
        self.vocab, self.started = vocab, False

    def allowed(self, previous):
        start = (previous() + 1) if self.started else 20
        self.started = True
        a = np.zeros(self.vocab, dtype=np.bool_)
        a[[(start + k) % self.vocab for k in range(4)]] = True
        return a

    def __call__(self, tokens, logits):
        return mx.where(mx.array(self.allowed(lambda: int(tokens[-1].item()))), logits, -mx.inf)


def _opts(params: SamplingParams, grammar: bool = False):
    def make():
        sampler = None if params.temperature == 0 else build_sampler(params)
        return {"sampler": sampler, "rules": LogitsRules.of(params, StepGrammar(257) if grammar else None)}
    return make


def test_the_ragged_batch_returns_what_mlx_lms_batch_returns(model):
    greedy = _opts(SamplingParams(max_tokens=64, temperature=0.0))
    seeded = _opts(SamplingParams(max_tokens=64, temperature=0.9, seed=1234))
    penalised = _opts(SamplingParams(max_tokens=64, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5))
    biased = _opts(SamplingParams(max_tokens=64, temperature=0.9, seed=77, frequency_penalty=0.8,
                                  logit_bias={5: 3.0, 6: 2.0, 200: -4.0}))
    ruled = _opts(SamplingParams(max_tokens=64, temperature=0.0, repetition_penalty=1.5), grammar=True)
    script = {
        0: [("join", "a", list(range(10, 40)), greedy), ("join", "b", list(range(50, 55)), seeded)],
        3: [("join", "c", list(range(70, 130)), penalised), ("join", "e", [9, 9, 5, 6, 9], biased)],
        6: [("leave", "a"), ("join", "d", list(range(10, 40)) + [3, 4], greedy)],  # shares a's prefix
        7: [("join", "f", list(range(30, 45)), ruled)],
        9: [("leave", "c")],
    }
    ours, ours_left = run(RaggedBatch, model, script)
    theirs, theirs_left = run(MlxBatch, model, script)
    assert ours == theirs  # the same tokens, step for step
    for name in ("a", "c"):  # a leaving row's caches cover its prompt and every token it returned but the last
        toks, offset = ours_left[name]
        assert offset == len(toks) and toks[-(len(ours[name]) - 1):] == ours[name][:-1]
        assert theirs_left[name][0] == toks + ours[name][-1:]  # mlx-lm's batch had fed that one too


def test_a_joining_row_gets_its_first_token_from_the_next_step_and_leaves_with_exact_tokens(model):
    batch = RaggedBatch(model)
    a, b = SimpleNamespace(), SimpleNamespace()
    batch.add([Row(a, own_caches(model, [5, 6, 7]), [5, 6, 7, 8])])
    (out,) = batch.step()  # no forward of its own at the join: the step computes its first token
    first = out.token
    assert out.seq is a and first == int(mx.argmax(alone(model, [5, 6, 7], 8)).item())
    batch.add([Row(b, own_caches(model, [9, 10]), [9, 10, 11])])
    (cov,) = batch.remove([b])  # before any step: its caches cover its history but the next input
    assert cov.tokens == [9, 10] and cov.caches[0].offset == 2
    (out,) = batch.step()
    assert out.seq is a and out.token == int(mx.argmax(alone(model, [5, 6, 7, 8], first)).item())
    (cov,) = batch.remove([a])  # everything it fed; its latest token is its next input, not in the KV
    assert cov.tokens == [5, 6, 7, 8, first] and cov.caches[0].offset == 5


def test_the_pipelined_batch_returns_the_same_tokens_each_a_step_later_but_a_joiners_first(model):
    """Pipelined (the GPU's mode), a step returns what the previous forward sampled, except that a step in which
    rows joined waits and returns their first tokens at once; the tokens are the plain batch's."""
    greedy = _opts(SamplingParams(max_tokens=64, temperature=0.0))
    seeded = _opts(SamplingParams(max_tokens=64, temperature=0.9, seed=99))
    penalised = _opts(SamplingParams(max_tokens=64, temperature=0.0, repetition_penalty=1.3))
    script = {
        0: [("join", "a", list(range(10, 40)), greedy), ("join", "b", list(range(50, 55)), seeded)],
        4: [("join", "c", list(range(70, 130)), penalised)],
        7: [("leave", "a"), ("join", "d", list(range(10, 40)) + [3, 4], greedy)],
        10: [("leave", "c")],
    }
    plain, _ = run(RaggedBatch, model, script)
    piped, piped_left = run(lambda m: RaggedBatch(m, pipelined=True), model, script)
    for name, toks in plain.items():
        assert piped[name] == toks[:len(piped[name])] and len(piped[name]) >= len(toks) - 1, name
    for name in ("a", "c"):  # what a leaving row's caches cover is exactly what remove says, ending in its tokens
        toks, offset = piped_left[name]
        assert offset == len(toks) and toks[-len(piped[name]):] == piped[name]

    batch = RaggedBatch(model, pipelined=True)
    a = SimpleNamespace()
    batch.add([Row(a, own_caches(model, [5, 6, 7]), [5, 6, 7, 8])])
    (out,) = batch.step()  # the step it joined in returns its first token
    first = out.token
    assert out.seq is a and first == int(mx.argmax(alone(model, [5, 6, 7], 8)).item())
    assert batch.step() == []  # its second token is being computed while the lane goes on
    (out,) = batch.step()
    second = out.token
    assert second == int(mx.argmax(alone(model, [5, 6, 7, 8], first)).item())
    (cov,) = batch.remove([a])  # the forward in flight had fed `second`: the caches cover it
    assert cov.tokens == [5, 6, 7, 8, first, second] and cov.caches[0].offset == 6


@pytest.mark.parametrize("kind", [RaggedBatch, MlxBatch])
def test_both_batch_kinds_say_how_many_bytes_their_kv_holds(model, kind):
    """What the memory budget reads (``Scheduler.reserved``): at least the rows' own KV, nothing once empty."""
    batch = kind(model)
    assert batch.kv_nbytes() == 0
    prompts = [list(range(10, 40)), list(range(50, 55))]
    rows = [own_caches(model, p[:-1]) for p in prompts]
    own = sum(c.nbytes for r in rows for c in r)
    seqs = [SimpleNamespace(id=n) for n in "ab"]
    batch.add([Row(seq, caches, p) for seq, caches, p in zip(seqs, rows, prompts)])
    batch.step()
    assert batch.kv_nbytes() >= own > 0
    batch.remove(seqs)
    assert batch.kv_nbytes() == 0 or kind is MlxBatch  # mlx-lm's empty batch may keep its arrays until a join


def test_window_rows_decode_their_alone_tokens_and_leave_as_mlx_lms_rotating_cache():
    """Sliding-window layers in the ragged layout (issue 43): rows whose windows have wrapped (and one that has
    not) decode with their alone greedy tokens, and a row's extracted window layer holds exactly what mlx-lm's
    ``RotatingKVCache`` holds after the same tokens (its positions in order), so the prefix cache stores it as is."""
    from mlx_lm.generate import generate_step

    from models.mlx_compat import temporal_order
    from tests.fixtures import zoo

    model = zoo.build("gpt_oss", 256)
    prompts = [[(5 * i + 3) % 200 + 20 for i in range(n)] for n in (40, 9, 23)]  # windows of 16: two wrap
    n = 6
    want = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n, prompt_cache=make_prompt_cache(model))]
            for p in prompts]
    batch = RaggedBatch(model)
    seqs = [SimpleNamespace(id=i) for i in range(len(prompts))]
    batch.add([Row(s, own_caches(model, p[:-1]), p) for s, p in zip(seqs, prompts)])
    got = {i: [] for i in range(len(prompts))}
    while min(len(v) for v in got.values()) < n:
        for e in batch.step():
            got[e.seq.id].append(e.token)
    assert [got[i][:n] for i in range(len(prompts))] == want
    covered = batch.remove([seqs[0]])[0]
    reference = own_caches(model, covered.tokens)
    for ours, theirs in zip(covered.caches, reference):
        assert type(ours) is type(theirs) and ours.offset == theirs.offset
        if hasattr(theirs, "max_size"):  # a window: the same positions, in order
            k_ours, k_theirs = temporal_order(ours, ours.keys), temporal_order(theirs, theirs.keys)
            k_theirs = k_theirs[..., -k_ours.shape[2]:, :]
            assert k_ours.shape[2] == min(ours.offset, ours.max_size)
            assert mx.allclose(k_ours, k_theirs, atol=1e-4)
