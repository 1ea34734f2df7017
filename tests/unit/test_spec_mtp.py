"""The MTP draft source (spec.mtp) and the heads' loading (models.mtp), on the zoo's tiny models that carry heads.

- whatever was drafted and accepted round after round, the heads' caches are what one cold forward of the whole
  sequence gives (so a cache hit drafts what a cold request drafts);
- a source that missed positions is behind (drafts nothing) until caught up on a copy of the target's caches;
- a hit on an entry without the heads' state starts blind, from the hit on;
- the heads load from the checkpoint as the family ships them; a checkpoint without them, or of a family without
  heads, is refused with what to do.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures import zoo_mtp

VOCAB = 256
PROMPT = [(7 * i + 3) % 200 + 20 for i in range(30)]


@pytest.fixture(scope="module")
def default_model_dir():
    from models import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module", params=sorted(zoo_mtp.MTP_ZOO))
def bound(request):
    from models.mtp import tap, untap
    from spec.mtp import MtpProvider

    model, head = zoo_mtp.build(request.param, VOCAB)
    yield request.param, model, MtpProvider(head, tap(model), identity="mtp:t", target_params=1)
    untap(model)


def cold(model, provider, seq):
    """A fresh source that heard the whole sequence in one target forward."""
    source = provider.open()
    model(mx.array(seq)[None], cache=make_prompt_cache(model))
    source.heard(0, seq)
    source.prefill(seq)
    return source


def prompt_heard(model, provider):
    """The target's caches over PROMPT[:-1] and a fresh source that heard them (what a request has after prefill)."""
    caches = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=caches)
    source = provider.open()
    source.heard(0, PROMPT[:-1])
    source.prefill(PROMPT[:-1])
    return caches, source


def assert_same_caches(a, b, name):
    assert [int(c.offset) for c in a.caches] == [int(c.offset) for c in b.caches], name
    for x, y in zip(a.caches, b.caches):
        n = int(x.offset)
        for u, v in ((x.keys, y.keys), (x.values, y.values)):
            assert mx.allclose(u[..., :n, :], v[..., :n, :], atol=1e-4).item(), name


def test_the_heads_caches_are_a_function_of_the_sequence_whatever_was_drafted(bound):
    name, model, provider = bound
    caches, source = prompt_heard(model, provider)
    seq, pending, pos, feed = list(PROMPT[:-1]), PROMPT[-1], len(PROMPT) - 1, [PROMPT[-1]]
    for r, accepted in enumerate([0, 3, 1, 2, 0, 3]):  # as if the target had agreed with that many drafts
        drafts = source.draft(feed, 3)
        assert len(drafts) == 3 and all(0 <= t < VOCAB for t in drafts), (name, drafts)
        source.commit(drafts, accepted)
        fed = [pending] + drafts[:accepted]
        model(mx.array([fed]), cache=caches)
        source.heard(pos, fed)
        seq += fed
        pos += len(fed)
        pending = 30 + r  # the target's correction
        feed = [pending]
    source.prefill(seq)
    assert source.tokens == seq and not source.blind, name
    assert_same_caches(source, cold(model, provider, seq), name)
    with pytest.raises(RuntimeError):
        source.commit([1, 2, 3], 1)  # nothing drafted since the last commit


def test_a_source_that_missed_positions_drafts_nothing_until_it_is_caught_up(bound):
    name, model, provider = bound
    caches = make_prompt_cache(model)
    model(mx.array(PROMPT)[None], cache=caches)
    source = provider.open()
    source.heard(0, PROMPT[:10])  # then a plain batch decoded on: nothing heard of positions 10..
    source.heard(20, PROMPT[20:])  # a gap is not bridged
    assert source.draft(PROMPT[10:], 3) == [] and source.behind, name
    plain_kv = all(type(c).__name__ == "KVCache" for c in caches)
    # recomputed on a copy of the target's caches cut back; recurrent state cannot be cut back: it stays behind
    assert source.catch_up(model, caches, PROMPT) == plain_kv and source.behind != plain_kv, name
    if plain_kv:
        assert_same_caches(source, cold(model, provider, PROMPT), name)


