"""What the lane does to one sequence with the model: admit (cache take), prefill a chunk, decode solo, store.

(About 475 lines, one job: the model verbs of one sequence. Batched prefill, solo decode and the store share the
Active state and the MLX stream; the KV layout, batch, speculation and sampling already live in their own modules.)

The lane (server.lane) runs many sequences at once; this module holds the per-sequence model work, the decode
batch lives in server.batch, the policy in server.scheduler. Contract of the verbs (lane thread only: they own the
model, the MLX stream and the caches):

- ``admit(job) -> Active``: the prefix-cache ``take`` (namespace from ``namespace_for``, the one place that decides
  it), the request's sampler / processors / speculative plan, a ``Sequence`` in state PREFILL.
- ``prefill_step(a) -> bool``: one chunk of ``prompt[done:-1]`` (at most ``prefill_chunk`` tokens), a ``Progress``
  event; True once the caches cover ``prompt[:-1]`` (then a prompt-boundary snapshot is stored when some layer's
  cache cannot be trimmed, so the next turn of a sliding-window model still hits).
- ``solo_step(a)``: one token of a sequence decoding on its own (a speculative one, one whose caches cannot join a
  batch, or the only running sequence: plain ``generate_step`` is faster than a batch of one).
- ``batch_entry(a) -> (caches, history)``: hand a sequence's caches to the batch (from prefill, or migrating from
  solo decoding: the caches are trimmed back so that ``history[-1]`` is the next input).
- ``finish(a, reason, covered=None)``: store what was computed (also after a cancellation), send ``Finished``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import KVCache, make_prompt_cache

from server.batch import DecodeBatch, can_batch
from server.decode_steps import PlainDecode
from server.jobs import Failed, Job, Progress
from server.kv_layout import _covered_length, _quantize_fresh, _state_nbytes, adapter_namespace, kv_scheme
from server.sampling import build_logits_processors, build_sampler, token_logprobs
from server.sequence import SeqState, Sequence
from server.speculation import SpecPlan, speculative_decode

log = logging.getLogger("mlx_lane.engine")


@dataclass(eq=False)
class Active:
    """A sequence's model-side state while the lane runs it."""

    seq: Sequence
    ns: str
    caches: Optional[list]  # own caches while prefilling / solo; None while the batch holds them
    done: int  # prompt tokens the caches cover (during prefill)
    plan: Optional[SpecPlan] = None
    decoder: Optional[object] = None  # the solo decoder (PlainDecode or a speculative generator)
    steps: Optional[object] = None  # its iterator
    in_batch: bool = False
    prefill_s: float = 0.0
    sampler: Optional[object] = None  # built once: a seeded sampler's key chain goes on across solo <-> batch moves
    solo_base: Optional[list] = None  # the history the solo decoder was opened with (None: the prompt)
    solo_gen0: int = 0  # generated tokens already in solo_base
    grammar: Optional[object] = None  # the request's ONE grammar processor (stateful: one call per sampled token)
    model: Optional[object] = None  # what computes this sequence: the base model, or its adapter's model

    @property
    def adapter(self):
        """The request's adapter (models.adapters.Adapter) or None for the base model."""
        return self.seq.job.params.adapter

    @property
    def job(self) -> Job:
        return self.seq.job


