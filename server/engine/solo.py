"""Plain (non-speculative) decode steps for the lane, on top of mlx-lm's ``generate_step``.

mlx-lm's ``generate_step`` pipelines every forward with the next one (``async_eval``). On a
CPU the first token then arrives only after *two* forward passes: for a prefix-cache hit
with one new token that is 2x the time-to-first-token it could be. ``PlainDecode`` computes
the first token alone, hands it out at once, and then continues with ``generate_step`` fed
that token, so the rest of the stream keeps mlx-lm's pipelining.

Cache contract: after the iteration ends or is closed, the caches cover the prompt plus the
first ``fed_generated`` yielded tokens: all of them once the pipeline started, none when the
request ended on its first token (feeding it would cost a forward nobody needs).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step


class PlainDecode:
    def __init__(self, model, caches: list, prompt: Sequence[int], *, max_tokens: int, sampler,
                 processors_for: Callable[[Sequence[int]], list], stream):
        self.model = model
        self.caches = caches
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.processors_for = processors_for  # history -> logits processors that see it
        self.stream = stream
        self.fed_generated = 0
        self._rest = None
        self._yielded = 0

    def __iter__(self) -> Iterator[tuple[int, mx.array]]:
        if self.max_tokens <= 0:
            return
        first, logprobs = self._first_token()
        self._yielded = 1
        yield first, logprobs
        if self.max_tokens == 1:
            return
        self._rest = generate_step(
            mx.array([first]), self.model, self.stream, max_tokens=self.max_tokens - 1,
            sampler=self.sampler, logits_processors=self.processors_for(list(self.prompt)),
            prompt_cache=self.caches,
        )
        for token, lp in self._rest:
            self._yielded += 1
            self.fed_generated = self._yielded  # generate_step feeds each token before yielding it
            yield token, lp
        self.fed_generated = self._yielded

    def _first_token(self) -> tuple[int, mx.array]:
        last = mx.array(self.prompt[-1:])
        logits = self.model(last[None], cache=self.caches)[:, -1, :]
        for proc in self.processors_for(list(self.prompt[:-1])):
            logits = proc(last, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token = self.sampler(logprobs)
        mx.eval(token, logprobs)
        return token.item(), logprobs.squeeze(0)

    def close(self) -> None:
        if self._rest is not None:
            self._rest.close()
            self.fed_generated = self._yielded
