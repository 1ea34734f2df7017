"""The model work of the lane's plans: every verb the lane (server.lane.lane) calls to execute a ``TickPlan``.

(About 600 lines, one job: the per-sequence model verbs, kept together because each verb reads and writes the same
Sequence fields in a fixed order: admit -> prefill -> batch / solo -> finish. Batched decoding lives in
server.engine.batch and server.engine.ragged_batch (and, for speculating rows, server.engine.spec_batch); the only
batch logic here is which layout a group gets. The solo decoder is in server.engine.solo,
speculation in server.engine.speculation, sampling in server.engine.sampling, each model's facts in
server.engine.slot.)

Contract of the verbs (lane thread only: they own the model, the MLX stream and the caches). Each works on
``server.lane.sequence.Sequence`` objects and reports through their state (phase, done, prefilled, tokens):

- ``classify(seq)`` (when a sequence arrives): the facts the scheduler plans with: its batch group (one per LoRA
  adapter and per model of the server (``server.engine.slot``), and one speculating group beside each for n-gram
  requests), whether it may join a batch (caches that
  merge; speculation only through a speculating group) and a batched prefill (plain KV layers, the base model, no
  speculation), the model's sliding window.
- ``admit(seq)``: the prefix-cache ``take`` in the namespace the sequence carries, its sampler, grammar processor
  and speculative plan; phase PREFILL.
- ``retake(seq)``: before a chunk, take again when the cache now holds a longer prefix than the sequence covers.
- ``prefill(seq, n, share)`` / ``prefill_together([(seq, n)...], share)``: compute prompt chunks (one forward, or
  one batched forward); a prompt that is complete is ``prefilled`` (then a prompt-boundary entry is stored when
  some layer cannot be trimmed, or when ``share``: others may take its prefix now).
- ``join_batch(group, seqs)`` / ``leave_batch(seq)`` / ``step_batch(group)`` / ``leave_rows(group, seqs)``: the
  decode batches (phase BATCHED / SOLO); ``solo_step(seq)``: one token of a solo sequence.
- ``finish(seq, reason, covered=None)``: store what was computed (also after a cancellation), send ``Finished``;
  ``fail(seq, exc)``: send ``Failed`` (a 500), the lane serves on.
"""

from __future__ import annotations

import logging
import time
from typing import Optional
from typing import Sequence as Seq

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from cache.prefix import namespace
from models.gpu_attention import enabled as gpu_attention_enabled
from models.shared_prefix import flatten as flatten_shared
from models.shared_prefix import share_prefix
from server.engine.batch import BatchGroups, DecodeBatch, can_batch
from server.engine.batch_logits import Penalties
from server.engine.kv_layout import _covered_length, _state_nbytes, kv_scheme
from server.engine.ragged_batch import RaggedBatch
from server.engine.sampling import build_logits_processors, build_sampler, repair_random_state, token_logprobs
from server.engine.slot import ModelSlot
from server.engine.solo import PlainDecode
from server.engine.spec_batch import PlainStepClock, SpecBatch, is_spec_group, spec_group
from server.engine.speculation import speculative_decode
from server.lane.events import Failed, Progress
from server.lane.sequence import FinishReason, Phase, Sequence

__all__ = ["Engine", "weights_nbytes"]

log = logging.getLogger("mlx_lane.engine")


