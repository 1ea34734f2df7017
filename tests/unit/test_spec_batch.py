"""Speculation inside the batch (server.engine.batch.speculating, server.engine.batch.ragged_kv): the ragged KV layout on a tiny
random model (rows of different lengths and draft widths give exactly their own logits), per-row acceptance and
rewind with fake logits, the sampled acceptance rule's distribution on a toy vocabulary."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from server.engine.batch import LogitsRules, Row, RowDraft
from server.engine.batch.ragged_kv import RaggedKV
from server.engine.batch.speculating import SpeculatingBatch
from spec import AdaptiveDraftLength, FixedDraftLength, NgramSource, SpecStats
from tests.fixtures.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def own_caches(model, tokens):
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def test_ragged_rows_of_different_lengths_and_widths_give_each_its_own_logits(model):
    p1, p2, p3 = list(range(5, 25)), list(range(40, 47)), list(range(80, 81))
    kv = RaggedKV.from_rows([own_caches(model, p[:-1]) if len(p) > 1 else own_caches(model, [99]) for p in (p1, p2)])
    # row 0 feeds its last token and three drafts; row 1 its last token, one draft and padding
    logits = model(mx.array([[p1[-1], 7, 8, 9], [p2[-1], 3, 3, 3]]), cache=kv.layers)
    alone0 = model(mx.array([[p1[-1], 7, 8, 9]]), cache=own_caches(model, p1[:-1]))
    alone1 = model(mx.array([[p2[-1], 3]]), cache=own_caches(model, p2[:-1]))
    assert mx.allclose(logits[0], alone0[0], atol=1e-5)
    assert mx.allclose(logits[1, :2], alone1[0], atol=1e-5)
    kv.commit([2, 1])  # row 0 keeps its last token and the first draft; row 1 only its last token
    assert kv.lengths == [len(p1) + 1, len(p2)]
    step = model(mx.array([[11], [12]]), cache=kv.layers)  # what each row wrote past its end is not seen
    assert mx.allclose(step[0], model(mx.array([[11]]), cache=own_caches(model, p1 + [7]))[0], atol=1e-5)
    assert mx.allclose(step[1], model(mx.array([[12]]), cache=own_caches(model, p2))[0], atol=1e-5)
    kv.commit([1, 1])
    # a row joins a running batch, one leaves: the others keep their KV
    kv.extend([own_caches(model, p3 + [81, 82])])
    out = kv.extract(0)
    assert out[0].offset == len(p1) + 2
    nxt = model(mx.array([[13]]), cache=out)
    assert mx.allclose(nxt, model(mx.array([[13]]), cache=own_caches(model, p1 + [7, 11])), atol=1e-5)
    kv.filter([1, 2])
    assert kv.lengths == [len(p2) + 1, 3]
    last = model(mx.array([[14], [15]]), cache=kv.layers)
    assert mx.allclose(last[1], model(mx.array([[15]]), cache=own_caches(model, p3 + [81, 82]))[0], atol=1e-5)


class NextTokenModel:
    """Fake logits: after token t the target's choice is table.get(t, (t + 1) % V); writes nothing that matters."""

    def __init__(self, vocab: int = 50, table=None, probs=None):
        self.vocab, self.table, self.probs = vocab, dict(table or {}), probs

    def __call__(self, inputs, cache):
        B, W = inputs.shape
        for layer in cache:  # the layout still gets its writes (zeros), as from a real model
            z = mx.zeros((B, 1, W, 2))
            layer.update_and_fetch(z, z)
        if self.probs is not None:  # every position: the same distribution
            return mx.broadcast_to(mx.log(mx.array(self.probs))[None, None], (B, W, self.vocab))
        nxt = [[self.table.get(t, (t + 1) % self.vocab) for t in row] for row in inputs.tolist()]
        return mx.where(mx.arange(self.vocab)[None, None] == mx.array(nxt)[..., None], 10.0, 0.0)


def triples(out) -> list:
    """A step's ``Emitted`` records as (seq, token, logprobs)."""
    return [(e.seq, e.token, e.logprobs) for e in out]


def pairs(covered) -> list:
    """``remove``'s ``Covered`` records as (tokens, caches)."""
    return [(c.tokens, c.caches) for c in covered]


class ScriptedSource:
    """Proposes the drafts it is given, one list per step."""

    drafts_in_batch = False

    def __init__(self, script):
        self.script = list(script)
        self.commits = []

    def prefill(self, ids):
        pass

    def draft(self, feed, n):
        return self.script.pop(0)[:n] if self.script else []

    def commit(self, drafted, accepted):
        self.commits.append((list(drafted), accepted))