def test_a_hit_on_an_entry_without_the_heads_state_starts_blind_from_the_hit(bound):
    name, model, provider = bound
    caches = make_prompt_cache(model)
    model(mx.array(PROMPT[:20])[None], cache=caches)  # the hit: the target's layers only
    source = provider.open(None, PROMPT[:20])
    assert source.blind and source.origin == 20 and source.tokens == [], name
    model(mx.array(PROMPT[20:-1])[None], cache=caches)
    source.heard(20, PROMPT[20:-1])
    drafts = source.draft([PROMPT[-1]], 2)
    assert len(drafts) == 2, name
    assert [int(c.offset) for c in source.caches] == [len(PROMPT) - 20 + 1, len(PROMPT) - 1 - 20], name


@pytest.mark.parametrize("name", sorted(zoo_mtp.MTP_ZOO))
def test_heads_load_from_the_checkpoint_as_the_family_ships_them(name, tmp_path, default_model_dir):
    from models import ModelLoadError, load_model
    from spec.mtp import MtpProvider

    written = zoo_mtp.write(name, tmp_path / name, default_model_dir)
    loaded = load_model(str(written), "float32", progress=False)
    provider = MtpProvider.from_loaded(loaded)
    _, built = zoo_mtp.build(name, json.loads((written / "config.json").read_text())["vocab_size"])
    assert provider.facts is not None and provider.facts.family == built.family, name
    from spec.mtp import entry_mask

    tokens, hidden = mx.array([[5, 6, 7]]), mx.ones((1, 3, built.hidden_size))
    got = provider.head.forward(tokens, hidden, provider.head.make_caches(), entry_mask(0, 3))
    want = built.forward(tokens, hidden, built.make_caches(), entry_mask(0, 3))
    assert mx.allclose(got, want, atol=1e-4).item(), name  # the weights written are the weights loaded

    plain = load_model(str(zoo_mtp.write(name, tmp_path / f"{name}-converted", default_model_dir, heads=False)),
                       "float32", progress=False)
    with pytest.raises(ModelLoadError, match="ships no multi-token-prediction weights"):
        MtpProvider.from_loaded(plain)


def test_a_family_without_heads_is_refused_with_what_to_do(default_model_dir):
    from models import ModelLoadError, load_model
    from spec.mtp import MtpProvider

    with pytest.raises(ModelLoadError, match="--draft-kind ngram"):
        MtpProvider.from_loaded(load_model("default", "float32", progress=False))


def test_draft_kind_auto_drafts_with_heads_where_the_checkpoint_ships_them_and_is_off_elsewhere(tmp_path,
                                                                                                default_model_dir,
                                                                                                monkeypatch):
    from models import load_model
    from server.cli import build_parser
    from server.config import ServerConfig
    from server.serve import _speculation

    for name in list(__import__("os").environ):
        if name.startswith("MLX_LANE_"):
            monkeypatch.delenv(name)
    cfg = ServerConfig.from_args(build_parser().parse_args(["serve", "--draft-kind", "auto"]))
    written = zoo_mtp.write("qwen3_5", tmp_path / "qwen3_5", default_model_dir)
    with_heads = _speculation(cfg, load_model(str(written), "float32", progress=False))
    assert with_heads is not None and with_heads.kind == "mtp" and with_heads.draft_heads.family == "qwen"
    plain = zoo_mtp.write("qwen3_5", tmp_path / "converted", default_model_dir, heads=False)
    assert _speculation(cfg, load_model(str(plain), "float32", progress=False)) is None  # no heads: plain decoding
    assert _speculation(cfg, load_model("default", "float32", progress=False)) is None  # a family without any
    explicit = ServerConfig.from_args(build_parser().parse_args(["serve", "--draft-kind", "mtp"]))
    with pytest.raises(Exception, match="ships no multi-token-prediction weights"):
        _speculation(explicit, load_model(str(plain), "float32", progress=False))  # asked for: an error at start


