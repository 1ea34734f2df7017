"""What travels between the HTTP side and the lane: a request's sampling parameters and the events it produces.

A handler submits a ``server.lane.sequence.Sequence`` (token ids already rendered and tokenized off the lane, its
``SamplingParams``) and receives ``Progress`` / ``Delta`` / ``Finished`` / ``Failed`` events through its ``sink``,
which must be thread-safe (the lane thread calls it). Exactly one ``Finished`` or ``Failed`` ends every sequence the
lane accepted, cancelled ones included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[int, float]] = None
    logprobs: bool = False
    top_logprobs: int = 0
    num_draft_tokens: Optional[int] = None  # None: the server's setting; 0: no speculation
    grammar: Any = None  # server.core.grammar.GrammarSpec: constrained decoding, one .processor() per request
    raw_text: bool = False  # a raw completion: its text is exactly what the tokens spell, the first token's
    # leading space included (prompt + text reads as the model wrote it); chat replies trim it, as mlx-lm does


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]]


@dataclass(frozen=True)
class Progress:
    done: int
    total: int


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    first_token: bool = False


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # server.lane.sequence.FinishReason's value: "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_tokens: int  # tokens actually computed before the first output token
    prefill_s: float
    decode_tokens: int  # tokens decoded after the first one (the rate's numerator)
    decode_s: float
    queued_s: float
    spec: Optional[dict] = None  # speculative decoding counters of this request, when it speculated
    stop_sequence: Optional[str] = None  # the stop string that ended it (None: EOS, length, or no stop strings)
    cache_write_tokens: int = 0  # prompt tokens this request newly put in the prefix cache (beyond cached_tokens)


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Progress | Delta | Finished | Failed