def empty_row_caches(length: int):
    caches = []
    for _ in range(2):
        c = KVCache()
        z = mx.zeros((1, 1, length, 2))
        c.update_and_fetch(z, z)
        caches.append(c)
    return caches


def seq(prompt, max_tokens=50):
    return SimpleNamespace(prompt=list(prompt), generated=[], params=SimpleNamespace(max_tokens=max_tokens))


def add(batch, s, source, *, policy=None, sampler=None, stats=None):
    batch.add([Row(s, empty_row_caches(len(s.prompt) - 1), list(s.prompt), sampler=sampler,
                   draft=RowDraft(source, policy or FixedDraftLength(4), 4, stats), max_tokens=s.params.max_tokens)])


def test_each_row_keeps_its_own_accepted_prefix_and_is_rewound_by_its_own_rejections():
    batch = SpeculatingBatch(NextTokenModel(table={3: 9}))  # after 3 the target says 9, elsewhere t + 1
    a, b, c = seq([1, 2]), seq([10, 11]), seq([20, 21])
    # a: pending 2 -> target 3, then 9 (not 4): drafts [3, 4, 5] accept 1
    # b: pending 11 -> 12, 13, 14: drafts [12, 13] accept both, bonus 14
    # c: no drafts: one plain token
    add(batch, a, ScriptedSource([[3, 4, 5]]))
    add(batch, b, ScriptedSource([[12, 13]]))
    add(batch, c, ScriptedSource([]))
    out = batch.step()
    got = collections.defaultdict(list)
    for s, token, lp in triples(out):
        got[id(s)].append(token)
        assert lp.shape == (50,)
    assert got[id(a)] == [3, 9] and got[id(b)] == [12, 13, 14] and got[id(c)] == [22]
    assert batch._kv.lengths == [1 + 2, 1 + 3, 1 + 1]  # prompt[:-1] plus pending + accepted drafts
    assert batch.drafted == 5 and batch.accepted == 3
    # the sequences take the tokens; c stops after its first: its caches cover exactly its prompt + that token
    for s, token, _ in triples(out):
        s.generated.append(token)
    c.generated = c.generated[:1]
    (tokens, caches), = pairs(batch.remove([c]))
    assert tokens == [20, 21] and caches[0].offset == 2
    # the next step starts from each row's new pending token
    out = batch.step()
    assert [t for s, t, _ in triples(out) if s is a] == [10]  # after 9, t + 1
    assert [t for s, t, _ in triples(out) if s is b] == [15]


def test_a_row_stopped_inside_a_step_stores_only_what_it_kept():
    batch = SpeculatingBatch(NextTokenModel())
    a = seq([1, 2])
    add(batch, a, ScriptedSource([[3, 4, 5, 6]]))
    out = batch.step()
    assert [t for _, t, _ in triples(out)] == [3, 4, 5, 6, 7]
    a.generated = [3, 4]  # a stop string ended it at its second token
    (tokens, caches), = pairs(batch.remove([a], [len(a.generated)]))
    assert tokens == [1, 2, 3, 4] and caches[0].offset == 4  # prompt + what it kept (both were fed)


def test_drafts_never_run_past_max_tokens():
    batch = SpeculatingBatch(NextTokenModel())
    a = seq([1, 2], max_tokens=3)
    add(batch, a, ScriptedSource([[3, 4, 5, 6]]))
    out = batch.step()
    assert [t for _, t, _ in triples(out)] == [3, 4, 5]  # two drafts and the bonus: max_tokens exactly


def test_the_adaptive_length_pauses_a_row_whose_drafts_fail():
    batch = SpeculatingBatch(NextTokenModel())
    stats = SpecStats()
    a = seq([1, 2], max_tokens=200)
    policy = AdaptiveDraftLength(4, pause=16)
    add(batch, a, ScriptedSource([[0, 0, 0, 0]] * 40), policy=policy, stats=stats)  # always wrong
    drafted = []
    for _ in range(12):
        before = batch.drafted
        for s, t, _ in triples(batch.step()):
            s.generated.append(t)
        drafted.append(batch.drafted - before)
    assert drafted[0] == 4 and drafted[-1] == 0  # it shrank, then paused
    assert stats.accepted == 0 and stats.emitted == 12


