"""The architecture zoo on the real engine and lane (issue 35): for every architecture of tests.fixtures.zoo, tiny
random weights built by mlx-lm's own classes, each check against mlx-lm's own greedy tokens on the same model:

- cold; the same prompt again (a RAM hit); a longer prompt extending the first run (a prefix hit); a turn that
  parts from the stored one where its conversation ended (what a thinking template does when it re-renders the
  history without the reasoning): served from the longest reusable prefix (cut back, or a checkpoint);
- four requests arriving at different ticks into one batch, each making its alone tokens, each run stored whole;
- an entry written in the SSD tier's file format and read back (a restart) serves the next turn the same way;
- n-gram and two-model speculation give plain greedy tokens, with drafts actually verified;
- ``--kv-bits 8``: mlx-lm's greedy tokens over the same quantized caches, or a clear refusal at start.

The live server side of the zoo (HTTP, the chat template, the SSD tier across a restart, an adapter) is in
tests/integration/test_zoo_live.py."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from models import kernels, mamba_lengths
from tests.fixtures import zoo, zoo_vlm
from tests.fixtures.tiny_models import IdTokenizer

VOCAB = 256
# the second source: mlx-vlm's classes, against mlx-vlm's own greedy tokens (issue 46; mlx-vlm is the vision extra)
VLM = sorted(zoo_vlm.ZOO) if importlib.util.find_spec("mlx_vlm") is not None else []
NAMES = sorted(zoo.ZOO) + VLM
FAMILY = {**zoo.FAMILY, **zoo_vlm.FAMILY}


class NoEosTokenizer(IdTokenizer):
    eos_token_ids: set = set()  # every request runs to max_tokens, like mlx-lm's generate_step


@pytest.fixture(scope="module", params=NAMES)
def arch(request):
    """The model, switched to mlx-lane's kernels as the loader switches it (models.kernels: on this CPU the chunked
    gated delta rule for prompts); switched back after the module. mlx-vlm's models as its loader wraps them."""
    if request.param in VLM:
        yield request.param, zoo_vlm.build(request.param, VOCAB)
        return
    model = zoo.build(request.param, VOCAB)
    kernels.install(model)
    mamba_lengths.install(model)  # as the loader does: nemotron_h's mixer stops each batched row's state at its end
    yield request.param, model
    kernels.hook.restore(model, kernels.GATED_DELTA)
    kernels.hook.restore(model, kernels.SSM)


def alone(model, prompt, n, caches=None):
    """mlx-lm's greedy tokens (the oracle), with mlx-lm's own functions in every layer; mlx-vlm's own (its
    ``generate_step``) for a model of the second source."""
    if getattr(model, "source", None) == "mlx-vlm":
        assert caches is None, "mlx-vlm's oracle runs on fresh caches"
        return zoo_vlm.alone(model, prompt, n)
    caches = make_prompt_cache(model) if caches is None else caches
    with kernels.mlx_lm_kernels(model):
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=caches)]


def lane_of(model, cache=None, prefill_batch=1, prefill_together_max=0, **config):
    from cache.prompt_cache import NullPromptCache
    from server.engine.engine import Engine, EngineConfig
    from server.lane.lane import Lane
    from server.stats import ServingStats

    cache = NullPromptCache() if cache is None else cache
    loaded = SimpleNamespace(model=model, tokenizer=NoEosTokenizer(), fingerprint="z" * 16)
    stats = ServingStats()
    engine = Engine(loaded, cache, stats, EngineConfig(prefill_chunk=16, **config))
    engine.bind_stream()
    return Lane(engine, cache, stats, max_batch=8, prefill_batch=prefill_batch, prefill_together_max=prefill_together_max)


def submit(lane, prompt, n, checkpoints=()):
    from server.lane.events import SamplingParams
    from server.lane.sequence import Sequence

    events = []
    target = lane.engine.base_target()
    params = SamplingParams(max_tokens=n, temperature=0.0)
    seq = Sequence(prompt=list(prompt), params=params, sink=events.append, id=str(id(events)), target=target,
                   ns=lane.engine.namespace_for(target, params), checkpoints=tuple(checkpoints))
    lane.submit(seq)
    return seq, events


