"""MTP drafting on the real engine and lane (issue 44), for each zoo model that carries heads (tests.fixtures.zoo_mtp):
the text is mlx-lm's own greedy text alone, in a batch of four, after a RAM hit and after an SSD restore, with drafts
actually verified; the heads' caches are stored with the target's, so a hit drafts at once (not "blind").

The heads are random (untrained): their drafts are mostly rejected, which the text must not see; what they draft
is checked in tests/unit/test_spec_mtp.py."""

from __future__ import annotations

import pytest

from tests.fixtures import zoo_mtp
from tests.unit.test_zoo_models import HISTORY, PROMPTS, TURN1, TURN2, VOCAB, alone, finished, lane_of, run, submit

NAMES = sorted(zoo_mtp.MTP_ZOO)


@pytest.fixture(scope="module", params=NAMES)
def mtp(request):
    from models import kernels
    from models.mtp import facts_of, tap, untap
    from server.engine.speculation import Speculation
    from spec.mtp import MtpProvider

    model, head = zoo_mtp.build(request.param, VOCAB)
    kernels.install(model)
    provider = MtpProvider(head, tap(model), identity="mtp:zoo", target_params=10 * head.params,
                           facts=facts_of(head, request.param))
    yield request.param, model, head, Speculation(provider, num_draft_tokens=3, kind="mtp")
    untap(model)
    kernels.hook.restore(model, kernels.GATED_DELTA)


def entry_caches(cache, prompt):
    ((ns, key),) = [k for k in cache.keys() if k[1][: len(prompt)] == tuple(prompt)]
    with cache._lock:
        return ns, key, cache._by_ns[ns][key].caches


def test_alone_and_after_ram_and_ssd_hits_the_text_is_plain_greedy_and_hits_draft_at_once(mtp, tmp_path):
    from cache.kvfile import load, save
    from cache.prompt_cache import PromptCache

    name, model, head, speculation = mtp
    cache = PromptCache(1 << 28)
    lane = lane_of(model, cache, speculation=speculation)
    facts = lane.engine.base.facts
    assert speculation.supports(facts) and facts.draft_heads is not None, name
    got, done = run(lane, TURN1, n=12, checkpoints=(len(HISTORY),))
    assert got == alone(model, TURN1, 12), name
    assert done.spec["drafted"] > 0 and done.spec["blind"] == 0, (name, done.spec)
    ns, key, caches = entry_caches(cache, TURN1)
    assert len(caches) == facts.layers + head.layers + 1, name  # the heads' KV and the hidden states, stored

    longer = TURN1 + got + [40, 41, 42]  # a RAM hit on the whole first run
    grown, done = run(lane, longer, n=12)
    assert grown == alone(model, longer, 12), name
    assert done.cached_tokens >= len(TURN1) + len(got) - 1, (name, done.cached_tokens)
    assert done.spec["drafted"] > 0 and done.spec["blind"] == 0, (name, done.spec)

    save(tmp_path / "e.safetensors", key, caches, fingerprint="z", ns=ns)  # a restart: the SSD file format
    back = load(tmp_path / "e.safetensors")
    restarted = PromptCache(1 << 28)
    restarted.put(list(back.tokens), back.caches, ns)
    parted, done = run(lane_of(model, restarted, speculation=speculation), TURN2, n=12)
    assert parted == alone(model, TURN2, 12), name
    assert done.cached_tokens == len(HISTORY), (name, done.cached_tokens)
    assert done.spec["drafted"] > 0 and done.spec["blind"] == 0, (name, done.spec)