def test_sampled_rows_follow_the_target_distribution():
    """Draw-and-compare with a deterministic draft: the first emitted token is distributed as the target's p,
    whatever the draft (here always token 0, p(0) = 0.5)."""
    probs = [0.5, 0.3, 0.15, 0.05]
    sampler = lambda lp: mx.random.categorical(lp)  # noqa: E731
    mx.random.seed(7)
    counts = collections.Counter()
    trials = 1500
    for _ in range(trials):
        batch = SpeculatingBatch(NextTokenModel(vocab=4, probs=probs))
        a = seq([1, 2])
        add(batch, a, ScriptedSource([[0, 0]]), sampler=sampler)
        first = batch.step()[0].token
        counts[first] += 1
    for token, p in enumerate(probs):
        assert abs(counts[token] / trials - p) < 0.04, (token, counts)


def test_ngram_source_rows_in_a_batch_draft_from_their_own_history():
    batch = SpeculatingBatch(NextTokenModel(vocab=50))
    # the target continues t + 1; a prompt that already contains "5 6 7 8" lets lookup propose it after "4"
    a = seq([5, 6, 7, 8, 9, 1, 2, 3, 4])
    b = seq([30, 31, 32, 33])
    add(batch, a, NgramSource())
    add(batch, b, NgramSource())
    out = batch.step()
    assert [t for s, t, _ in triples(out) if s is a][0] == 5
    for s, t, _ in triples(out):
        s.generated.append(t)
    out = batch.step()  # after "4 5" lookup proposes "6 7 8 ..." and the target agrees
    assert len([t for s, t, _ in triples(out) if s is a]) > 1


def test_the_batch_measures_what_a_drafted_token_costs_and_raises_the_break_even():
    from spec import BatchVerifyCost

    cost = BatchVerifyCost(probe_every=4)
    assert cost.break_even() == cost.floor  # nothing measured yet
    steps = [(4, 0, 0.24), (4, 4, 0.34), (4, 12, 0.54), (3, 6, 0.33), (4, 8, 0.44)]  # a = 0.06/row, m = 0.025/token
    for rows, drafted, seconds in steps:
        cost.observe(rows, drafted, seconds)
    assert cost.break_even() == pytest.approx(0.025 / 0.06, rel=1e-6)
    for _ in range(4):
        cost.observe(4, 8, 0.44)
    assert cost.probe()  # four drafted steps in a row: the next one measures a plain step
    cost.observe(4, 0, 0.24)
    assert not cost.probe()


def test_a_batch_is_judged_not_paying_only_over_a_full_window_of_too_few_tokens_per_row():
    from server.engine.batch import speculating as spec_batch
    from server.engine.batch.speculating import SpeculatingBatch

    batch = SpeculatingBatch(model=None)
    n = spec_batch.JUDGE_STEPS
    for _ in range(n - 1):
        batch._recent.append((4, 4, 0.1))  # 1 token per row per step: drafts made nothing
    assert not batch.not_paying()  # not judged before a full window
    batch._recent.append((4, 4, 0.1))
    assert batch.not_paying()
    for _ in range(n):
        batch._recent.append((4, int(4 * spec_batch.PAYS_YIELD) + 1, 0.1))  # drafts accepted: it pays
    assert not batch.not_paying()


def test_whether_drafts_pay_is_judged_against_the_plain_batchs_measured_step():
    """With a plain step of as many rows measured, the batch pays when it makes more tokens per second than the
    plain batch would: 2 tokens per row per step pay for a step of 1.5 plain ones, not for one of 2.5 (the H200 at
    32 rows with half the drafts accepted); without a measurement of that size the fixed yield decides."""
    from server.engine.batch import speculating as spec_batch
    from server.engine.batch.speculating import PlainStepClock, SpeculatingBatch

    clock = PlainStepClock()
    clock.observe(8, 0.010)
    clock.observe(8, 0.010)
    assert clock.seconds(8) == pytest.approx(0.010) and clock.seconds(9) == pytest.approx(0.010)
    assert clock.seconds(16) is None  # a batch twice the size: not known
    n = spec_batch.JUDGE_STEPS
    cheap, dear = SpeculatingBatch(model=None), SpeculatingBatch(model=None)
    for _ in range(n):
        cheap._recent.append((8, 16, 0.015))  # 16 tokens in 15 ms vs the plain batch's 8 in 10 ms: pays
        dear._recent.append((8, 16, 0.025))  # 16 tokens in 25 ms: 640 tok/s vs 800: does not
    assert not cheap.not_paying(clock)
    assert dear.not_paying(clock)
    assert not dear.not_paying(PlainStepClock())  # nothing measured: 2 tokens per row per step >= PAYS_YIELD
    clock.observe(8, 0.030)  # plain steps got slower (longer contexts): the average follows
    assert clock.seconds(8) == pytest.approx(0.014)
    assert not dear.not_paying(clock)