def finished(events):
    from server.lane.events import Failed, Finished

    errors = [e for e in events if isinstance(e, Failed)]
    assert not errors, errors
    return next(e for e in events if isinstance(e, Finished))


def run(lane, prompt, n=8, checkpoints=()):
    seq, events = submit(lane, prompt, n, checkpoints)
    while not lane.idle():
        lane.tick()
    return list(seq.generated), finished(events)


HISTORY = [(7 * i + 3) % 200 + 20 for i in range(40)]  # a conversation of 40 tokens: past a 16-token window
TURN1 = HISTORY + [5, 6]  # + a generation prompt that opens a think block
TURN2 = HISTORY + [9, 10, 11, 12, 5, 6]  # the reply re-rendered without it and a new user turn: parts at 40


def test_cold_ram_hit_prefix_hit_and_a_turn_that_parts_where_the_conversation_ended(arch):
    from cache.prompt_cache import PromptCache

    name, model = arch
    cold, done = run(lane_of(model), TURN1)
    assert cold == alone(model, TURN1, 8), name
    assert done.cached_tokens == 0

    cache = PromptCache(1 << 28)
    lane = lane_of(model, cache)
    first, _ = run(lane, TURN1, checkpoints=(len(HISTORY),))
    assert first == cold
    again, done = run(lane, TURN1)
    assert again == cold and done.cached_tokens > len(HISTORY), (name, done.cached_tokens)  # a RAM hit

    longer = TURN1 + first + [40, 41, 42]  # the next turn extends the whole first run
    grown, done = run(lane, longer)
    assert grown == alone(model, longer, 8), name
    assert done.cached_tokens >= len(TURN1) + len(first) - 1, (name, done.cached_tokens)

    parted, done = run(lane, TURN2)
    assert parted == alone(model, TURN2, 8), name
    # the longest prefix before the parting: cut back (plain KV) or the checkpoint kept where the conversation ended
    assert done.cached_tokens == len(HISTORY), (name, FAMILY[name], done.cached_tokens)


# the phase of a row decoding with others: in their batch; a model of mlx-vlm's cache classes decodes each request
# alone, every one a step per tick (server.engine.slot: this engine's batch kinds hold mlx-lm's classes)
DECODING = {False: "BATCHED", True: "SOLO"}
PROMPTS = [HISTORY, HISTORY[:9] + [77, 78], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 4, HISTORY[5:12]]


def run_arrivals(lane, arrivals, n, ticks, decoding_together):
    """Submit ``PROMPTS[i]`` (``n`` tokens each) at tick ``arrivals[i]`` and tick the lane until every one ended;
    returns ``{i: (seq, events)}`` and the most sequences seen at once in the phase ``decoding_together`` names."""
    seqs, together = {}, 0
    for tick in range(ticks):
        if tick in arrivals:
            i = arrivals.index(tick)
            seqs[i] = submit(lane, PROMPTS[i], n)
        if lane.idle() and len(seqs) == len(PROMPTS):
            break
        lane.tick()
        together = max(together, sum(1 for s, _ in seqs.values() if s.phase.name == decoding_together))
    return seqs, together


def test_four_requests_arriving_at_different_ticks_make_their_alone_tokens_and_store_their_runs(arch):
    from cache.prompt_cache import PromptCache

    name, model = arch
    want = [alone(model, p, 10) for p in PROMPTS]
    lane = lane_of(model, PromptCache(1 << 28))
    seqs, together = run_arrivals(lane, [0, 3, 5, 6], 10, 300, DECODING[name in VLM])
    assert together >= 2, (name, together)  # they did decode together (mlx-vlm's models: each alone, interleaved)
    for i, (seq, events) in seqs.items():
        finished(events)
        assert list(seq.generated) == want[i], (name, i)
        # its whole run stored (all but the last token where nothing ran ahead to feed it)
        assert seq.stored >= len(PROMPTS[i]) + 10 - 1, (name, i, seq.stored)