class Engine:
    """Binds a loaded model to a prompt cache and the lane's MLX stream."""

    def __init__(self, loaded, prompt_cache, stats, *, prefill_chunk: int = 512, kv_bits: int | None = None,
                 kv_group_size: int = 64):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.namespace = loaded.fingerprint
        self.prompt_cache = prompt_cache
        self.stats = stats
        self.prefill_chunk = prefill_chunk
        self.stream = None  # created on the lane thread by bind_stream()
        self.fault_hook = None  # tests may set a callable(job) that raises inside a generation
        self._eos = frozenset(self.tokenizer.eos_token_ids or [])
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        if kv_bits is not None:
            self._check_kv_quantization()
        self.speculation = None  # server.speculation.Speculation when a draft is configured
        self.adapters = None  # server.adapters.AdapterRegistry: per-adapter counters (set by server.serve)
        self.kv_bytes_per_token = 0.0  # of the last stored entry, all layers (see kv_stats)
        self._gpu = mx.default_device() != mx.cpu

    def bind_stream(self, as_default: bool = False) -> None:
        """Create the MLX stream owned by the calling (lane) thread. ``as_default``: make it the thread's default
        stream too, so that work issued without a stream (the decode batch's step) runs on it as well: a model
        sharded over processes needs every forward, and so every collective, on one stream, in one order."""
        self.stream = mx.new_stream(mx.default_device())
        if as_default:
            mx.set_default_stream(self.stream)

    def task_context(self):
        """What a lane task (server.lane.Lane.call) runs under: the lane's MLX stream."""
        return mx.stream(self.stream)

    def warmup(self) -> None:
        """Page the weights in and compile kernels before the first request (lane thread): a prefill, one-token
        steps over a cache, a batched step of two rows and (GPU) a batched prefill of two padded rows, so the first
        request pays none of it. On a GPU the
        prefill is a whole --prefill-chunk (MLX compiles a kernel per shape: the first 2048-token chunk of a
        cold process cost 1.5-2x a warm one on the H200); on the CPU, where nothing is compiled, 8 tokens do."""
        gpu = mx.default_device() != mx.cpu
        with mx.stream(self.stream):
            mx.eval(self.model.parameters())
            caches = self._new_caches()
            n = self.prefill_chunk if gpu else 8
            mx.eval(self.model(mx.array([[(i % 1000) + 1 for i in range(n)]]), cache=caches))
            for _ in range(4 if gpu else 1):
                mx.eval(self.model(mx.array([[1]]), cache=caches))
            if can_batch(caches):
                batch = DecodeBatch(self.model)
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

    # -- KV-cache quantization (issue 8; see kv_namespace below) ------------------------
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
        caches = make_prompt_cache(self.model)
        return caches if self.kv_bits is None else _quantize_fresh(caches, self.kv_bits, self.kv_group_size)

    def weights_nbytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def kv_bytes_per_token_estimate(self) -> float:
        """KV bytes one cached token costs in this model (all layers), measured on a one-token forward."""
        caches = self._new_caches()
        mx.eval(self.model(mx.array([[1]]), cache=caches))
        return float(_state_nbytes(caches))

    def kv_stats(self) -> dict:
        """The `kv_cache` block of /stats: the scheme and the measured bytes per cached token (all layers)."""
        return {"scheme": kv_scheme(self.kv_bits, self.kv_group_size), "bits": self.kv_bits,
                "group_size": self.kv_group_size if self.kv_bits else None,
                "bytes_per_token": round(self.kv_bytes_per_token, 1)}

    # -- namespace: the one place that decides it --------------------------------------
    def draft_tokens(self, params) -> int:
        spec = self.speculation
        return spec.wanted(params.num_draft_tokens) if spec is not None else 0

    def namespace_for(self, params) -> str:
        """The cache namespace of a request: the model fingerprint (KV scheme included), plus the adapter's identity
        (its weights' hash: server.kv_layout.adapter_namespace) when the request selected one, plus the draft's
        identity when the request speculates with a draft that keeps KV (its entries hold the draft's layers too).
        Used by the lane's take/put and by the handler's SSD prefetch alike."""
        adapter = params.adapter
        ns = self.namespace if adapter is None else adapter_namespace(self.namespace, adapter.identity)
        if self.draft_tokens(params):
            return self.speculation.namespace(ns, True)
        return ns

    def model_for(self, params):
        """The model that computes a request: its adapter's (base weights shared, LoRA layers on top) or the base."""
        return self.model if params.adapter is None else params.adapter.model

    # -- the verbs ----------------------------------------------------------------------
    def admit(self, job: Job) -> Active:
        prompt = job.prompt
        params = job.params
        n_draft = self.draft_tokens(params)
        ns = self.namespace_for(params)
        seq = Sequence(job, self.tokenizer.detokenizer, self._eos,
                       logprob_of=self._logprob_of(params) if params.logprobs else None)
        seq.timings.admitted_at = time.monotonic()
        hit = self.prompt_cache.take(prompt, ns, job.session)
        seq.cached = hit.length if hit is not None else 0
        plan = None
        if n_draft:  # an entry holds the target's layers, then the draft's
            target_caches, draft_caches = self.speculation.split(hit.caches if hit is not None else None)
            caches = target_caches if target_caches is not None else self._new_caches()
            plan = self.speculation.open(draft_caches, prompt[: seq.cached], n_draft)
        else:
            caches = hit.caches if hit is not None else self._new_caches()
        seq.state = SeqState.PREFILL
        seq.timings.prefill_started = time.monotonic()
        grammar = params.grammar.processor() if params.grammar is not None else None
        active = Active(seq, ns, caches, seq.cached, plan, sampler=build_sampler(params), grammar=grammar,
                        model=self.model_for(params))
        if self.fault_hook is not None:
            self.fault_hook(job)
        return active

    def prefill_left(self, a: Active) -> int:
        """Prompt tokens still to prefill (the last prompt token is the first decode step's input)."""
        return max(0, len(a.seq.prompt) - 1 - a.done)

    def prefill_step(self, a: Active, n: Optional[int] = None, share=lambda: False) -> bool:
        """Prefill ``n`` more prompt tokens (default: one chunk); True once the prefill is complete. ``share()``
        (asked when the prefill completes): other requests wait or prefill beside this one, so the prompt goes into
        the prefix cache at once (a prompt-boundary entry) for them to take (see ``retake``), not only when this
        request ends."""
        prompt = a.seq.prompt
        end = len(prompt) - 1
        n = self.prefill_chunk if n is None else n
        if a.done < end and n > 0:
            t0 = time.monotonic()
            n = min(n, end - a.done)
            with mx.stream(self.stream):
                a.model(mx.array(prompt[a.done : a.done + n])[None], cache=a.caches)
                mx.eval([c.state for c in a.caches])
                if self._gpu:  # as mlx-lm's batch prefill does: freed activations go back to the device (on the
                    mx.clear_cache()  # CPU that only costs page faults on the next chunk's buffers)
            a.done += n
            a.prefill_s += time.monotonic() - t0
            a.job.sink(Progress(a.done, len(prompt)))
            if a.done < end:
                return False
        return self._prefill_complete(a, share)

    def prefills_together(self, a: Active, n: int) -> bool:
        """May this chunk join a batched prefill (``prefill_together``)? Plain KVCache layers (mlx-lm's batch
        prefill pads and rolls them), no speculation plan (its draft prefills on its own), and a cached prefix no
        longer than the chunk (the batch copies each row's prefix in and out: worth it for new prompts, not for a
        long cache hit). Base-model rows only: an adapter's rows prefill one by one under their own model."""
        return (n > 0 and a.plan is None and a.caches is not None and a.model is self.model
                and all(type(c) is KVCache for c in a.caches) and a.done <= self.prefill_chunk)

    def prefill_together(self, items: list, share=lambda: False) -> list:
        """Prefill ``[(a, n), ...]`` (each ``a``'s next ``n`` prompt tokens) in one batched forward: mlx-lm's
        ``PromptProcessingBatch`` merges the rows' caches (left-padded), right-pads the chunks, rolls the padding
        away and each row's own caches are extracted after. Returns the sequences whose prefill completed (see
        ``prefill_step``). One forward for B prompts beats B forwards on a GPU (mlx-lm's --prompt-concurrency)."""
        t0 = time.monotonic()
        with mx.stream(self.stream):
            batch = PromptProcessingBatch(self.model, list(range(len(items))), [a.caches for a, _ in items],
                                          tokens=[[] for _ in items], prefill_step_size=max(n for _, n in items))
            batch.prompt([list(a.seq.prompt[a.done: a.done + n]) for a, n in items])
            caches = [batch.extract_cache(i) for i in range(len(items))]
            mx.eval([c.state for row in caches for c in row])
            del batch
            if self._gpu:
                mx.clear_cache()
        dt = time.monotonic() - t0
        complete = []
        for (a, n), row in zip(items, caches):
            a.caches, a.done = row, a.done + n
            a.prefill_s += dt
            a.job.sink(Progress(a.done, len(a.seq.prompt)))
            if a.done >= len(a.seq.prompt) - 1 and self._prefill_complete(a, share):
                complete.append(a)
        return complete

    def _prefill_complete(self, a: Active, share) -> bool:
        """The prompt is computed (all but its last token): account, share, and move on to decoding."""
        prompt = a.seq.prompt
        if a.done > a.seq.cached:  # feeds the restore-or-recompute decision of the SSD tier
            self.prompt_cache.observe_prefill(a.done - a.seq.cached, a.prefill_s)
        if a.plan is not None:
            with mx.stream(self.stream):
                a.plan.source.prefill(prompt[: a.done])
        if not all(c.is_trimmable() for c in a.caches) or (a.done > a.seq.cached and share()):
            # a prompt-boundary entry: the next turn of a sliding-window model needs it (its caches cannot be
            # trimmed back to the prompt later), and requests beside this one may share its prefix now; for
            # trimmable caches the final put supersedes it
            self._store(prompt[:-1], a.caches, a, snapshot=True)
        a.seq.state = SeqState.DECODE
        return True

    def retake(self, a: Active) -> bool:
        """Before a sequence's first prefill chunk: take again when the prefix cache now holds a longer prefix
        than it had at admission (agents sent at once share a system prompt: the first one's prompt-boundary
        entry serves the others, instead of each prefilling it). True when the caches were replaced."""
        if a.plan is not None or a.done != a.seq.cached or a.done >= len(a.seq.prompt) - 1:
            return False
        peek = getattr(self.prompt_cache, "peek", None)
        if peek is None or peek(a.seq.prompt, a.ns, a.job.session) <= a.done:
            return False
        hit = self.prompt_cache.take(a.seq.prompt, a.ns, a.job.session)
        if hit is None or hit.length <= a.done:
            return False
        a.caches, a.done, a.seq.cached = hit.caches, hit.length, hit.length
        return True

    def new_batch(self, a: Optional[Active] = None) -> DecodeBatch:
        """A decode batch for the base model, or for the adapter group of ``a`` (see ``batch_key``)."""
        return DecodeBatch(self.model if a is None else a.model, clear_cache=self._gpu)

    def batch_key(self, a: Active):
        """Which decode batch a sequence joins: one per adapter (None: the base model). Rows of one batch share
        one forward, so they must share the model; adapter groups are stepped one after the other each tick
        (server.lane), none waits for another to drain."""
        adapter = a.adapter
        return None if adapter is None else adapter.identity

    def batchable(self, a: Active) -> bool:
        return a.plan is None and can_batch(a.caches if a.caches is not None else [])

    def row_sampler(self, a: Active):
        """The sampler of a batch row; None for greedy (the batch samples all greedy rows in one argmax)."""
        return None if a.job.params.temperature == 0 else a.sampler

    def batch_processors(self, a: Active) -> list:
        """Per-row logits processors for the batch: the batch hands each the row's whole token history."""
        return build_logits_processors(a.job.params, (), a.grammar)

    def solo_step(self, a: Active):
        """(token, logprobs) of the next token of a solo sequence, or None when its decoder is exhausted."""
        with mx.stream(self.stream):
            if a.decoder is None:
                a.decoder = self._open_solo(a)
                a.steps = iter(a.decoder)
            try:
                token, logprobs, *_ = next(a.steps)  # speculative steps also say whether the token was drafted
            except StopIteration:
                return None
        return token, logprobs

    def _open_solo(self, a: Active):
        params = a.job.params
        prompt = a.seq.prompt
        sampler = a.sampler
        if a.plan is not None:
            return speculative_decode(  # the target is the adapter's model; the draft stays the base's (or n-gram)
                a.model, a.caches, prompt[-1], a.plan.source, sampler=sampler,
                logits_processors=build_logits_processors(params, prompt[:-1]),
                max_tokens=params.max_tokens, num_draft_tokens=a.plan.num_draft_tokens, stream=self.stream,
                policy=self.speculation.policy(a.plan.num_draft_tokens), stats=a.plan.stats,
            )
        base = a.solo_base if a.solo_base is not None else list(prompt)
        return PlainDecode(
            a.model, a.caches, base, max_tokens=params.max_tokens - a.solo_gen0, sampler=sampler,
            stream=self.stream, processors_for=lambda history: build_logits_processors(params, history, a.grammar),
        )

    def _close_solo(self, a: Active) -> list:
        """Close the solo decoder; return the tokens its caches cover (PlainDecode's account; speculative steps
        feed every token they yield)."""
        decoder = a.decoder
        base = a.solo_base if a.solo_base is not None else list(a.seq.prompt)
        if decoder is None:
            return base
        if a.steps is not decoder:
            a.steps.close()
        decoder.close()
        a.decoder = a.steps = None
        g0 = a.solo_gen0
        fed = decoder.fed_generated if isinstance(decoder, PlainDecode) else len(a.seq.generated) - g0
        return base + a.seq.generated[g0 : g0 + fed]

    def resume_solo(self, a: Active, tokens: list, caches: list) -> None:
        """A batch row goes on solo: ``caches`` cover ``tokens`` (prompt + every generated token); trimmed by one,
        so that the solo decoder feeds the last generated token and samples the next."""
        from mlx_lm.models.cache import trim_prompt_cache

        trim_prompt_cache(caches, 1)
        a.caches, a.in_batch = caches, False
        a.solo_base, a.solo_gen0 = list(tokens), len(a.seq.generated)

    def batch_entry(self, a: Active) -> tuple[list, list]:
        """(caches, history) for DecodeBatch.add: the caches cover history[:-1]; history[-1] is the next input."""
        caches = a.caches
        history = list(a.seq.prompt) + list(a.seq.generated)
        if a.decoder is not None:  # migrating from solo decoding
            extra = len(self._close_solo(a)) - (len(history) - 1)
            if extra > 0:
                from mlx_lm.models.cache import trim_prompt_cache

                trim_prompt_cache(caches, extra)
        a.caches = None
        a.in_batch = True
        return caches, history

    def can_migrate(self, a: Active) -> bool:
        """A decoding sequence may move between solo and the batch when its caches can be trimmed back by the one
        token the pipelined decoder fed ahead, and it has no grammar: the move recomputes that token's logits, and
        a grammar processor must see each sampled token exactly once."""
        return (a.grammar is None and self.batchable(a)
                and all(c.is_trimmable() for c in (a.caches if a.caches is not None else [])))

    def finish(self, a: Active, reason: str, covered: Optional[tuple[list, list]] = None) -> None:
        """Store what was computed and send ``Finished``. ``covered`` = (tokens, caches) when the batch held the
        sequence (from DecodeBatch.remove); otherwise the sequence's own caches are stored."""
        seq = a.seq
        try:
            with mx.stream(self.stream):
                if covered is not None:
                    tokens, caches = covered
                    self._store(tokens, caches, a)
                elif a.caches is not None:
                    if seq.state == SeqState.PREFILL:  # cancelled during prefill
                        self._store(seq.prompt[: a.done], a.caches, a)
                    else:
                        self._store(self._close_solo(a), a.caches, a)
        except Exception:  # caching is an optimisation: never fail the request for it
            log.exception("storing %s failed", a.job.id)
        if a.plan is not None:
            seq.spec = a.plan.stats.as_dict()
            self.stats.on_spec(a.plan.stats)
        finished = seq.finished(reason)
        self.stats.on_finished(finished)
        if a.adapter is not None and self.adapters is not None:
            self.adapters.on_finished(a.adapter.name, finished)
        a.job.sink(finished)

    def fail(self, a: Active, exc: BaseException) -> None:
        """The sequence's model work raised: it ends with ``Failed`` (a 500); the lane serves on."""
        if a.decoder is not None:
            try:
                self._close_solo(a)
            except Exception:
                log.exception("closing the decoder of %s failed", a.job.id)
        a.seq.state = SeqState.FINISHED
        self.fail_job(a.job, exc)

    def fail_job(self, job: Job, exc: BaseException) -> None:
        self.stats.on_failure()
        job.sink(Failed(exc))

    def _logprob_of(self, params):
        top = params.top_logprobs
        return lambda logprobs, token: token_logprobs(logprobs, token, top, self._decode_one)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    # -- cache ------------------------------------------------------------------------
    def _store(self, tokens: Seq[int], caches: list, a: Active, snapshot: bool = False) -> None:
        if not tokens:
            return
        plan = a.plan
        if plan is not None and plan.source.caches is not None:
            plan.source.prefill(tokens)  # bring the draft's caches to exactly `tokens`
            caches = list(caches) + list(plan.source.caches)
        covered = _covered_length(caches)
        if covered is not None and covered != len(tokens):
            log.warning("not caching %s: caches cover %d tokens, expected %d", a.job.id, covered, len(tokens))
            return
        self.kv_bytes_per_token = _state_nbytes(caches) / len(tokens)
        try:
            self.prompt_cache.put(list(tokens), caches, a.ns, a.job.session)
        except Exception:  # caching is an optimisation: never fail the request for it
            log.exception("prompt cache put failed")