class Engine:
    """Binds a loaded model to a prompt cache (a ``cache.protocol.PrefixCache``) and the lane's MLX stream."""

    def __init__(self, loaded, prompt_cache, stats, *, prefill_chunk: int = 512, kv_bits: int | None = None,
                 kv_group_size: int = 64):
        self.loaded = loaded
        self.base = ModelSlot(loaded, base=True, kv_bits=kv_bits, kv_group_size=kv_group_size)  # --model
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.namespace = loaded.fingerprint
        self.prompt_cache = prompt_cache
        self.stats = stats
        self.prefill_chunk = prefill_chunk
        self.stream = None  # created on the lane thread by bind_stream()
        self.fault_hook = None  # tests may set a callable(seq) that raises inside a generation
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        if kv_bits is not None:
            self._check_kv_quantization()
        self.speculation = None  # server.engine.speculation.Speculation when a draft is configured
        self.spec_in_batch = True  # speculating requests running at once verify their drafts in one batch
        self.batch_layout = "auto"  # --batch-layout: "ragged" (server.engine.ragged_batch), "mlx" (DecodeBatch)
        self.adapters = None  # server.catalog.AdapterRegistry: per-adapter counters (set by server.serve)
        self.kv_bytes_per_token = 0.0  # of the last stored entry, all layers (see kv_stats)
        self._gpu = mx.default_device() != mx.cpu
        self.batches = BatchGroups(self._make_batch)
        self.plain_steps = PlainStepClock()  # the plain batches' steps: what a speculating batch must beat

    def _make_batch(self, model, group):
        if is_spec_group(group):
            return SpecBatch(model)
        if self._ragged_layout(model):
            return RaggedBatch(model, pipelined=self._gpu)  # on a GPU the lane's Python runs during the forward
        return DecodeBatch(model, clear_cache=self._gpu)

    def _wants_ragged(self) -> bool:
        """``--batch-layout``: ``auto`` is ragged on the CPU and where ``models.gpu_attention``'s kernel runs the
        batch's attention (CUDA), mlx-lm's elsewhere (Metal, or CUDA with ``MLX_LANE_GPU_ATTENTION=mlx``). Measured
        on the H200 (BENCHMARKS.md, "A decode batch's attention in one kernel"): with the kernel, the agent workload
        ran in 0.57-0.62x of the wall of mlx-lm's layout; with MLX's masked attention the ragged batch was
        0.84-0.91x as fast as mlx-lm's layout at 8-16 rows ("The decode batch's layout on the H200")."""
        if self.batch_layout != "auto":
            return self.batch_layout == "ragged"
        return not self._gpu or gpu_attention_enabled()

    def _ragged_layout(self, model) -> bool:
        """Whether a plain batch of this model uses the ragged layout: wanted, and every cache layer plain KVCache."""
        return self._wants_ragged() and self.kv_bits is None and all(
            type(c) is KVCache for c in make_prompt_cache(model))

    def resolved_batch_layout(self) -> str:
        """What the base model's plain batch uses: "ragged" or "mlx" (for /stats; the base slot's cache facts)."""
        return "ragged" if self._wants_ragged() and self.base.plain_kv else "mlx"

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

    def warmup(self) -> None:
        """Page the weights in and compile kernels before the first request (lane thread): a prefill, one-token
        steps over a cache, a batched step of two rows and (GPU) a batched prefill of two padded rows, so the first
        request pays none of it. On a GPU the prefill is two whole --prefill-chunk chunks, the second over the
        first's cache (MLX compiles a kernel per shape: the first 2048-token chunk of a cold process cost 1.5-2x a
        warm one on the H200); on the CPU, where nothing is compiled, 8 tokens do."""
        gpu = self._gpu
        with mx.stream(self.stream):
            mx.eval(self.model.parameters())
            caches = self._new_caches()
            n = self.prefill_chunk if gpu else 8
            # on a GPU two chunks: a prompt's later chunks attend over the cache the first ones left (a query
            # shorter than its keys: other kernels than the first chunk's)
            for part in range(2 if gpu else 1):
                mx.eval(self.model(mx.array([[(i % 1000) + 1 + part for i in range(n)]]), cache=caches))
            for _ in range(4 if gpu else 1):
                mx.eval(self.model(mx.array([[1]]), cache=caches))
            if can_batch(caches):
                batch = self._make_batch(self.model, None)
                rows = []
                for n in (3, 5):
                    c = self._new_caches()
                    mx.eval(self.model(mx.array([list(range(1, n))]), cache=c))
                    rows.append((object(), c, list(range(1, n + 1)), {}))
                batch.add_many(rows)
                for _ in range(2):
                    batch.step()
                batch.remove(batch.sequences)
            if gpu and all(type(c) is KVCache for c in caches):  # batched prefill (--prefill-batch): padded rows
                # attend through a mask, not the causal fast path: another kernel to compile before the first request
                group = PromptProcessingBatch(self.model, [0, 1], [self._new_caches(), self._new_caches()],
                                              tokens=[[], []], prefill_step_size=self.prefill_chunk)
                group.prompt([list(range(1, 6)), list(range(1, 10))])
                mx.eval([c.state for c in group.prompt_cache])
                del group
            mx.clear_cache()

    # -- KV-cache quantization (issue 8; the scheme is part of the namespace) --------------
    def _check_kv_quantization(self) -> None:
        """Refuse to start when this device's MLX cannot attend over a quantized KV cache.

        Seen on the H200 (mlx-cuda 0.32.4): `quantized_matmul` has no CUDA kernel for the attention shapes
        ("No implementation for problem shape"), so every request would fail with a 500. A few-token forward
        (odd lengths, as real prompts have) on the default device finds out before the port opens."""
        from models import ModelLoadError

        caches = self._new_caches()
        try:
            for n in (3, 5):
                mx.eval(self.model(mx.array([list(range(1, n + 1))]), cache=caches))
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"--kv-bits {self.kv_bits} is not supported by mlx {mx.__version__} on this device "
                f"({mx.default_device()}): {str(exc).splitlines()[0][:200]}. Start without --kv-bits "
                "(the KV cache then stays in the model's dtype).") from exc

    def _new_caches(self) -> list:
        return self.base.new_caches()

    def slot_for(self, params) -> ModelSlot:
        """The model a request runs on: the one its ``model`` selected (``params.served``), else the base."""
        return params.served if params.served is not None else self.base

    def weights_nbytes(self) -> int:
        return weights_nbytes(self.model)

    def kv_bytes_per_token_estimate(self) -> float:
        """KV bytes one cached token costs in the base model (all layers), measured on a one-token forward."""
        return self.base.measure_kv()

    def kv_stats(self) -> dict:
        """The `kv_cache` block of /stats: the scheme and the measured bytes per cached token (all layers)."""
        return {"scheme": kv_scheme(self.kv_bits, self.kv_group_size), "bits": self.kv_bits,
                "group_size": self.kv_group_size if self.kv_bits else None,
                "bytes_per_token": round(self.kv_bytes_per_token, 1)}

    # -- what a request is, before it runs -------------------------------------------------
    def draft_tokens(self, params) -> int:
        """Draft tokens per step for a request. n-gram drafting (no draft model) applies to every model of the
        server whose caches can be rewound; a draft model drafts for the base model only (it shares its vocabulary)."""
        spec = self.speculation
        if spec is None:
            return 0
        slot = self.slot_for(params)
        if slot.base:
            return spec.wanted(params.num_draft_tokens)
        if spec.provider.identity is not None or not slot.trimmable:
            return 0
        return spec.wanted(params.num_draft_tokens, supported=True)

    def namespace_for(self, params) -> str:
        """The cache namespace of a request (``cache.prefix.namespace``): the model fingerprint (KV scheme included),
        plus the adapter's identity (its weights' hash) when the request selected one, plus the draft's identity when
        the request speculates with a draft that keeps KV (its entries hold the draft's layers too). Asked once per
        request, when it is submitted; the sequence carries the answer to the SSD prefetch and the lane's take/put."""
        adapter = params.adapter
        draft = self.speculation.provider.identity if self.draft_tokens(params) else None
        return namespace(self.slot_for(params).namespace, adapter=adapter.identity if adapter is not None else None,
                         draft=draft)

    def classify(self, seq: Sequence) -> None:
        """The facts the scheduler plans with (see the module docstring); set once, when the sequence arrives."""
        params = seq.params
        slot = self.slot_for(params)
        speculating = bool(self.draft_tokens(params))
        seq.group = params.adapter.identity if params.adapter is not None else None
        if not slot.base:  # one batch per model, as per adapter
            seq.group = "model:" + slot.namespace
        seq.batchable = not speculating and slot.mergeable
        if speculating and self._spec_batchable(slot):  # n-gram rows speculate together (server.engine.spec_batch)
            seq.group, seq.batchable = spec_group(seq.group), True
        seq.prefill_together = not speculating and slot.plain_kv and slot.base and params.adapter is None
        seq.window = slot.window

    def _spec_batchable(self, slot: ModelSlot) -> bool:
        """May this speculating request decode in a speculating batch? Plain KV layers (``server.engine.ragged_kv``),
        with either draft: n-gram lookup, or the draft model (each row drafts with its own draft caches; the verify is
        one forward for all rows). (Grammar requests never speculate: ``sampling_params``.)"""
        return slot.plain_kv and self.spec_in_batch

    def model_for(self, params):
        """The model that computes a request: its adapter's (base weights shared, LoRA layers on top), the model its
        name selected, or the base."""
        if params.adapter is not None:
            return params.adapter.model
        return self.slot_for(params).model

    # -- admission and prefill ----------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        params = seq.params
        slot = self.slot_for(params)
        n_draft = self.draft_tokens(params)
        seq.start_output(slot.tokenizer.detokenizer, slot.eos,
                         logprob_of=self._logprob_of(params, slot) if params.logprobs else None)
        seq.timings.admitted_at = time.monotonic()
        hit = self.prompt_cache.take(seq.prompt, seq.ns, seq.session)
        seq.cached = hit.length if hit is not None else 0
        if n_draft:  # an entry holds the target's layers, then the draft's
            target_caches, draft_caches = self.speculation.split(hit.caches if hit is not None else None)
            seq.caches = target_caches if target_caches is not None else slot.new_caches()
            seq.spec = self.speculation.open(draft_caches, seq.prompt[: seq.cached], n_draft)
        else:
            seq.caches = self._taken(slot, hit) if hit is not None else slot.new_caches()
        seq.done = seq.cached
        seq.phase = Phase.PREFILL
        seq.timings.prefill_started = time.monotonic()
        seq.grammar = params.grammar.processor() if params.grammar is not None else None
        seq.sampler = build_sampler(params)
        seq.model = self.model_for(params)
        if self.fault_hook is not None:
            self.fault_hook(seq)

    def retake(self, seq: Sequence) -> bool:
        """Before a sequence's first prefill chunk: take again when the prefix cache now holds a longer prefix than
        it had at admission (agents sent at once share a system prompt: the first one's prompt-boundary entry serves
        the others, instead of each prefilling it). True when the caches were replaced."""
        if seq.done != seq.cached or seq.done >= len(seq.prompt) - 1:
            return False
        if seq.spec is not None and self.speculation.provider.identity is not None:
            return False  # a two-model entry also holds the draft's layers: taken only at admission (split there)
        if self.prompt_cache.peek(seq.prompt, seq.ns, seq.session) <= seq.done:
            return False
        hit = self.prompt_cache.take(seq.prompt, seq.ns, seq.session)
        if hit is None or hit.length <= seq.done:
            return False
        seq.caches = self._taken(self.slot_for(seq.params), hit) if seq.spec is None else hit.caches
        seq.done, seq.cached = hit.length, hit.length
        return True

    def _taken(self, slot: ModelSlot, hit) -> list:
        """A hit's caches for a plain sequence: on the CPU path of ``models.cpu_attention`` they read the entry's
        KV where it lies (``SharedPrefixKVCache``: the first new token does not copy the whole prefix); they become
        plain ``KVCache`` again where they are stored (``_store``) or join mlx-lm's batch (``DecodeBatch``)."""
        if not slot.reads_shared_prefix:
            return hit.caches
        caches = share_prefix(hit.caches)
        if caches is not hit.caches and self.stats is not None:
            self.stats.on_hit_read_in_place()
        return caches

    def prefill(self, seq: Sequence, n: int, share: bool = False) -> bool:
        """Prefill ``n`` more prompt tokens; True once the prefill is complete (``seq.prefilled``). ``share``: other
        requests wait or prefill beside this one, so the prompt goes into the prefix cache at once (a prompt-boundary
        entry) for them to take (see ``retake``), not only when this request ends."""
        prompt = seq.prompt
        end = len(prompt) - 1
        if seq.done < end and n > 0:
            t0 = time.monotonic()
            n = min(n, end - seq.done)
            with mx.stream(self.stream):
                seq.model(mx.array(prompt[seq.done : seq.done + n])[None], cache=seq.caches)
                mx.eval([c.state for c in seq.caches])
                if self._gpu:  # as mlx-lm's batch prefill does: freed activations go back to the device (on the
                    mx.clear_cache()  # CPU that only costs page faults on the next chunk's buffers)
            seq.done += n
            dt = time.monotonic() - t0
            seq.prefill_s += dt
            seq.prefill_cost_s += dt
            seq.sink(Progress(seq.done, len(prompt)))
            if seq.done in seq.anchors and seq.done < end:
                self._store(prompt[: seq.done], seq.caches, seq, anchor=True)  # a breakpoint: an entry of its own
            if seq.done < end:
                return False
        return self._prefill_complete(seq, share)

    def prefill_together(self, items: list, share: bool = False) -> list:
        """Prefill ``[(seq, n), ...]`` (each sequence's next ``n`` prompt tokens) in one batched forward: mlx-lm's
        ``PromptProcessingBatch`` merges the rows' caches (left-padded), right-pads the chunks, rolls the padding
        away and each row's own caches are extracted after. Returns the sequences whose prefill completed (see
        ``prefill``). One forward for B prompts beats B forwards on a GPU (mlx-lm's --prompt-concurrency)."""
        t0 = time.monotonic()
        with mx.stream(self.stream):
            batch = PromptProcessingBatch(items[0][0].model, list(range(len(items))), [s.caches for s, _ in items],
                                          tokens=[[] for _ in items], prefill_step_size=max(n for _, n in items))
            batch.prompt([list(s.prompt[s.done: s.done + n]) for s, n in items])
            caches = [batch.extract_cache(i) for i in range(len(items))]
            mx.eval([c.state for row in caches for c in row])
            del batch
            if self._gpu:
                mx.clear_cache()
        dt = time.monotonic() - t0
        total = sum(n for _, n in items)
        complete = []
        for (seq, n), row in zip(items, caches):
            seq.caches, seq.done = row, seq.done + n
            seq.prefill_s += dt
            seq.prefill_cost_s += dt * n / total if total else 0.0  # this machine's rate, not B times less
            seq.sink(Progress(seq.done, len(seq.prompt)))
            if seq.done >= len(seq.prompt) - 1 and self._prefill_complete(seq, share):
                complete.append(seq)
            elif seq.done in seq.anchors:
                with mx.stream(self.stream):
                    self._store(seq.prompt[: seq.done], seq.caches, seq, anchor=True)
        return complete

    def _prefill_complete(self, seq: Sequence, share: bool) -> bool:
        """The prompt is computed (all but its last token): account, share, and mark it ready to decode."""
        if seq.prefilled:
            return True
        prompt = seq.prompt
        if seq.done > seq.cached and self.slot_for(seq.params).base:
            # feeds the SSD tier's restore-or-recompute decision, which is the base model's: another model's rate
            # (a tiny one prefills 50x faster) made it decline every write, and the rate is saved across restarts
            self.prompt_cache.observe_prefill(seq.done - seq.cached, seq.prefill_cost_s)
        if seq.spec is not None:
            with mx.stream(self.stream):
                seq.spec.source.prefill(prompt[: seq.done])
        if seq.done in seq.anchors:
            self._store(prompt[:-1], seq.caches, seq, anchor=True)
        elif not all(c.is_trimmable() for c in seq.caches) or (seq.done > seq.cached and share):
            # a prompt-boundary entry: the next turn of a sliding-window model needs it (its caches cannot be
            # trimmed back to the prompt later), and requests beside this one may share its prefix now; for
            # trimmable caches the final put supersedes it
            self._store(prompt[:-1], seq.caches, seq)
        seq.prefilled = True
        return True

    # -- decoding -----------------------------------------------------------------------------
    def batch_size(self) -> int:
        return self.batches.size()

    def batch_kv_bytes(self) -> int:
        """Bytes the decode batches' KV buffers hold now (free slots and padding included), for the memory budget."""
        return self.batches.kv_nbytes()

    def join_batch(self, group, seqs: list[Sequence]) -> None:
        """These sequences join their group's batch in one step (one merge): fresh from prefill, or migrating from
        solo decoding (their caches are trimmed back so that the last token is the batch's next input)."""
        rows = []
        # the logits rules: mlx-lm's per-row processors for its GenerationBatch; ours (for all rows at once) for the
        # ragged and speculating batches
        per_row = not (is_spec_group(group) or self._ragged_layout(seqs[0].model))
        for seq in seqs:  # a hit's shared segments go as they are: each batch kind takes them its own way
            caches, history = self._batch_entry(seq)
            opts = {"sampler": None if seq.params.temperature == 0 else seq.sampler}
            if per_row:
                opts["processors"] = build_logits_processors(seq.params, (), seq.grammar)
            else:
                opts.update(penalties=Penalties.of(seq.params), grammar=seq.grammar)
            if is_spec_group(group):
                plan = seq.spec
                if plan.policy is None:
                    plan.policy = self.speculation.policy(plan.num_draft_tokens)
                opts.update(source=plan.source, policy=plan.policy, max_draft=plan.num_draft_tokens, stats=plan.stats)
            rows.append((seq, caches, history, opts))
        self.batches.join(group, seqs[0].model, rows)  # one group, one model: the base's or one adapter's
        for seq in seqs:
            seq.phase = Phase.BATCHED

    def _batch_entry(self, seq: Sequence) -> tuple[list, list]:
        """(caches, history) for DecodeBatch.add: the caches cover history[:-1]; history[-1] is the next input."""
        caches = seq.caches
        history = list(seq.prompt) + list(seq.generated)
        if seq.decoder is not None:  # migrating from solo decoding
            extra = len(self._close_solo(seq)) - (len(history) - 1)
            if extra > 0:
                trim_prompt_cache(caches, extra)
        seq.caches = None
        return caches, history

    def step_batch(self, group) -> list:
        """One decode step of a group's batch: ``[(seq, token, logprobs), ...]`` (a speculating batch's rows may
        bring several tokens each)."""
        if is_spec_group(group):
            if self._dissolve_if_not_paying(group):
                return []  # its rows decode in their plain batch from now on (this tick, or the next one)
            rows = self.batches.step(group)
            if self.stats.spec is not None:
                self.stats.spec.on_batch_step(*self.batches.get(group).last_step)
            return rows
        n, t0 = self.batches.rows(group), time.perf_counter()
        rows = self.batches.step(group)
        self.plain_steps.observe(n, time.perf_counter() - t0)
        return rows

    def _dissolve_if_not_paying(self, group) -> bool:
        """A speculating batch whose drafts have not paid for its layout lately (``SpecBatch.not_paying``) hands its
        rows to their group's plain batch, where they decode without drafts for the rest of their reply (requests
        that arrive later speculate again, in a new speculating batch). Before a step: every row in it is live."""
        batch = self.batches.get(group)
        if batch is None or not batch.not_paying(self.plain_steps):
            return False
        seqs = list(batch.sequences)
        plain = group[1]  # spec_group(g) == (speculating, g)
        for seq, (tokens, caches) in zip(seqs, self.batches.remove(group, seqs)):
            seq.caches, seq.group = caches, plain  # the caches cover everything but the row's next input
        self.join_batch(plain, seqs)
        if self.stats.spec is not None:
            self.stats.spec.on_dissolved(len(seqs))
        log.info("a speculating batch of %d rows made too few tokens per step to pay for drafting; its rows decode "
                 "in the plain batch", len(seqs))
        return True

    def leave_rows(self, group, seqs: list[Sequence]) -> list:
        """Take rows out of their batch: ``[(tokens, caches), ...]`` covering what each computed, for ``finish``."""
        return self.batches.remove(group, seqs)

    def reset_batch(self, group) -> None:
        """A batch whose step raised: its rows were failed; start the group afresh."""
        self.batches.reset(group)
        self._repair_after_failure()

    def leave_batch(self, seq: Sequence) -> None:
        """A batch row goes on solo: its caches are trimmed to cover all but the last token of prompt + generated, so
        that the solo decoder feeds that token and samples the next."""
        (tokens, caches), = self.batches.remove(seq.group, [seq])
        history = list(seq.prompt) + list(seq.generated)
        extra = len(tokens) - (len(history) - 1)  # a plain batch's caches cover its last token; a speculating one's not
        if extra > 0:
            trim_prompt_cache(caches, extra)
        seq.caches, seq.phase = caches, Phase.SOLO
        seq.solo_base, seq.solo_gen0 = history, len(seq.generated)

    def solo_step(self, seq: Sequence):
        """(token, logprobs) of the next token of a solo sequence, or None when its decoder is exhausted."""
        with mx.stream(self.stream):
            if seq.decoder is None:
                seq.decoder = self._open_solo(seq)
                seq.steps = iter(seq.decoder)
            try:
                token, logprobs, *_ = next(seq.steps)  # speculative steps also say whether the token was drafted
            except StopIteration:
                return None
        return token, logprobs

    def _open_solo(self, seq: Sequence):
        params = seq.params
        prompt = seq.prompt
        base = seq.solo_base if seq.solo_base is not None else list(prompt)
        if seq.spec is not None:  # the caches cover base[:-1] (fresh, or back from a speculating batch)
            return speculative_decode(  # the target is the adapter's model; the draft stays the base's (or n-gram)
                seq.model, seq.caches, base[-1], seq.spec.source, sampler=seq.sampler,
                logits_processors=build_logits_processors(params, base[:-1]),
                max_tokens=params.max_tokens - seq.solo_gen0, num_draft_tokens=seq.spec.num_draft_tokens,
                stream=self.stream, policy=seq.spec.policy or self.speculation.policy(seq.spec.num_draft_tokens),
                stats=seq.spec.stats,
            )
        return PlainDecode(
            seq.model, seq.caches, base, max_tokens=params.max_tokens - seq.solo_gen0, sampler=seq.sampler,
            stream=self.stream, processors_for=lambda history: build_logits_processors(params, history, seq.grammar),
        )

    def _close_solo(self, seq: Sequence) -> list:
        """Close the solo decoder; return the tokens its caches cover (PlainDecode's account; speculative steps
        feed every token they yield)."""
        decoder = seq.decoder
        base = seq.solo_base if seq.solo_base is not None else list(seq.prompt)
        if decoder is None:  # never stepped: the caches cover all but the next input
            return base[:-1]
        if seq.steps is not decoder:
            seq.steps.close()
        decoder.close()
        seq.decoder = seq.steps = None
        g0 = seq.solo_gen0
        fed = decoder.fed_generated if isinstance(decoder, PlainDecode) else len(seq.generated) - g0
        return base + seq.generated[g0 : g0 + fed]

    # -- the end ------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason, covered: Optional[tuple[list, list]] = None) -> None:
        """Store what was computed and send ``Finished``. ``covered`` = (tokens, caches) when the batch held the
        sequence (from ``leave_rows``); otherwise the sequence's own caches are stored."""
        try:
            with mx.stream(self.stream):
                if covered is not None:
                    tokens, caches = covered
                    self._store(tokens, caches, seq)
                elif seq.caches is not None:
                    if seq.phase == Phase.PREFILL:  # cancelled during prefill
                        self._store(seq.prompt[: seq.done], seq.caches, seq)
                    else:
                        self._store(self._close_solo(seq), seq.caches, seq)
        except Exception:  # caching is an optimisation: never fail the request for it
            log.exception("storing %s failed", seq.id)
        if seq.spec is not None:
            seq.spec_stats = seq.spec.stats.as_dict()
            self.stats.on_spec(seq.spec.stats)
        finished = seq.finished(reason)
        self.stats.on_finished(finished)
        adapter = seq.params.adapter
        if adapter is not None and self.adapters is not None:
            self.adapters.on_finished(adapter.name, finished)
        served = seq.params.served
        if served is not None and getattr(served, "counters", None) is not None:  # an on-demand model's (server.pool)
            served.counters.add(finished)
        seq.sink(finished)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """The sequence's model work raised: it ends with ``Failed`` (a 500); the lane serves on."""
        if seq.decoder is not None:
            try:
                self._close_solo(seq)
            except Exception:
                log.exception("closing the decoder of %s failed", seq.id)
        seq.phase, seq.finish_reason = Phase.FINISHED, FinishReason.FAILED
        self._repair_after_failure()
        self.stats.on_failure()
        seq.sink(Failed(exc))

    @staticmethod
    def _repair_after_failure() -> None:
        """What a failed step may leave broken for the requests after it (see ``repair_random_state``)."""
        try:
            if repair_random_state():
                log.warning("a failed step left MLX's random state unusable; reseeded it")
        except Exception:
            log.exception("repairing the random state failed")

    def _logprob_of(self, params, slot: ModelSlot):
        top = params.top_logprobs
        return lambda logprobs, token: token_logprobs(logprobs, token, top, slot.decode_one)

    # -- cache ------------------------------------------------------------------------
    def _store(self, tokens: Seq[int], caches: list, seq: Sequence, anchor: bool = False) -> None:
        if not tokens:
            return
        plan = seq.spec
        if plan is not None and plan.source.caches is not None:
            plan.source.prefill(tokens)  # bring the draft's caches to exactly `tokens`
            caches = list(caches) + list(plan.source.caches)
        caches = flatten_shared(caches)  # the prefix cache holds plain KVCache layers
        covered = _covered_length(caches)
        if covered is not None and covered != len(tokens):
            log.warning("not caching %s: caches cover %d tokens, expected %d", seq.id, covered, len(tokens))
            return
        self.kv_bytes_per_token = _state_nbytes(caches) / len(tokens)
        try:
            if self.prompt_cache.put(list(tokens), caches, seq.ns, seq.session, anchor=anchor):
                seq.stored = max(seq.stored, len(tokens))
        except Exception:  # caching is an optimisation: never fail the request for it
            log.exception("prompt cache put failed")


def weights_nbytes(model) -> int:
    """Bytes of a model's parameters (what its weights hold in memory)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