def test_the_gpu_layout_prefills_arrivals_together_and_batches_every_row(arch):
    """The layout a GPU gets (decoders running a forward ahead, ``--prefill-batch`` 4), run on this CPU: four prompts
    arriving together prefill in batched forwards where the caches allow (plain and sliding-window layers) and give
    their alone tokens; a sliding-window row that wraps starts in the batch even when it is ready alone, so the later
    arrivals decode with it (alone, pipelined, it could never have joined: every gpt-oss agent decoded by itself)."""
    from cache.prompt_cache import PromptCache
    from server.engine.batch.choose import Layout

    name, model = arch
    want = [alone(model, p, 10) for p in PROMPTS]
    # the H200's layout: the fused attention kernel there, so every row decodes in the pipelined ragged batch
    # (hybrid rows join it from solo decoding and leave it only when they finish; window layers read their last
    # `window` columns)
    lane = lane_of(model, PromptCache(1 << 28), prefill_batch=4, prefill_together_max=16,
                   layout=Layout(gpu=True, fused_attention=True))
    seqs = {i: submit(lane, PROMPTS[i], 10) for i in (0, 1, 2)}
    sizes = set()
    for tick in range(300):
        if tick == 6:
            seqs[3] = submit(lane, PROMPTS[3], 10)  # a late arrival
        if lane.idle() and len(seqs) == len(PROMPTS):
            break
        lane.tick()
        sizes.add(sum(1 for s, _ in seqs.values() if s.phase.name == DECODING[name in VLM]))
    for i, (seq, events) in seqs.items():
        finished(events)
        assert list(seq.generated) == want[i], (name, i)
    together = lane.stats.prefill_batches
    # every architecture of the zoo prefills together (nemotron_h once models.mamba_lengths tells its Mamba-2 mixer
    # where rows end); mlx-vlm's models prefill one prompt per forward (mlx-lm's batched prefill merges its classes)
    assert lane.engine.base.facts.prefills_together == (name not in VLM), name
    assert together >= (1 if lane.engine.base.facts.prefills_together else 0), (name, together)
    if FAMILY[name] == "window" and name not in VLM:
        assert together >= 1 and max(sizes) >= 3, (name, together, sizes)
    assert max(sizes) >= 3, (name, sizes)  # every kind decoded together, in the pipelined ragged batch
    # windows and hybrids too (issue 43); mlx-vlm's models each alone
    assert lane.engine.batch_stats()["layout"] == ("solo" if name in VLM else "ragged"), name

    # the next turns of the three conversations, together: each hit is longer than a chunk (16), and their new
    # chunks (16 tokens at most) are within --prefill-together-max: they prefill in one forward for every kind
    # that prefills together (a hybrid would even with longer chunks: its per-token cost dwarfs the copy)
    nexts = [PROMPTS[i] + list(seqs[i][0].generated) + [60 + i, 61, 62, 63, 64, 65] for i in (0, 1, 2)]
    want = [alone(model, p, 6) for p in nexts]
    before = lane.stats.prefill_batches
    turns = [submit(lane, p, 6) for p in nexts]
    while not lane.idle():
        lane.tick()
    for i, (seq, events) in enumerate(turns):
        assert finished(events).cached_tokens > 16, (name, i)
        assert list(seq.generated) == want[i], (name, i)
    if lane.engine.base.facts.prefills_together:
        assert lane.stats.prefill_batches > before, name


