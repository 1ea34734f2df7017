"""Sampler and logits processors for a request, built from mlx-lm's own factories."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from server.jobs import SamplingParams, TokenLogprob

# Penalties look this many tokens back (mlx-lm's default window is 20).
PENALTY_CONTEXT = 64


def build_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    return make_sampler(
        temp=params.temperature,
        top_p=params.top_p if params.top_p < 1.0 else 0.0,
        min_p=params.min_p,
        top_k=params.top_k,
    )


def build_logits_processors(params: SamplingParams, history: Sequence[int], grammar=None) -> list:
    """Processors that see the whole token history, not only what the decode loop fed.

    The lane prefills the prompt itself and hands mlx-lm's ``generate_step`` only the last
    prompt token, so processors are wrapped to prepend the tail of the prompt.
    ``grammar`` (the request's ONE ``params.grammar.processor()``, stateful) goes last, unwrapped: it only reads
    ``tokens[-1]``, and masking after bias/penalties keeps its -inf final.
    """
    tail = [grammar] if grammar is not None else []
    processors = make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=PENALTY_CONTEXT,
    )
    if not processors or not history:
        return processors + tail
    prefix = mx.array(list(history[-PENALTY_CONTEXT:]), dtype=mx.uint32)

    def with_history(proc):
        def wrapped(tokens, logits):
            return proc(mx.concatenate([prefix, tokens.astype(mx.uint32)]), logits)

        return wrapped

    return [with_history(p) for p in processors] + tail


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