def test_penalised_rows_verify_each_drafted_position_with_its_own_history(model):
    """A greedy row with penalties and a bias, speculating in a batch beside a plain row, emits what the plain
    ragged batch emits for it: each verified position is ruled over the history up to it (drafts included)."""
    from server.engine.batch.rules import Penalties
    from server.engine.batch.ragged import RaggedBatch
    from server.lane.events import SamplingParams

    rules = Penalties.of(SamplingParams(max_tokens=40, repetition_penalty=1.6, frequency_penalty=0.7,
                                        logit_bias={12: 2.5}))
    prompts = [list(range(20, 40)), list(range(60, 66))]
    plain = RaggedBatch(model)
    names = [SimpleNamespace(name=i) for i in range(2)]
    for s, p, pen in zip(names, prompts, (rules, None)):
        plain.add([Row(s, own_caches(model, p[:-1]), p, LogitsRules(pen))])
    want = {0: [], 1: []}
    for _ in range(12):
        for s, token, _ in triples(plain.step()):
            want[s.name].append(token)
    assert want[0] != want[1]
    seqs = [seq(p, max_tokens=12) for p in prompts]

    class Oracle(ScriptedSource):  # row 0 drafts the plain run's next tokens, every other draft corrupted at its end
        def draft(self, feed, n):
            self.calls = getattr(self, "calls", 0) + 1
            d = want[0][len(seqs[0].generated): len(seqs[0].generated) + n]
            return d if self.calls % 2 else d[:-1] + [250]

    batch = SpeculatingBatch(model)
    batch.cost.probe = lambda: False  # draft every step: this test is about the rules, not about when drafts pay
    batch._worth_drafting = lambda wanted, pays: True
    for s, p, pen, src in zip(seqs, prompts, (rules, None), (Oracle([]), ScriptedSource([]))):
        batch.add([Row(s, own_caches(model, p[:-1]), list(p), LogitsRules(pen),
                       draft=RowDraft(src, FixedDraftLength(3), 3, None))])
    while any(len(s.generated) < 12 for s in seqs):
        for s, token, _ in triples(batch.step()):
            s.generated.append(token)
        for s in [s for s in seqs if len(s.generated) >= 12 and s in batch]:
            batch.remove([s])
    assert seqs[0].generated[:12] == want[0] and seqs[1].generated[:12] == want[1]
    assert 0 < batch.accepted < batch.drafted


def test_the_draft_batch_drafts_what_each_rows_own_source_drafts(model):
    """server.engine.batch.drafts: three rows' drafts from batched forwards of the draft model equal each row's own
    TwoModelSource's, over rounds of different lengths, partial and full accepts (a full accept feeds 2 tokens next
    round); a row that leaves gets caches that go on exactly as its own source's."""
    from server.engine.batch.drafts import DraftBatch
    from spec.two_model import TwoModelSource

    draft = tiny_llama(seed=11)
    prompts = [list(range(20, 40)), list(range(60, 66)), list(range(90, 130))]
    alone = [TwoModelSource(draft) for _ in prompts]
    together = [TwoModelSource(draft) for _ in prompts]
    for a, t, p in zip(alone, together, prompts):
        a.prefill(p[:-1])
        t.prefill(p[:-1])
    db = DraftBatch(draft)
    db.join(together)
    feeds = [[p[-1]] for p in prompts]
    rounds = [([3, 1, 2], [0, 1, 2]), ([2, 3, 0], [2, 3, 0]), ([1, 2, 3], [1, 0, 3]), ([2, 2, 2], [1, 2, 0])]
    for r, (ns, accepts) in enumerate(rounds):
        want = [a.draft(f, n) for a, f, n in zip(alone, feeds, ns)]
        got = db.draft([(t, f, n) for t, f, n in zip(together, feeds, ns)])
        assert got == want and all(len(d) == n for d, n in zip(got, ns))
        for a, d, acc in zip(alone, want, accepts):
            a.commit(d, acc)
        db.commit([(t, d, acc) for t, d, acc in zip(together, got, accepts) if d])
        assert [t.tokens for t in together] == [a.tokens for a in alone]
        feeds = [[(31 * r + 7 * i) % 150 + 3] for i in range(3)]  # each row's next token, from the target
    assert db.forwards == sum(max(ns) for ns, _ in rounds)  # one forward per drafted position, not per row
    db.leave([together[1]])
    t, a = together[1], alone[1]
    assert t.caches[0].offset == len(t.tokens) == len(a.tokens)
    assert t.draft(feeds[1], 3) == a.draft(feeds[1], 3)  # it goes on alone, as its own source would
    rest = db.draft([(together[0], feeds[0], 2), (together[2], feeds[2], 1)])
    assert rest == [alone[0].draft(feeds[0], 2), alone[2].draft(feeds[2], 1)]