def test_the_memory_budgets_price_is_per_token_for_attention_and_per_sequence_for_recurrent_state(arch):
    """A hybrid's recurrent state does not grow with the prompt: priced per token (as the one-token forward did) a
    Qwen3.5-9B asked 250 GiB for a 5,000-token prompt and every agent's request was a 400 on the H200."""
    from server.engine.kv_layout import state_nbytes
    from server.lane.budget import KVPrice

    name, model = arch
    slot = lane_of(model).engine.base
    price = slot.measure_kv()
    assert isinstance(price, KVPrice) and price.per_token > 0, (name, price)
    caches = slot.new_caches()
    n = zoo.WINDOW - 4  # within every window: every attention layer holds all of them
    mx.eval(model(mx.array([list(range(3, 3 + n))]), cache=caches))
    # mlx-vlm's sparse attention and pools keep one compressed entry per few tokens: their bytes grow in steps,
    # which a price per token follows to within a step (a few percent of these tiny models' bytes)
    assert price.of(n) == pytest.approx(state_nbytes(caches), rel=5e-2 if name in VLM else 1e-6), name
    assert (price.per_sequence > 0) == (FAMILY[name] == "hybrid"), (name, price)


def test_an_entry_through_the_ssd_file_format_serves_the_next_turn(arch, tmp_path):
    from cache.kvfile import load, save
    from cache.prompt_cache import PromptCache

    name, model = arch
    cache = PromptCache(1 << 28)
    lane = lane_of(model, cache)
    run(lane, TURN1, checkpoints=(len(HISTORY),))
    (ns, key), = [k for k in cache.keys() if k[1][:len(TURN1)] == tuple(TURN1)]
    with cache._lock:
        stored = cache._by_ns[ns][key]
    save(tmp_path / "entry.safetensors", key, stored.caches, fingerprint="z", ns=ns)
    back = load(tmp_path / "entry.safetensors")
    restarted = PromptCache(1 << 28)
    restarted.put(list(back.tokens), back.caches, ns)
    got, done = run(lane_of(model, restarted), TURN2)
    assert got == alone(model, TURN2, 8), name
    assert done.cached_tokens == len(HISTORY), (name, done.cached_tokens)


REPEATING = [11, 12, 13, 14, 15, 16, 17, 18] * 5  # an n-gram source has something to draft from


@pytest.mark.parametrize("kind", ["ngram", "two-model"])
def test_speculation_gives_plain_greedy_tokens_and_verifies_drafts(arch, kind):
    from server.engine.speculation import Speculation
    from spec import NgramProvider, TwoModelProvider

    name, model = arch
    if kind == "ngram":
        provider = NgramProvider()
    else:  # a smaller draft of the same vocabulary: a tiny llama
        provider = TwoModelProvider(model, zoo.build("llama", VOCAB, seed=7), identity="draft:llama")
    speculation = Speculation(provider, num_draft_tokens=4, kind=kind)
    lane = lane_of(model, speculation=speculation)
    assert speculation.supports(lane.engine.base.facts), name  # every zoo architecture can take back a rejected draft
    drafted = 0
    for prompt in (REPEATING, TURN1):
        got, done = run(lane, prompt, n=16)
        assert got == alone(model, prompt, 16), (name, kind)
        drafted += (done.spec or {}).get("drafted", 0)
    assert drafted > 0, (name, kind)  # drafts were verified, not skipped
    if kind == "two-model":  # the memory budget prices the draft model's KV, which a speculating sequence holds too
        from server.engine.kv_layout import state_nbytes

        price = lane.engine.kv_price_estimate()
        target_alone = lane.engine.base.measure_kv()
        held = make_prompt_cache(provider.model)
        mx.eval(provider.model(mx.array([list(range(3, 13))]), cache=held))
        assert price.of(10) - target_alone.of(10) == pytest.approx(state_nbytes(held), abs=2), name


# mlx-lm's MLA reads its cache's keys as arrays, not (data, scales, biases); its quantized attention has no sinks
KV_BITS_REFUSED = {"deepseek_v3", "gpt_oss", *VLM}  # mlx-vlm's models: mlx-lm's quantized cache is not theirs