def test_the_heads_draft_for_many_rows_in_batched_forwards_what_each_row_drafts_alone(bound):
    """server.engine.batch.mtp_drafts: rows of different lengths, draft lengths and accepts draft together what each
    source drafts on its own caches, one forward per drafted position; a row that leaves goes on alone the same."""
    from server.engine.batch.mtp_drafts import MtpDraftBatch

    name, model, provider = bound
    prompts = [PROMPT, PROMPT[3:12], PROMPT[5:25]]
    rows = []  # per row: (alone source, its target caches, together source, its target caches)
    for p in prompts:
        pair = []
        for _ in range(2):
            caches = make_prompt_cache(model)
            model(mx.array(p[:-1])[None], cache=caches)
            source = provider.open()
            source.heard(0, p[:-1])
            source.prefill(p[:-1])
            pair += [source, caches]
        rows.append(pair)
    db = MtpDraftBatch(provider.head)
    db.join([r[2] for r in rows])
    assert len(db) == 3, name
    pending = [p[-1] for p in prompts]
    pos = [len(p) - 1 for p in prompts]
    feeds = [[t] for t in pending]
    rounds = [([3, 2, 1], [0, 2, 1]), ([2, 3, 3], [2, 3, 0]), ([1, 0, 3], [1, 0, 2])]
    for r, (ns, accepts) in enumerate(rounds):
        want = [row[0].draft(f, n) for row, f, n in zip(rows, feeds, ns)]
        got = db.draft([(row[2], f, n) for row, f, n in zip(rows, feeds, ns)])
        assert got == want and [len(d) for d in got] == ns, (name, r)
        kept = [min(a, len(d)) for a, d in zip(accepts, want)]
        for row, d, a in zip(rows, want, kept):
            if d:
                row[0].commit(d, a)
        db.commit([(row[2], d, a) for row, d, a in zip(rows, got, kept) if d])
        for i, (row, d, a) in enumerate(zip(rows, want, kept)):  # the verify forward's kept positions, heard
            fed = [pending[i]] + d[:a]
            for source, caches in ((row[0], row[1]), (row[2], row[3])):
                model(mx.array([fed]), cache=caches)
                source.heard(pos[i], fed)
            pos[i] += len(fed)
            pending[i] = 40 + 3 * r + i
            feeds[i] = [pending[i]]
    assert db.forwards == sum(max(ns) for ns, _ in rounds), name  # per drafted position, not per row
    alone, together = rows[1][0], rows[1][2]
    db.leave([together])
    assert [int(c.offset) for c in together.caches] == [int(c.offset) for c in alone.caches], name
    assert together.draft(feeds[1], 3) == alone.draft(feeds[1], 3), name  # it goes on alone as its own would
    rest = db.draft([(rows[0][2], feeds[0], 2), (rows[2][2], feeds[2], 1)])
    assert rest == [rows[0][0].draft(feeds[0], 2), rows[2][0].draft(feeds[2], 1)], name


def test_batched_drafts_asked_for_unread_say_their_lengths_first_and_read_as_drafted(bound):
    """MtpDraftBatch.draft_lazy: the lengths are known before anything is read, the sources learn their drafts only
    at the read, and what is read is what ``draft`` gives; commits then keep both drafters the same."""
    from server.engine.batch.mtp_drafts import MtpDraftBatch

    name, model, provider = bound
    prompts = [PROMPT, PROMPT[3:12], PROMPT[5:25]]
    drafters = []
    for _ in range(2):
        sources = []
        for p in prompts:
            source = provider.open()
            model(mx.array(p[:-1])[None], cache=make_prompt_cache(model))
            source.heard(0, p[:-1])
            source.prefill(p[:-1])
            sources.append(source)
        db = MtpDraftBatch(provider.head)
        db.join(sources)
        drafters.append((db, sources))
    (eager, eager_src), (lazy, lazy_src) = drafters
    feeds, ns = [[p[-1]] for p in prompts], [3, 0, 2]
    want = eager.draft([(s, f, n) for s, f, n in zip(eager_src, feeds, ns)])
    recorded = []
    for s in lazy_src:
        s.record_draft = (lambda inner: lambda d: recorded.append(list(d)) or inner(d))(s.record_draft)
    opened = lazy.draft_lazy([(s, f, n) for s, f, n in zip(lazy_src, feeds, ns)])
    assert opened.lengths == [len(d) for d in want] == ns and not recorded, name
    assert opened.read() == want and recorded == [d for d in want if d], name
    assert opened.read() == want and len(recorded) == 2, name  # read once
    for (db, sources), d in ((drafters[0], want), (drafters[1], want)):
        db.commit([(s, x, 1) for s, x in zip(sources, d) if x])
    assert [s.caches[0].offset for s in eager_src] == [s.caches[0].offset for s in lazy_src], name


