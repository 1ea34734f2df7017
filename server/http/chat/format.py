"""OpenAI response objects: chat.completion(.chunk) and text_completion, as dicts (server.http.wire frames them)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from server.lane.events import Finished, TokenLogprob


def usage(f: Finished) -> dict:
    out = {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    }
    if f.spec is not None:  # extension field: what speculative decoding did for this request
        out["speculative"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in f.spec.items()}
    return out


def chat_logprobs(lps) -> dict:
    """A choice's ``logprobs``: its content tokens' (a refusal's tokens: none, never refused here)."""
    return {"content": [chat_logprob(x) for x in lps], "refusal": None}


def chat_logprob(lp: TokenLogprob) -> dict:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, v, b in lp.top],
    }


def completion_logprobs(lps: list[TokenLogprob], start_offset: int = 0) -> dict:
    offsets, pos = [], start_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t: v for t, v, _ in lp.top} for lp in lps],
        "text_offset": offsets,
    }


@dataclass
class ChatFormatter:
    model: str
    fingerprint: str
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            **extra,
        }

    def role_chunk(self) -> dict:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def content_chunk(self, text: str, logprobs: list[TokenLogprob]) -> dict:
        lp = chat_logprobs(logprobs) if logprobs else None
        return self._chunk([{"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}])

    def reasoning_chunk(self, text: str, logprobs: list[TokenLogprob]) -> dict:
        """A delta of the model's reasoning (``delta.reasoning_content``, as DeepSeek / vLLM name it)."""
        lp = chat_logprobs(logprobs) if logprobs else None
        return self._chunk([{"index": 0, "delta": {"reasoning_content": text}, "logprobs": lp, "finish_reason": None}])

    def tool_calls_chunk(self, calls: list[dict]) -> dict:
        delta = {"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def finish_chunk(self, reason: str) -> dict:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])

    def usage_chunk(self, f: Finished) -> dict:
        return self._chunk([], usage=usage(f))

    def completion(self, text: str, calls: list[dict], logprobs, reason: str, f: Finished, *,
                   reasoning: str = "") -> dict:
        # refusal: required (nullable) by OpenAI's schema; a local model's refusal is ordinary text
        message: dict = {"role": "assistant", "content": text if (text or not calls) else None, "refusal": None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                    "finish_reason": reason,
                }
            ],
            "usage": usage(f),
        }


@dataclass
class CompletionFormatter:
    model: str
    fingerprint: str
    id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _obj(self, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            **extra,
        }

    def text_chunk(self, text: str, logprobs, offset: int) -> dict:
        lp = completion_logprobs(logprobs, offset) if logprobs else None
        return self._obj([{"index": 0, "text": text, "logprobs": lp, "finish_reason": None}])

    def finish_chunk(self, reason: str) -> dict:
        return self._obj([{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}])

    def usage_chunk(self, f: Finished) -> dict:
        return self._obj([], usage=usage(f))

    def completion(self, text: str, logprobs, reason: str, f: Finished) -> dict:
        lp = completion_logprobs(logprobs) if logprobs is not None else None
        return self._obj([{"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}], usage=usage(f))
