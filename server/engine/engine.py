"""The engine: the model work of the lane's plans, behind the lane's ``LaneEngine`` protocol (server.lane.seam).

A thin facade over rooms with one job each:

    admission     here: ``classify`` (the facts a sequence is planned with), ``admit`` (the prefix-cache take, its
                  sampler, rules and speculative setup in a ``SeqWork``), ``take_longer_prefix``
    prefill.py    prompt chunks, one forward or one batched forward, and what a completed prompt stores
    decode.py     every decoding sequence is a row of a ``Batch``: its group's, or a solo batch of its own
    store.py      what a sequence puts in the prefix cache
    warmup.py     page in and compile what the first requests use, in steps the lane runs

The engine keeps its per-sequence state in ``SeqWork`` records keyed by the sequence (server.engine.work); what the
lane learns comes back as the seam's records. Lane thread only, but for ``classify`` and ``namespace_for``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import mlx.core as mx

from cache.prefix import namespace
from models.attention.shared_prefix import share_prefix
from server.engine.batch import BatchKind, GroupKey, Layout, LogitsRules, choose, joins, moves, place, solo_pipelined
from server.engine.decode import Decoder
from server.engine.kv_layout import kv_scheme
from server.engine.prefill import Prefiller
from server.engine.sampling import build_sampler, repair_random_state, token_logprobs
from server.engine.slot import ModelSlot, traced_price
from server.engine.speculation import Speculation
from server.engine.store import CacheWriter, take_checkpoint
from server.engine.warmup import check_kv_quantization, warm_up_steps
from server.engine.work import SeqWork
from server.lane.budget import KVPrice
from server.lane.seam import Admitted, BatchStep, Emitted, Ended, Prefilled, SeqFacts, SeqView, WarmStep
from server.lane.target import Slot, Target

__all__ = ["Engine", "EngineConfig", "weights_nbytes"]

log = logging.getLogger("mlx_lane.engine")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine computes, decided once at start (server.cli flags, server.serve)."""

    prefill_chunk: int = 512  # --prefill-chunk
    kv_bits: Optional[int] = None  # --kv-bits
    kv_group_size: int = 64  # --kv-group-size
    layout: Layout = field(default_factory=Layout)  # --batch-layout, --no-spec-batch, the device
    speculation: Optional[Speculation] = None  # --draft-model / --draft-kind
    read_shared_prefix: bool = True  # not --debug-copy-hits: a hit reads its cached prefix in place


