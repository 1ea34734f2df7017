"""One generation, run on the lane thread: cache take -> chunked prefill -> decode -> cache put.

Contract of ``Engine.run(job)``:
- emits ``Progress`` while prefilling, one ``Delta`` per decoded token (text already passed
  through the stop-string matcher, so a partial stop string is never emitted), and exactly
  one ``Finished`` (or ``Failed`` if an exception escaped the model);
- checks ``job.cancel`` between prefill chunks and after every decoded token;
- stores what it computed in the prompt cache, also after a cancellation, and a
  prompt-boundary snapshot before decoding when some layer's cache cannot be trimmed
  (so the next turn of a sliding-window model still hits).

Only the lane thread may call ``run``: it owns the model, the MLX stream and the caches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from server.jobs import Delta, Failed, Finished, Job, Progress
from server.sampling import build_logits_processors, build_sampler, token_logprobs
from server.decode_steps import PlainDecode
from server.speculation import SpecPlan, speculative_decode
from server.stops import StopMatcher

log = logging.getLogger("mlx_lane.engine")


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0


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
        self._eos = set(self.tokenizer.eos_token_ids or [])
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        if kv_bits is not None:
            self._check_kv_quantization()
        self.speculation = None  # server.speculation.Speculation when a draft is configured
        self.kv_bytes_per_token = 0.0  # of the last stored entry, all layers (see kv_stats)

    def bind_stream(self) -> None:
        """Create the MLX stream owned by the calling (lane) thread."""
        self.stream = mx.new_stream(mx.default_device())

    def warmup(self) -> None:
        """Page the weights in and compile kernels before the first request (lane thread)."""
        with mx.stream(self.stream):
            mx.eval(self.model.parameters())
            caches = self._new_caches()
            mx.eval(self.model(mx.array([[0, 1]]), cache=caches))

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

    def kv_stats(self) -> dict:
        """The `kv_cache` block of /stats: the scheme and the measured bytes per cached token (all layers)."""
        return {"scheme": kv_scheme(self.kv_bits, self.kv_group_size), "bits": self.kv_bits,
                "group_size": self.kv_group_size if self.kv_bits else None,
                "bytes_per_token": round(self.kv_bytes_per_token, 1)}

    # -- the job --------------------------------------------------------------------
    def run(self, job: Job) -> None:
        started = time.monotonic()
        try:
            with mx.stream(self.stream):
                finished = self._generate(job, started)
        except Exception as exc:  # the lane must survive anything a generation raises
            log.exception("generation %s failed", job.id)
            self.stats.on_failure()
            job.sink(Failed(exc))
            return
        self.stats.on_finished(finished)
        job.sink(finished)

    def _generate(self, job: Job, started: float) -> Finished:
        prompt = job.prompt
        spec = self.speculation
        n_draft = spec.wanted(job.params.num_draft_tokens) if spec is not None else 0
        ns = spec.namespace(self.namespace, True) if n_draft else self.namespace
        hit = self.prompt_cache.take(prompt, ns, job.session)
        cached = hit.length if hit is not None else 0
        plan = None
        if n_draft:  # an entry holds the target's layers, then the draft's
            target_caches, draft_caches = spec.split(hit.caches if hit is not None else None)
            caches = target_caches if target_caches is not None else self._new_caches()
            plan = spec.open(draft_caches, prompt[:cached], n_draft)
        else:
            caches = hit.caches if hit is not None else self._new_caches()
        if self.fault_hook is not None:
            self.fault_hook(job)

        t0 = time.monotonic()
        done = self._prefill(prompt, cached, caches, job)
        if done > cached:  # feeds the restore-or-recompute decision of the SSD tier
            self.prompt_cache.observe_prefill(done - cached, time.monotonic() - t0)
        if plan is not None:
            plan.source.prefill(prompt[:done])
        if done < len(prompt) - 1:  # cancelled during prefill
            self._store(prompt[:done], caches, job, ns, plan)
            return self._finish(job, "cancelled", 0, cached, started, Timings())
        if not all(c.is_trimmable() for c in caches):
            self._store(prompt[:-1], caches, job, ns, plan)  # prompt-boundary snapshot

        generated, fed, reason, timings = self._decode(job, caches, t0, plan)
        timings.prefill_tokens = len(prompt) - cached
        self._store(prompt + generated[:fed], caches, job, ns, plan)
        finished = self._finish(job, reason, len(generated), cached, started, timings)
        if plan is not None:
            self.stats.on_spec(plan.stats)
            finished = dataclasses.replace(finished, spec=plan.stats.as_dict())
        return finished

    def _prefill(self, prompt: Sequence[int], start: int, caches: list, job: Job) -> int:
        """Feed prompt[start:-1] in chunks; return how many prompt tokens the caches cover."""
        end = len(prompt) - 1
        pos = start
        while pos < end:
            if job.cancel.is_set():
                return pos
            n = min(self.prefill_chunk, end - pos)
            self.model(mx.array(prompt[pos : pos + n])[None], cache=caches)
            mx.eval([c.state for c in caches])
            pos += n
            job.sink(Progress(pos, len(prompt)))
        return pos

    def _decode(self, job: Job, caches: list, t0: float, plan: SpecPlan | None = None):
        params = job.params
        prompt = job.prompt
        if params.seed is not None:
            mx.random.seed(params.seed % (2**64))
        detok = self.tokenizer.detokenizer
        detok.reset()
        stops = StopMatcher(list(params.stop))
        generated: list[int] = []
        reason = "length"
        timings = Timings()
        t_first = None
        sampler = build_sampler(params)
        grammar = params.grammar.processor() if params.grammar is not None else None  # ONE per request (stateful)
        if plan is not None:
            steps = speculative_decode(
                self.model, caches, prompt[-1], plan.source, sampler=sampler,
                logits_processors=build_logits_processors(params, prompt[:-1]),
                max_tokens=params.max_tokens, num_draft_tokens=plan.num_draft_tokens, stream=self.stream,
                policy=self.speculation.policy(plan.num_draft_tokens), stats=plan.stats,
            )
        else:
            steps = PlainDecode(
                self.model, caches, prompt, max_tokens=params.max_tokens, sampler=sampler, stream=self.stream,
                processors_for=lambda history: build_logits_processors(params, history, grammar),
            )
        try:
            for token, logprobs, *_ in steps:  # speculative steps also say whether the token was drafted
                now = time.monotonic()
                if t_first is None:
                    t_first = now
                    timings.prefill_s = now - t0
                generated.append(token)
                if token in self._eos:
                    reason = "stop"
                    break
                detok.add_token(token)
                text = stops.feed(detok.last_segment)
                lp = ()
                if params.logprobs:
                    lp = (token_logprobs(logprobs, token, params.top_logprobs, self._decode_one),)
                job.sink(Delta(text, lp, first_token=len(generated) == 1))
                if stops.stopped:
                    reason = "stop"
                    break
                if job.cancel.is_set():
                    reason = "cancelled"
                    break
            else:
                detok.finalize()
                tail = stops.feed(detok.last_segment) + stops.flush()
                if tail:
                    job.sink(Delta(tail))
        finally:
            steps.close()
        if reason == "stop" and not stops.stopped:  # EOS: release held-back text
            detok.finalize()
            tail = stops.feed(detok.last_segment) + stops.flush()
            if tail:
                job.sink(Delta(tail))
        if t_first is not None:
            timings.decode_tokens = max(0, len(generated) - 1)
            timings.decode_s = time.monotonic() - t_first
        # the caches cover prompt + generated[:fed] (see PlainDecode; speculative steps feed every token)
        fed = steps.fed_generated if isinstance(steps, PlainDecode) else len(generated)
        return generated, fed, reason, timings

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    # -- cache ------------------------------------------------------------------------
    def _store(self, tokens: Sequence[int], caches: list, job: Job, ns: str, plan: SpecPlan | None = None) -> None:
        if not tokens:
            return
        if plan is not None and plan.source.caches is not None:
            plan.source.prefill(tokens)  # bring the draft's caches to exactly `tokens`
            caches = list(caches) + list(plan.source.caches)
        covered = _covered_length(caches)
        if covered is not None and covered != len(tokens):
            log.warning("not caching %s: caches cover %d tokens, expected %d", job.id, covered, len(tokens))
            return
        self.kv_bytes_per_token = _state_nbytes(caches) / len(tokens)
        try:
            self.prompt_cache.put(list(tokens), caches, ns, job.session)
        except Exception:  # caching is an optimisation: never fail the request for it
            log.exception("prompt cache put failed")

    def _finish(self, job, reason, n_generated, cached, started, timings: Timings) -> Finished:
        return Finished(
            finish_reason=reason,
            prompt_tokens=len(job.prompt),
            completion_tokens=n_generated,
            cached_tokens=cached,
            prefill_tokens=timings.prefill_tokens,
            prefill_s=timings.prefill_s,
            decode_tokens=timings.decode_tokens,
            decode_s=timings.decode_s,
            queued_s=started - job.enqueued_at,
        )


# -- KV-cache quantization (issue 8) ----------------------------------------------------------------------------
# With kv_bits set, every plain KVCache layer is a QuantizedKVCache (mlx-lm) from the FIRST prompt token: prefill,
# decode, a RAM hit and an SSD restore all attend over the same quantized keys/values (each token's K/V is quantized
# on its own, along head_dim), so a cache hit computes what a cold request computes. Converting after prefill
# instead would give cold requests float attention over the prompt and hits quantized attention over the prefix.
# Other cache classes (RotatingKVCache, ArraysCache) stay as they are; mlx-lm cannot quantize them. The scheme is
# part of the namespace (kv_namespace), so an entry of one scheme never seeds another, in RAM or on SSD.


def kv_scheme(kv_bits: int | None, kv_group_size: int = 64) -> str:
    return "float" if kv_bits is None else f"q{kv_bits}g{kv_group_size}"


def kv_namespace(fingerprint: str, kv_bits: int | None, kv_group_size: int = 64) -> str:
    """The model fingerprint itself for float KV; else a hex digest of (fingerprint, KV scheme)."""
    if kv_bits is None:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}\0kv\0{kv_scheme(kv_bits, kv_group_size)}".encode()).hexdigest()


def _state_nbytes(caches: list) -> int:
    """Bytes the caches hold for their tokens (KV buffers are allocated in steps of 256 tokens; the padding past
    `offset` on the token axis is not counted)."""
    from mlx.utils import tree_flatten

    total = 0
    for c in caches:
        n = getattr(c, "offset", None)
        for _, x in tree_flatten(c.state):
            if not isinstance(x, mx.array):
                continue
            if x.ndim == 4 and isinstance(n, int) and 0 < n < x.shape[2]:
                total += x.nbytes // x.shape[2] * n
            else:
                total += x.nbytes
    return total


def _quantize_fresh(caches: list, bits: int, group_size: int) -> list:
    return [QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in caches]


def _covered_length(caches: list) -> int | None:
    offsets = {getattr(c, "offset", None) for c in caches}
    offsets.discard(None)
    return offsets.pop() if len(offsets) == 1 else None
