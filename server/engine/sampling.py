"""Samplers for a request, built from mlx-lm's own factories (the logits rules are server.engine.batch.rules), the
batch's one-call-per-sampler draw, and a token's log-probabilities as the API reports them."""

from __future__ import annotations

import functools
import os
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from server.lane.events import SamplingParams, TokenLogprob

# Penalties look this many tokens back (mlx-lm's default window is 20).
PENALTY_CONTEXT = 64


def repair_random_state() -> bool:
    """Give MLX's global random state a fresh seed when a failed step left it unusable; True when it did.

    mlx-lm's sampler is compiled with ``mx.random.state`` as an input and an output: when anything inside the
    compiled call raises (a filter refusing its argument, an out-of-memory), the state is left as an array without
    a primitive, and every later sampled request of the process failed with "[eval] Attempting to eval an array
    without a primitive" (greedy ones did not). A request with a ``seed`` samples from its own key, not from this
    state, so its text stays reproducible. Lane thread, after a failure."""
    try:
        mx.eval(mx.random.state)
        return False
    except (RuntimeError, ValueError):
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        return True


def build_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for the request; with a ``seed``, the same filters but a random key of the request's own
    (split once per token), so the text depends on the seed alone, not on what else the batch is sampling.

    Without a seed, requests with the same settings get the SAME sampler object: it holds no state of its own (it
    draws from MLX's global random state), and a batch whose rows share one samples them all in one call
    (``sample_rows``; mlx-lm's GenerationBatch does the same when every row's sampler is one object)."""
    top_p = params.top_p if params.top_p < 1.0 else 0.0
    if params.seed is None or params.temperature == 0:
        return _shared_sampler(float(params.temperature), float(top_p), float(params.min_p), int(params.top_k))
    return _seeded_sampler(params.temperature, top_p, params.min_p, params.top_k, params.seed)


@functools.lru_cache(maxsize=256)  # bounded: a client sweeping temperatures must not grow it without end
def _shared_sampler(temp: float, top_p: float, min_p: float, top_k: int) -> Callable[[mx.array], mx.array]:
    return make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)


def sample_rows(logprobs: mx.array, samplers: Sequence[Callable[[mx.array], mx.array]]) -> mx.array:
    """The next token of every row of ``logprobs`` (rows, vocab), row e drawn by ``samplers[e]``: one call per
    distinct sampler object over all of its rows, instead of one call per row.

    The same tokens as calling each row's sampler alone wherever a sampler serves one row (a seeded request's, with
    its own key) or is deterministic (greedy, whose rows all share ``greedy_sampler``); rows that share an unseeded
    sampler are drawn together from MLX's global random state, the same distribution as drawn one by one."""
    first = samplers[0]
    if all(s is first for s in samplers):
        return first(logprobs)
    groups: dict[int, tuple[Callable, list[int]]] = {}
    for e, s in enumerate(samplers):
        groups.setdefault(id(s), (s, []))[1].append(e)
    parts, order = [], []
    for s, rows in groups.values():
        parts.append(s(logprobs[rows[0]: rows[0] + 1] if len(rows) == 1 else logprobs[mx.array(rows)]))
        order += rows
    return mx.concatenate(parts, axis=0)[mx.argsort(mx.array(order))]  # back in row order


def _seeded_sampler(temp: float, top_p: float, min_p: float, top_k: int, seed: int):
    filters = []  # the order of mlx-lm's make_sampler
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p, 1))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    key = mx.random.key(seed % (2**64))

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def token_logprobs(
    logprobs: mx.array, token: int, top_n: int, decode: Callable[[int], str]
) -> TokenLogprob:
    """The chosen token's log-probability and the ``top_n`` most likely alternatives."""
    chosen = logprobs[token].item()
    top: list[tuple[str, float, list[int]]] = []
    if top_n > 0:
        idx = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        vals = logprobs[idx]
        order = mx.argsort(-vals)
        for i, v in zip(idx[order].tolist(), vals[order].tolist()):
            text = decode(i)
            top.append((text, float(v), list(text.encode("utf-8"))))
    text = decode(token)
    return TokenLogprob(token=text, logprob=float(chosen), bytes=list(text.encode("utf-8")), top=top)