class Engine:
    """Binds the base model to a prompt cache (a ``cache.protocol.PrefixCache``) and the lane's MLX stream."""

    def __init__(self, loaded, prompt_cache, stats, config: EngineConfig = EngineConfig()):
        self.config = config
        self.prefill_chunk = config.prefill_chunk
        self.base = ModelSlot(loaded, base=True, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size,
                              read_shared_prefix=config.read_shared_prefix,  # --model
                              draft_heads=config.speculation.draft_heads if config.speculation else None)
        self.prompt_cache = prompt_cache
        self.stats = stats
        self.speculation = config.speculation
        self.stream = None  # created on the lane thread by bind_stream()
        if config.kv_bits is not None:
            check_kv_quantization(self.base)
        self._work: dict[object, SeqWork] = {}
        self.writer = CacheWriter(prompt_cache)
        self.leaves = {"rows": 0, "out_of_batch_s": 0.0, "store_s": 0.0}  # what rows ending cost (/stats)
        # forwards started while MLX's active memory was above its memory limit (/stats memory.over_limit): in such
        # an evaluation MLX waits for the device after every operation (mlx/transforms.cpp, eval_impl), so nothing
        # is pipelined. On a CUDA GPU the limit is the admission budget (server.sizes.allocator_limits)
        self.over_limit = {"decode_steps": 0, "prefill_forwards": 0}
        self.prefiller = Prefiller(self._work_of, self.writer, prompt_cache, gpu=config.layout.gpu,
                                   stream_of=lambda: self.stream)
        self.decoder = Decoder(self._work_of, config.layout, stats=stats, speculation=config.speculation,
                               stream_of=lambda: self.stream, facts_of=self._facts_in)

    def base_target(self) -> Target:
        """The base model with its own weights."""
        return Target(self.base)

    def _work_of(self, seq) -> SeqWork:
        return self._work[seq]

    # -- the lane's thread ---------------------------------------------------------------------------------------
    def bind_stream(self, as_default: bool = False) -> None:
        """Create the MLX stream owned by the calling (lane) thread. ``as_default``: make it the thread's default
        stream too, so that work issued without a stream (the decode batch's step) runs on it as well: a model
        sharded over processes needs every forward, and so every collective, on one stream, in one order."""
        self.stream = mx.new_stream(mx.default_device())
        if as_default:
            mx.set_default_stream(self.stream)

    def task_context(self):
        """What a lane task (server.lane.lane.Lane.call) runs under: the lane's MLX stream."""
        return mx.stream(self.stream)

    def warmup_steps(self) -> list[WarmStep]:
        return warm_up_steps(self.base, self.config.layout, self.prefill_chunk, self.stream, self.speculation)

    # -- what a request is, before it runs -------------------------------------------------------------------
    def draft_tokens(self, target: Target, params) -> int:
        """Draft tokens per step for a request on ``target`` (``Speculation.wanted``, from its model's facts)."""
        spec = self.speculation
        if spec is None or (target.adapter is not None and not spec.drafts_under_adapters):
            return 0
        return spec.wanted(params.num_draft_tokens, target.slot.facts)

    def _cannot_rewind(self, slot: Slot, params) -> bool:
        """The server speculates and the request did not turn it off, but its model's caches cannot rewind."""
        return self.speculation is not None and params.num_draft_tokens != 0 and not slot.facts.rewinds

    def namespace_for(self, target: Target, params) -> str:
        """The cache namespace of a request (``cache.prefix.namespace``): the model fingerprint (KV scheme included),
        plus the adapter's identity (its weights' hash) when the request selected one, plus the draft's identity when
        the request speculates with a draft that keeps KV (its entries hold the draft's layers too). Asked once per
        request, when it is submitted; the sequence carries the answer to the SSD prefetch and the lane's take/put."""
        draft = self.speculation.provider.identity if self.draft_tokens(target, params) else None
        return namespace(target.slot.namespace, adapter=target.adapter_identity, draft=draft)

    def classify(self, seq: SeqView, company: bool = False) -> SeqFacts:
        """Its batch group (one per model, per LoRA adapter, and a speculating one beside each), the kind of that
        group's batch and whether it drafts (``server.engine.batch.choose.place``: with ``company``, a model that
        speculates only alone decodes plainly), whether it may prefill in a batched forward
        (``facts.prefills_together``: not quantized KV, nor an architecture whose recurrent layers let padding in;
        the base model, no adapter, no speculation, no images; a hybrid's even after a long cache hit), and the
        model's sliding window. Everything of the model comes from its ``ModelFacts``."""
        target = _target_of(seq)
        slot, layout = target.slot, self.config.layout
        facts = slot.facts
        placed = place(layout, facts.caches, bool(self.draft_tokens(target, seq.params)), company)
        kind = placed.kind
        # the model by name, not by namespace: every rank of a sharded model has its own shard's namespace, and the
        # plans rank 0 broadcasts name groups
        group = GroupKey(slot.name, target.adapter_identity, kind == BatchKind.SPECULATING)
        return SeqFacts(group=group, batchable=kind != BatchKind.SOLO,
                        prefill_together=(not placed.drafting and facts.prefills_together and slot.base
                                          and target.adapter is None
                                          and seq.media is None),  # images: embeddings, one forward each
                        # only a hybrid's per-token prefill cost pays for gathering past a long hit or a first
                        # chunk: on the H200 gpt-oss gathering every chunk spent 17.2 s prefilling 16 cold 5.6k
                        # prompts against 11.5 s gathering only first chunks, and 24-31 s against 19 s over 16
                        # agents x 4 turns (the padded rows attend through a mask over every cached key)
                        together_after_hits=facts.caches.recurrent,
                        window=facts.window, batch_kind=str(kind),
                        moves=moves(kind, facts.caches, layout), joins=joins(kind, facts.caches),
                        drafting=placed.drafting, solo_ahead=solo_pipelined(layout, facts.caches),
                        yields=placed.yields)

    def _facts_in(self, seq: SeqView, group: GroupKey) -> SeqFacts:
        """A sequence's facts once it decodes in ``group`` (a speculating batch dissolved into the plain one)."""
        cache_facts = self._work_of(seq).slot.facts.caches
        kind = choose(self.config.layout, cache_facts, group.speculating)
        return SeqFacts(group=group, batchable=kind != BatchKind.SOLO, prefill_together=False,
                        window=seq.facts.window, batch_kind=str(kind),
                        moves=moves(kind, cache_facts, self.config.layout), joins=joins(kind, cache_facts),
                        drafting=group.speculating, solo_ahead=seq.facts.solo_ahead)

    # -- admission and prefill ---------------------------------------------------------------------------------
    def admit(self, seq: SeqView) -> Admitted:
        target, params = _target_of(seq), seq.params
        slot = target.slot
        n_draft = self.draft_tokens(target, params) if seq.facts.drafting else 0
        if not n_draft and self._cannot_rewind(slot, params) and self.stats.spec is not None:
            self.stats.spec.on_cannot_rewind()  # it asked to speculate; its caches cannot take a draft back
        hit = self.prompt_cache.take(seq.prompt, seq.ns, seq.session)
        cached = hit.length if hit is not None else 0
        spec = None
        if n_draft:  # an entry holds the target's layers, then the draft's
            target_caches, draft_caches = self.speculation.split(hit.caches if hit is not None else None, slot.facts)
            caches = target_caches if target_caches is not None else slot.new_caches()
            spec = self.speculation.open(draft_caches, seq.prompt[:cached], n_draft)
        else:
            caches = self._taken(slot, _target_part(slot, hit)) if hit is not None else slot.new_caches()
        grammar = params.grammar.processor() if params.grammar is not None else None
        model = target.adapter.model if target.adapter is not None else slot.model
        media = getattr(seq, "media", None)
        if media is not None and media.grid is not None and hasattr(model, "positioned"):
            with mx.stream(self.stream):  # multimodal rotary positions: the prompt's own (models.loading.vlm_text)
                model = model.positioned(media.input_ids, media.grid)
        work = self._work[seq] = SeqWork(
            slot=slot, model=model, caches=caches,
            sampler=build_sampler(params), greedy=params.temperature == 0, rules=LogitsRules.of(params, grammar),
            spec=spec, covered=cached, cached=cached)
        if cached and slot.facts.needs_checkpoints:
            work.snapshots.update(hit.checkpoints)  # the entry's own, so the one it stores reaches them too
            take_checkpoint(seq, work, cached)  # where its hit ends is a checkpoint too
        logprob_of = None
        if params.logprobs:
            top = params.top_logprobs
            logprob_of = lambda logprobs, token: token_logprobs(logprobs, token, top, slot.decode_one)  # noqa: E731
        return Admitted(cached, slot.detokenizer(keep_leading_space=params.raw_text), slot.eos, logprob_of)

    def take_longer_prefix(self, seq) -> Optional[int]:
        """Before a sequence's first prefill chunk: take again when the prefix cache now holds a longer prefix than
        it had at admission (agents sent at once share a system prompt: the first one's prompt-boundary entry serves
        the others, instead of each prefilling it). The new coverage when the caches were replaced."""
        work = self._work_of(seq)
        if work.covered != work.cached or work.covered >= len(seq.prompt) - 1:
            return None
        if work.spec is not None and self.speculation.provider.identity is not None:
            return None  # a two-model entry also holds the draft's layers: taken only at admission (split there)
        if self.prompt_cache.peek(seq.prompt, seq.ns, seq.session) <= work.covered:
            return None
        hit = self.prompt_cache.take(seq.prompt, seq.ns, seq.session)
        if hit is None or hit.length <= work.covered:
            return None
        work.caches = self._taken(work.slot, _target_part(work.slot, hit)) if work.spec is None else hit.caches
        work.covered = work.cached = hit.length
        if work.slot.facts.needs_checkpoints:
            work.snapshots.update(hit.checkpoints)
            take_checkpoint(seq, work, hit.length)
        return hit.length

    def _taken(self, slot: Slot, hit) -> list:
        """A hit's caches for a plain sequence: where every attention of the model reads segments
        (``models.attention.reads_segments``: the CPU's and the CUDA wrappers) they read the entry's KV where it lies
        (``SharedPrefixKVCache``: the first new token does not copy the whole prefix); they become plain ``KVCache``
        again where they are stored or join mlx-lm's batch."""
        if not slot.facts.reads_shared_prefix:
            return hit.caches
        caches = share_prefix(hit.caches)
        if caches is not hit.caches and self.stats is not None:
            self.stats.on_hit_read_in_place()
        return caches

    def prefill(self, chunks: Sequence[tuple[object, int]], store_now: bool) -> list[Prefilled]:
        self._note_over_limit("prefill_forwards")
        return self.prefiller.run(chunks, store_now)

    # -- decoding ------------------------------------------------------------------------------------------------
    def join_batch(self, group: GroupKey, seqs: Sequence) -> Sequence[tuple[SeqView, SeqFacts]]:
        return self.decoder.join(group, seqs)

    def leave_batch(self, seq) -> None:
        self.decoder.go_solo(seq)

    def step_batch(self, group: GroupKey) -> BatchStep:
        self._note_over_limit("decode_steps")
        return self.decoder.step(group)

    def step_solo(self, seq) -> Optional[Emitted]:
        self._note_over_limit("decode_steps")
        return self.decoder.step_solo(seq)

    def reset_batch(self, group: GroupKey, seqs=()) -> None:
        """A batch whose step raised goes whole, before its rows (``seqs``) are abandoned: none of them is copied out
        of it (its state is not to be trusted, and on a GPU that ran out of memory a row's copy would ask for more);
        the group starts afresh."""
        self.decoder.reset(group)
        for seq in seqs:
            work = self._work.get(seq)
            if work is not None:
                work.batched = False
        _repair_after_failure()

    def batch_rows(self) -> int:
        return self.decoder.rows()

    def batch_kv_bytes(self) -> int:
        """Bytes the decode batches' KV buffers hold now (free slots and padding included), for the memory budget."""
        return self.decoder.kv_nbytes()

    # -- the end -------------------------------------------------------------------------------------------------
    def end(self, seqs: Sequence) -> list[Ended]:
        """Store what each sequence computed (also after a cancellation): out of its batch, or its own caches when
        it never decoded (cancelled while prefilling: what it covers of its prompt)."""
        out = []
        t0 = time.perf_counter()
        covered_all = self.decoder.leave(seqs)
        t1 = time.perf_counter()
        for seq, covered in zip(seqs, covered_all):
            work = self._work.pop(seq)
            try:
                with mx.stream(self.stream):
                    if covered is not None:
                        self.writer.store(covered.tokens, covered.caches, seq, work)
                    elif work.caches is not None:
                        self.writer.store(seq.prompt[: work.covered], work.caches, seq, work)
            except Exception:  # caching is an optimisation: never fail the request for it
                log.exception("storing %s failed", seq.id)
            out.append(Ended(work.stored, work.spec.stats if work.spec is not None else None))
        self.leaves["rows"] += len(seqs)
        self.leaves["out_of_batch_s"] += t1 - t0  # a pipelined batch first waits for the step in flight
        self.leaves["store_s"] += time.perf_counter() - t1
        return out

    def abandon(self, seq) -> None:
        """The sequence's model work raised: its row leaves (nothing is stored); the lane serves on."""
        work = self._work.get(seq)
        if work is not None and (work.batched or work.solo is not None):
            try:
                self.decoder.leave([seq])
            except Exception:
                log.exception("taking %s out of its batch failed", seq.id)
        self._work.pop(seq, None)
        _repair_after_failure()

    # -- for /stats ----------------------------------------------------------------------------------------------
    def weights_nbytes(self) -> int:
        return weights_nbytes(self.base.model)

    def kv_price_estimate(self):
        """What a sequence of the base model costs (server.lane.budget.KVPrice), traced on two short forwards: its
        caches, and with speculation on, its draft source's too (a draft model's KV; MTP heads' KV and the hidden
        states they read), which a speculating sequence holds beside them. Every sequence is priced as if it
        speculates: a request that turns drafting off reserves a little more than it uses, never less."""
        price = self.base.measure_kv()
        if self.config.speculation is not None:
            draft = traced_price(self.config.speculation.provider.trace_caches)
            price = KVPrice(price.per_token + draft.per_token, price.per_sequence + draft.per_sequence)
            self.base.kv_price = price
        return price

    def kv_stats(self) -> dict:
        """The `kv_cache` block of /stats: the scheme and the measured bytes per cached token (all layers)."""
        bits, group = self.config.kv_bits, self.config.kv_group_size
        return {"scheme": kv_scheme(bits, group), "bits": bits, "group_size": group if bits else None,
                "bytes_per_token": round(self.writer.kv_bytes_per_token, 1)}

    def vision_stats(self) -> dict:
        """The ``vision`` block of /stats: whether the base model takes images, the images the vision encoder ran
        on (those the prefix cache did not serve) and its seconds on the lane."""
        pre = self.prefiller
        return {"enabled": self.base.vision is not None, "images_encoded": pre.images_encoded,
                "encode_s": round(pre.encode_s, 4)}

    def prefill_stats(self) -> dict:
        """The lane's prompt chunks: forwards, tokens and where their seconds went (server.engine.prefill)."""
        return self.prefiller.clock.as_dict()

    def _note_over_limit(self, kind: str) -> None:
        if mx.get_active_memory() > mx.get_memory_limit():  # this evaluation will be unpipelined
            self.over_limit[kind] += 1

    def over_limit_stats(self) -> dict:
        """Decode steps (batched or solo) and prefill forwards that began with MLX's active memory above its limit."""
        return dict(self.over_limit)

    def leave_stats(self) -> dict:
        """Rows that ended: how many, the seconds taking them out of their batches and storing their entries."""
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.leaves.items()}

    def batch_stats(self) -> dict:
        """The ``batch`` block of /stats: the base model's plain batch kind, its attention path, and every group's
        batch now."""
        facts = self.base.facts
        kind = choose(self.config.layout, facts.caches, speculating=False)
        return {"layout": str(kind), "attention": facts.attention, "recurrent": facts.recurrent_path,
                "experts": facts.expert_path,
                "groups": self.decoder.describe()}


def _target_of(seq: SeqView) -> Target:
    target = seq.target
    if target is None:
        raise ValueError(f"sequence {seq.id} has no target model: the door resolves one for every request")
    return target


def _target_part(slot: Slot, hit):
    """A hit for a request that does not draft: its model's layers. An entry of a namespace with a draft (the request
    asked to speculate, but decodes plainly beside others: server.engine.batch.choose.place) may hold the draft's
    layers (a draft model's, or MTP heads' and hidden states) after the target's."""
    n = slot.facts.layers
    return hit if len(hit.caches) <= n else replace(hit, caches=hit.caches[:n])


def _repair_after_failure() -> None:
    """What a failed step may leave broken for the requests after it (see ``repair_random_state``)."""
    try:
        if repair_random_state():
            log.warning("a failed step left MLX's random state unusable; reseeded it")
    except Exception:
        log.exception("repairing the random state failed")


def weights_nbytes(model) -> int:
    """Bytes of a model's parameters (what its weights hold in memory)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

