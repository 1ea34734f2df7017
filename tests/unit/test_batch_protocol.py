"""Every decode mechanism is a ``Batch`` (server.engine.batch.protocol) and keeps its contract: the same verbs with the
protocol's signatures; ``step`` gives each row the token it makes alone (greedy, on a tiny random model);
``remove`` hands back caches that cover exactly the tokens it says (a forward on them continues the row as if it had
never been batched); a row a kind cannot hold is refused at ``add``, never half-joined. And ``choose``, the one place
a kind is picked, table by table."""

from __future__ import annotations

import inspect

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from server.engine.batch import Batch, BatchKind, CacheFacts, Layout, Row, RowDraft, choose, make
from server.engine.batch.mlx import MlxBatch
from server.engine.batch.ragged import RaggedBatch
from server.engine.batch.solo import SoloBatch
from server.engine.batch.speculating import SpeculatingBatch
from spec import FixedDraftLength, NgramSource, SpecStats
from tests.fixtures.tiny_models import tiny_llama

KINDS = {"solo": SoloBatch, "mlx": MlxBatch, "ragged": RaggedBatch, "speculating": SpeculatingBatch}
VERBS = [name for name, _ in inspect.getmembers(Batch, inspect.isfunction) if not name.startswith("_")]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


class Seq:
    """What a batch reads of a sequence: its prompt, what it generated, its max_tokens."""

    def __init__(self, prompt, max_tokens=32):
        self.prompt, self.generated = list(prompt), []
        self.params = type("P", (), {"max_tokens": max_tokens})()


def own_caches(model, tokens):
    caches = make_prompt_cache(model)
    if tokens:
        mx.eval(model(mx.array(tokens)[None], cache=caches))
    return caches


def greedy_alone(model, prompt, n):
    """n tokens of plain greedy decoding after ``prompt``, on caches of its own."""
    caches, out, nxt = own_caches(model, prompt[:-1]), [], prompt[-1]
    for _ in range(n):
        nxt = int(mx.argmax(model(mx.array([[nxt]]), cache=caches)[0, -1]).item())
        out.append(nxt)
    return out


def row(model, seq, speculating=False):
    draft = RowDraft(NgramSource(), FixedDraftLength(3), 3, SpecStats()) if speculating else None
    return Row(seq, own_caches(model, seq.prompt[:-1]), list(seq.prompt), draft=draft)


def test_the_protocol_has_the_verbs_every_kind_is_driven_by():
    assert set(VERBS) == {"accepts", "add", "step", "remove", "kv_nbytes"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_implements_every_verb_with_the_protocols_signature(kind, model):
    batch = KINDS[kind](model)
    assert isinstance(batch, Batch) and batch.kind == kind
    for verb in VERBS:
        mine = inspect.signature(getattr(type(batch), verb))
        theirs = inspect.signature(getattr(Batch, verb))
        assert list(mine.parameters) == list(theirs.parameters), (kind, verb, mine, theirs)


PROMPTS = [list(range(10, 30)), [5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 43))]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_gives_every_row_its_alone_tokens_and_hands_back_exact_caches(kind, model):
    batch = KINDS[kind](model)
    speculating = kind == "speculating"
    prompts = PROMPTS[:1] if kind == "solo" else PROMPTS  # a solo batch holds one row
    seqs = [Seq(p) for p in prompts]
    batch.add([row(model, s, speculating) for s in seqs])
    assert len(batch) == len(seqs) and batch.sequences == seqs
    for _ in range(40):
        if all(len(s.generated) >= 6 for s in seqs):
            break
        for out in batch.step():
            assert out.seq in seqs and isinstance(out.token, int)
            out.seq.generated.append(out.token)
    for s in seqs:
        assert s.generated[:6] == greedy_alone(model, s.prompt, 6), (kind, s.prompt)
    covered = batch.remove(seqs)
    assert len(batch) == 0 and len(covered) == len(seqs)
    for s, cov in zip(seqs, covered):
        history = s.prompt + s.generated
        assert cov.tokens == history[: len(cov.tokens)] and len(cov.tokens) >= len(history) - 1, kind
        assert all(c.offset == len(cov.tokens) for c in cov.caches), kind
        # the caches go on as the row would have: the next token from them is greedy decoding's
        nxt = history[len(cov.tokens)] if len(cov.tokens) < len(history) else None
        if nxt is not None:
            logits = model(mx.array([[nxt]]), cache=cov.caches)[0, -1]
            want = greedy_alone(model, history[: len(cov.tokens) + 1], 1)[0]
            assert int(mx.argmax(logits).item()) == want, kind
    assert batch.kv_nbytes() == 0 or kind == "mlx"  # mlx-lm's empty batch may keep its arrays until a join


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_row_a_kind_cannot_hold_is_refused_whole(kind, model):
    batch = KINDS[kind](model)
    plain, spec = Seq(PROMPTS[0]), Seq(PROMPTS[1])
    quantized = Row(Seq(PROMPTS[2]), [QuantizedKVCache() for _ in model.layers], PROMPTS[2])
    refused = {
        "solo": [row(model, plain), row(model, spec)],  # the second row of a batch of one
        "mlx": [row(model, spec, speculating=True)],
        "ragged": [row(model, spec, speculating=True), quantized],
        "speculating": [row(model, plain), quantized],
    }[kind]
    if kind == "solo":
        batch.add(refused[:1])
        refused = refused[1:]
    for r in refused:
        before = len(batch)
        assert not batch.accepts(r)
        with pytest.raises(ValueError):
            batch.add([r])
        assert len(batch) == before  # nothing half-joined