def test_kv_bits_gives_mlx_lm_tokens_over_the_same_quantized_caches_or_refuses_at_start(arch):
    from models import ModelLoadError
    from server.engine.kv_layout import quantize_fresh

    name, model = arch
    try:
        lane = lane_of(model, kv_bits=8, kv_group_size=32)
    except ModelLoadError as exc:  # the start-up probe: this model's attention cannot read quantized KV here
        assert "--kv-bits 8 is not supported for this model" in str(exc), (name, exc)
        assert name in KV_BITS_REFUSED, (name, exc)
        return
    assert name not in KV_BITS_REFUSED, name
    got, _ = run(lane, TURN1)
    want = alone(model, TURN1, 8, caches=quantize_fresh(make_prompt_cache(model), 8, 32))
    assert got == want, name


def test_nemotron_h_prefills_together_only_once_its_mixer_is_told_where_rows_end():
    """The engine's facts ask models.mamba_lengths: a nemotron_h whose mixer does not get its rows' lengths (mlx-lm's
    own) would let a shorter row's state run through the padding, so it prefills one prompt per forward."""
    from mlx_lm.models import nemotron_h

    model = zoo.build("nemotron_h", VOCAB)
    ours = nemotron_h.NemotronHMamba2Mixer._ssm
    if getattr(ours, "mlx_lane_lengths", False):
        nemotron_h.NemotronHMamba2Mixer._ssm = ours.mlx_lane_original
    try:
        assert not mamba_lengths.lengths_reach_state(model)
        assert not lane_of(model).engine.base.facts.prefills_together
        assert mamba_lengths.install(model) and mamba_lengths.lengths_reach_state(model)
        assert lane_of(model).engine.base.facts.prefills_together
        assert not mamba_lengths.install(zoo.build("llama", VOCAB))  # no such mixer: nothing to do
        assert mamba_lengths.lengths_reach_state(zoo.build("llama", VOCAB))
    finally:
        nemotron_h.NemotronHMamba2Mixer._ssm = ours


@pytest.mark.parametrize("with_verdict", [True, False], ids=["drafts_read_with_verdict", "drafts_read_first"])
@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])  # sliding-window layers (mlx-lm's RotatingKVCache)
def test_window_rows_with_a_draft_model_arriving_at_different_ticks_make_their_alone_tokens(name, with_verdict,
                                                                                             monkeypatch):
    """A sliding-window model with a draft model, requests joining at different ticks: the first, alone, speculates
    (its drafts read with the verdict or first: spec.verify.READ_DRAFTS_WITH_VERDICT); those that arrive with company
    decode plainly in the plain batch (server.engine.batch.choose.place: a wrapped window cannot take a token fed
    ahead back, so such rows never join a speculating batch). Every request gets mlx-lm's greedy tokens alone."""
    import spec.verify
    from cache.prompt_cache import PromptCache
    from server.engine.speculation import Speculation, SpecTotals
    from spec import TwoModelProvider

    monkeypatch.setattr(spec.verify, "READ_DRAFTS_WITH_VERDICT", with_verdict)
    model = zoo.build(name, VOCAB)
    kernels.install(model)
    want = [alone(model, p, 10) for p in PROMPTS]
    provider = TwoModelProvider(model, zoo.build("llama", VOCAB, seed=7), identity="draft:llama")
    lane = lane_of(model, PromptCache(1 << 28), speculation=Speculation(provider, num_draft_tokens=3,
                                                                          kind="two-model"))
    lane.stats.spec = SpecTotals("two-model", 3)
    seqs, together = run_arrivals(lane, [0, 4, 5, 7], 10, 400, "BATCHED")
    drafted = []
    for i, (seq, events) in seqs.items():
        done = finished(events)
        assert list(seq.generated) == want[i], (name, i)
        drafted.append((done.spec or {}).get("drafted", 0))
    assert drafted[0] > 0, (name, drafted)  # the first, alone, speculated
    assert together >= 2, (name, together)  # the others decoded together, plainly
    assert lane.stats.spec.as_dict()["in_batch"]["steps"] == 0, name  # never in a speculating batch