def test_a_request_whose_drafts_stop_paying_decodes_plainly_and_the_heads_catch_up_where_they_can(bound):
    """Over plain KV caches the policy stops and the rest runs on mlx-lm's pipelined steps, unheard: the heads catch up
    before the caches are stored. Over recurrent state it pauses, and the solo verifier keeps feeding them."""
    from mlx_lm.generate import generate_step

    from spec import SpecStats, speculative_decode

    name, model, provider = bound
    caches = make_prompt_cache(model)
    model(mx.array(PROMPT[:-1])[None], cache=caches)
    recurrent = not provider.open().can_catch_up(caches)
    policy = provider.policy(3, recurrent=recurrent)
    policy.stop_below = 2.0  # nothing pays: it stops (or pauses) after its warm-up
    source = provider.open()
    source.heard(0, PROMPT[:-1])
    source.prefill(PROMPT[:-1])
    stats = SpecStats()
    got = [t for t, _, _ in speculative_decode(model, caches, PROMPT[-1], source, max_tokens=16, num_draft_tokens=3,
                                               policy=policy, stats=stats)]
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=16,
                                              prompt_cache=make_prompt_cache(model))]
    assert got == want, name
    assert (stats.stopped == 1) != recurrent and stats.rounds == 4, (name, stats)  # drafting ended with the warm-up
    seq = (PROMPT + got)[: max(int(c.offset) for c in caches if hasattr(c, "offset"))]  # what the caches cover
    source.prefill(seq)
    assert source.behind != recurrent, name  # the plain steps were not heard; the paused verifier's were
    assert source.catch_up(model, caches, seq), name  # recomputed, or nothing was missed
    assert_same_caches(source, cold(model, provider, seq), name)


@pytest.mark.parametrize("with_verdict", [True, False], ids=["drafts-read-with-verdict", "drafts-read-first"])
def test_a_round_reads_its_unread_drafts_with_the_verdict_and_decodes_what_plain_greedy_does(bound, with_verdict,
                                                                                               monkeypatch):
    """The solo verifier builds its forward over the heads' drafts before reading them (``draft_lazy``, one wait a
    round); read first (``draft``) or with the verdict, the tokens, the rounds and the heads' caches are the same."""
    from mlx_lm.generate import generate_step

    import spec.verify
    from spec import SpecStats, speculative_decode
    from spec.adaptive import FixedDraftLength

    monkeypatch.setattr(spec.verify, "READ_DRAFTS_WITH_VERDICT", with_verdict)
    name, model, provider = bound
    calls: list[str] = []

    class Counted:
        hears_hidden = True

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

        def draft(self, feed, n):
            calls.append("draft")
            return self.inner.draft(feed, n)

        def draft_lazy(self, feed, n):
            calls.append("draft_lazy")
            got = self.inner.draft_lazy(feed, n)
            assert got is None or isinstance(got, mx.array)
            return got

    caches, source = prompt_heard(model, provider)
    stats = SpecStats()
    got = [t for t, _, _ in speculative_decode(model, caches, PROMPT[-1], Counted(source), max_tokens=12,
                                               num_draft_tokens=3, policy=FixedDraftLength(3), stats=stats)]
    want = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12,
                                              prompt_cache=make_prompt_cache(model))]
    assert got == want, name
    assert stats.rounds > 0 and 3 * stats.rounds - 3 <= stats.drafted <= 3 * stats.rounds, (name, stats)  # last: short
    assert set(calls) == {"draft_lazy" if with_verdict else "draft"}, (name, calls)
    seq = (PROMPT + got)[: max(int(c.offset) for c in caches if hasattr(c, "offset"))]
    source.prefill(seq)
    assert not source.behind, name
    assert_same_caches(source, cold(model, provider, seq), name)