CPU, GPU = Layout(), Layout(gpu=True)
PLAIN = CacheFacts(plain_kv=True, mergeable=True)
WINDOWED = CacheFacts(plain_kv=False, mergeable=True)  # sliding windows, recurrent state: mlx-lm's batch caches
QUANTIZED = CacheFacts(plain_kv=False, mergeable=False)  # --kv-bits: nothing merges


@pytest.mark.parametrize("layout,caches,speculating,kind", [
    (CPU, PLAIN, False, BatchKind.RAGGED),
    (CPU, WINDOWED, False, BatchKind.MLX),
    (CPU, QUANTIZED, False, BatchKind.SOLO),
    (GPU, PLAIN, False, BatchKind.MLX),  # no fused kernel: masked attention over the longest row costs more
    (Layout(gpu=True, fused_attention=True), PLAIN, False, BatchKind.RAGGED),
    (Layout(batch_layout="mlx"), PLAIN, False, BatchKind.MLX),
    (Layout(gpu=True, batch_layout="ragged"), PLAIN, False, BatchKind.RAGGED),
    (CPU, PLAIN, True, BatchKind.SPECULATING),
    (Layout(spec_in_batch=False), PLAIN, True, BatchKind.SOLO),
    (CPU, WINDOWED, True, BatchKind.SOLO),
])
def test_choose_picks_one_kind_from_declared_facts(layout, caches, speculating, kind):
    assert choose(layout, caches, speculating) == kind


@pytest.mark.parametrize("kind", list(BatchKind))
def test_make_builds_the_kind_chosen(kind, model):
    assert make(kind, model, CPU).kind == str(kind)


def test_a_hit_and_a_sliding_window_row_go_where_their_caches_can_be_held(model):
    """The facts choose reads are the caches' own: plain KVCache layers (a hit's shared-prefix layers too) and
    sliding windows that keep nothing at their front for the ragged layout (mlx-lm's batch caches take both); a
    window that keeps its first tokens only through mlx-lm's."""
    from models.attention.shared_prefix import share_prefix

    hit = share_prefix(own_caches(model, PROMPTS[0][:-1]))
    assert RaggedBatch(model).accepts(Row(Seq(PROMPTS[0]), hit, PROMPTS[0]))
    windowed = [RotatingKVCache(max_size=8) if i == 0 else KVCache() for i in range(len(model.layers))]
    r = Row(Seq(PROMPTS[1]), windowed, PROMPTS[1])
    assert RaggedBatch(model).accepts(r) and MlxBatch(model).accepts(r)
    kept = [RotatingKVCache(max_size=8, keep=4) if i == 0 else KVCache() for i in range(len(model.layers))]
    assert not RaggedBatch(model).accepts(Row(Seq(PROMPTS[1]), kept, PROMPTS[1]))