@pytest.mark.parametrize("with_verdict", [True, False], ids=["drafts_read_with_verdict", "drafts_read_first"])
def test_four_requests_together_make_their_alone_text_and_store_whole_runs(mtp, monkeypatch, with_verdict):
    """Plain-KV models verify the four rows' drafts in one forward (the speculating batch); a hybrid's requests that
    arrive beside others decode plainly in the plain batch (server.engine.batch.choose.place) and store the target's
    layers only, and a later request on such an entry drafts from its new tokens (blind) with the same text. The
    heads' batched drafts enter the verify forward unread and are read with its verdict (one wait a step), or, with
    spec.verify.READ_DRAFTS_WITH_VERDICT off, are read first: the same text either way."""
    import spec.verify
    from cache.prompt_cache import PromptCache
    from server.engine.speculation import SpecTotals

    from server.engine.batch.mtp_drafts import MtpDraftBatch

    monkeypatch.setattr(spec.verify, "READ_DRAFTS_WITH_VERDICT", with_verdict)
    name, model, head, speculation = mtp
    batched_drafts = []  # the rows' heads drafted together (server.engine.batch.mtp_drafts)
    calls = {"draft": 0, "draft_lazy": 0}  # which order the speculating batch took
    lazy = MtpDraftBatch.draft_lazy

    def counted(verb):
        def call(self, wanted):
            calls[verb] += 1
            batched_drafts.append(len(wanted))
            return lazy(self, wanted) if verb == "draft_lazy" else lazy(self, wanted).read()
        return call

    monkeypatch.setattr(MtpDraftBatch, "draft_lazy", counted("draft_lazy"))
    monkeypatch.setattr(MtpDraftBatch, "draft", counted("draft"))
    want = [alone(model, p, 10) for p in PROMPTS]
    cache = PromptCache(1 << 28)
    lane = lane_of(model, cache, speculation=speculation)
    lane.stats.spec = SpecTotals("mtp", 3)  # what serve sets: the speculating batch's steps are counted there
    first, _ = run(lane, PROMPTS[1], n=10)  # alone: drafting, its entry holds the heads' state too
    assert first == want[1], name
    seqs, sizes = {}, set()  # then PROMPTS[1] again among others: a hybrid's row takes the target's layers of it
    for tick in range(400):
        if tick in (0, 1, 2, 3) and tick not in seqs:
            seqs[tick] = submit(lane, PROMPTS[tick], 10)
        if lane.idle() and len(seqs) == len(PROMPTS):
            break
        lane.tick()
        sizes.add(sum(1 for s, _ in seqs.values() if s.phase.name == "BATCHED"))
    drafted = 0
    for i, (seq, events) in seqs.items():
        done = finished(events)
        assert list(seq.generated) == want[i], (name, i)
        assert seq.stored >= len(PROMPTS[i]) + 10 - 1, (name, i, seq.stored)
        drafted += (done.spec or {}).get("drafted", 0)
    plain_kv = lane.engine.base.facts.caches.plain_kv
    if plain_kv:
        assert max(sizes) >= 2 and drafted > 0, (name, sizes, drafted)
        assert batched_drafts and max(batched_drafts) >= 2, (name, batched_drafts)
        assert lane.stats.spec.as_dict()["in_batch"]["steps"] > 0, name
        assert (calls["draft_lazy"] > 0, calls["draft"] > 0) == ((True, False) if with_verdict else (False, True)), \
            (name, calls)
    else:  # the first arrived alone, to speculate on its own, and joined the others' plain batch (choose.place)
        assert lane.stats.spec.as_dict()["solo_joined_batch"] >= 1, name
    nxt = PROMPTS[2] + want[2] + [50, 51]  # the next turn of one that arrived beside others, alone
    again, done = run(lane, nxt, n=10)
    assert again == alone(model, nxt, 10), name
    assert done.cached_tokens > len(PROMPTS[2]), (name, done.cached_tokens)
    assert done.spec["drafted"] > 0, name
    # its entry holds the heads' state when it was computed drafting (plain KV: the speculating batch); a hybrid row
    # that decoded plainly stored the target's layers only: a hit on it starts blind, and still drafts
    assert done.spec["blind"] == (0 if plain_kv else 1), (name, done.spec)


def test_a_seeded_sampled_request_is_verified_by_the_shared_rule_and_repeats_after_a_hit(mtp):
    """Sampled rows walk the drafts with the rule every draft kind uses (spec.accept); the heads' caches are a
    function of the sequence, so after a RAM hit the same seed drafts and draws the same tokens."""
    from cache.prompt_cache import PromptCache
    from server.lane.events import SamplingParams
    from server.lane.sequence import Sequence

    name, model, head, speculation = mtp
    lane = lane_of(model, PromptCache(1 << 28), speculation=speculation)
    runs = []
    for _ in range(2):
        events: list = []
        target = lane.engine.base_target()
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
        seq = Sequence(prompt=list(TURN1), params=params, sink=events.append, id=str(id(events)), target=target,
                       ns=lane.engine.namespace_for(target, params))
        lane.submit(seq)
        while not lane.idle():
            lane.tick()
        runs.append((list(seq.generated), finished(events)))
    (first, done1), (second, done2) = runs
    assert len(first) == 12 and first == second, name
    assert done1.spec["drafted"] > 0 and done2.cached_tokens > 0 and done2.spec["blind"] == 0, (name, done2)


def test_requests_under_a_lora_adapter_do_not_draft_with_the_base_models_heads(mtp):
    """The heads read the base model's forward (its tapped final norm): an adapter's model runs its own."""
    from types import SimpleNamespace

    from server.lane.events import SamplingParams
    from server.lane.target import Target

    name, model, head, speculation = mtp
    engine = lane_of(model, speculation=speculation).engine
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert engine.draft_tokens(engine.base_target(), params) == 3, name
    adapted = Target(engine.base, adapter=SimpleNamespace(name="lora", identity="a" * 64, model=model))
    assert engine.draft_tokens(adapted, params) == 0, name
    assert engine.namespace_for(adapted, params) != engine.namespace_for(engine.base_target(), params), name


def test_the_memory_budget_prices_what_the_heads_hold_beside_the_target(mtp):
    """A speculating sequence holds the heads' KV and the hidden states they read beside the target's caches: the
    memory budget's price counts them (traced, not run), exactly as many bytes as a stored entry's MTP layers hold."""
    from cache.prompt_cache import PromptCache
    from server.engine.kv_layout import state_nbytes
    from server.engine.slot import traced_price

    name, model, head, speculation = mtp
    cache = PromptCache(1 << 28)
    lane = lane_of(model, cache, speculation=speculation)
    alone_price = lane.engine.base.measure_kv()
    price = lane.engine.kv_price_estimate()
    heads = traced_price(speculation.provider.trace_caches)
    assert heads.per_token > 0, name
    assert price.per_token == pytest.approx(alone_price.per_token + heads.per_token), name
    assert lane.engine.base.kv_price == price, name  # what admission reads

    run(lane, TURN1, n=4)
    _, key, caches = entry_caches(cache, TURN1)
    mtp_layers = caches[-(head.layers + 1):]  # stored after the target's: the heads' KV, then the hidden states
    assert heads.of(len(key)) == pytest.approx(state_nbytes(mtp_layers), rel=1e-6), name