def test_an_unread_draft_is_committed_without_being_read_and_checked_when_named_by_its_tokens(bound):
    name, model, provider = bound
    caches, source = prompt_heard(model, provider)
    proposed = source.draft_lazy([PROMPT[-1]], 3)
    assert isinstance(proposed, mx.array) and proposed.shape == (3,), name
    source.commit(proposed, 0)  # what a verifier does when its forward failed: the array itself, nothing read
    assert source._seq == PROMPT, name  # the pending token joined; no draft did
    second = source.draft_lazy([], 2)
    assert second is not None
    with pytest.raises(RuntimeError):
        source.commit([t + 1 for t in second.tolist()], 1)  # tokens it did not draft
    source.commit(second.tolist(), 2)  # the same tokens, read
    assert source._seq == PROMPT + second.tolist(), name


def test_deepseek_v3_heads_load_from_the_layer_past_its_last(tmp_path):
    """DeepSeek-V3's MTP layer (``model.layers.<N>.*``, experts unstacked as the checkpoint ships them), converted by
    mlx-lm's own sanitize as a one-layer model's layer 0. (mlx-lm 0.32 drops only a layer numbered 61 when it loads a
    DeepSeek-V3, so the tiny target is built in memory here, not loaded from the directory.)"""
    from mlx.utils import tree_flatten

    from models.mtp import load_heads
    from models.mtp.heads import DeepseekStyleMtp, MtpHead, target_embed_and_head
    from spec.mtp import entry_mask
    from tests.fixtures import zoo

    model = zoo.build("deepseek_v3", VOCAB)
    args = model.args
    from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

    module = DeepseekStyleMtp(DeepseekV3DecoderLayer(args, args.num_hidden_layers), args.hidden_size,
                              args.rms_norm_eps)
    module.load_weights(list(zoo._scaled(module, 5).items()))
    embed, out = target_embed_and_head(model)
    built = MtpHead(family="deepseek", module=module, embed=embed, head=out, layers=1, hidden_size=args.hidden_size)
    weights = zoo_mtp.checkpoint_weights("deepseek_v3", model, built)
    n = args.num_hidden_layers
    for part in ("gate_proj", "up_proj", "down_proj"):  # as the checkpoint ships them: one tensor per expert
        stacked = weights.pop(f"model.layers.{n}.mlp.switch_mlp.{part}.weight")
        weights.update({f"model.layers.{n}.mlp.experts.{e}.{part}.weight": stacked[e] for e in range(len(stacked))})
    weights[f"model.layers.{n}.embed_tokens.weight"] = mx.zeros((VOCAB, args.hidden_size))  # a copy: not loaded
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(zoo.config("deepseek_v3", VOCAB)))
    loaded = load_heads(tmp_path, model)
    assert loaded.family == "deepseek" and loaded.params == built.params
    tokens, hidden = mx.array([[5, 6, 7]]), mx.ones((1, 3, args.hidden_size))
    got = loaded.forward(tokens, hidden, loaded.make_caches(), entry_mask(0, 3))
    assert mx.allclose(got, built.forward(tokens, hidden, built.make_caches(), entry_mask(0, 3)), atol=1e-4).item()
    assert len(dict(tree_flatten(loaded.module.parameters()))) == len(dict(tree_flatten(module.parameters())))