@pytest.mark.parametrize("with_verdict", [True, False], ids=["drafts_read_with_verdict", "drafts_read_first"])
@pytest.mark.parametrize("batched", [True, False])  # drafts: batched forwards of the draft model, or row by row
@pytest.mark.parametrize("draft_seed", [5, 11])  # the target itself (every draft holds), another model (few hold)
def test_two_model_rows_draft_with_their_own_draft_caches_and_emit_the_plain_batchs_text(model, draft_seed, batched,
                                                                                         with_verdict, monkeypatch):
    """Batched or not, every row's text is the plain batch's; batched drafts enter the verify forward unread and are
    read with its verdict (spec.verify.READ_DRAFTS_WITH_VERDICT), or are read first: the same text either way."""
    import spec.verify
    from server.engine.batch.drafts import DraftBatch
    from server.engine.batch.ragged import RaggedBatch
    from spec.two_model import TwoModelSource

    monkeypatch.setattr(spec.verify, "READ_DRAFTS_WITH_VERDICT", with_verdict)
    calls = {"draft": 0, "draft_lazy": 0}
    lazy = DraftBatch.draft_lazy

    def counted(verb):
        def call(self, wanted):
            calls[verb] += 1
            return lazy(self, wanted) if verb == "draft_lazy" else lazy(self, wanted).read()
        return call

    monkeypatch.setattr(DraftBatch, "draft_lazy", counted("draft_lazy"))
    monkeypatch.setattr(DraftBatch, "draft", counted("draft"))

    draft = model if draft_seed == 5 else tiny_llama(seed=draft_seed)
    prompts = [list(range(20, 40)), list(range(60, 66)), list(range(90, 130))]
    plain = RaggedBatch(model)
    names = [SimpleNamespace(name=i) for i in range(3)]
    for s, p in zip(names, prompts):
        plain.add([Row(s, own_caches(model, p[:-1]), p)])
    want = {i: [] for i in range(3)}
    for _ in range(10):
        for s, token, _ in triples(plain.step()):
            want[s.name].append(token)
    batch = SpeculatingBatch(model, draft_batch=batched)
    batch.cost.probe = lambda: False  # draft every step: this test is about the mechanism, not about when drafts pay
    batch._worth_drafting = lambda wanted, pays: True
    seqs = [seq(p, max_tokens=10) for p in prompts]
    sources = []
    for s, p in zip(seqs, prompts):
        src = TwoModelSource(draft, None, ())
        sources.append(src)
        batch.add([Row(s, own_caches(model, p[:-1]), list(p), draft=RowDraft(src, FixedDraftLength(3), 3, None))])
    assert (len(batch._drafters) == 1 and len(batch._drafters[0]) == 3) == batched
    while any(len(s.generated) < 10 for s in seqs):
        for s, token, _ in triples(batch.step()):
            s.generated.append(token)
        for s in [s for s in seqs if len(s.generated) >= 10 and s in batch]:
            (tokens, caches), = pairs(batch.remove([s]))
            src = sources[seqs.index(s)]
            assert src.tokens == tokens and caches[0].offset == len(tokens)  # both models cover what was kept
            assert src.caches[0].offset == len(src.tokens)  # the draft caches are the source's again
    assert [s.generated[:10] for s in seqs] == [want[i] for i in range(3)]
    assert batch.drafted > 0
    used = (calls["draft_lazy"] > 0, calls["draft"] > 0)
    assert used == (((True, False) if with_verdict else (False, True)) if batched else (False, False)), calls
    if draft is model:
        assert batch.accepted == batch.drafted  # a draft that is the target: every token holds


def test_a_drafted_token_dearer_than_a_plain_rows_step_never_pays_even_when_always_accepted():
    from spec import BatchVerifyCost

    cost = BatchVerifyCost(probe_every=4)
    for rows, drafted, seconds in [(4, 0, 0.24), (4, 4, 0.54), (4, 8, 0.84), (4, 0, 0.24), (4, 12, 1.14)]:
        cost.observe(rows, drafted, seconds)  # a = 0.06 per row, m = 0.075 per drafted position: m / a = 1.25
    assert cost.break_even() > 1.0  # no acceptance rate reaches it: every row stops drafting
    batch = SpeculatingBatch(model=None)
    batch._rows = [SimpleNamespace(policy=SimpleNamespace(recent_rate=1.0))] * 4
    skipped = [batch._worth_drafting([3, 3, 3, 3], cost.break_even()) for _ in range(16)]
    assert skipped.count(True) == 2  # only the exploring steps (one in EXPLORE) still draft, to keep measuring
