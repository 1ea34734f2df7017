"""The recurrent state at every position of a multi-token forward, so that a verify forward's rejected drafts are
taken back by choosing a state instead of feeding the kept tokens again (spec.rewind).

A gated-delta layer (Qwen3.5, Qwen3-Next: mlx-lm's ``GatedDeltaNet``) keeps an ``ArraysCache`` of two arrays: the
short convolution's window (the last K-1 inputs of ``conv1d``) and the delta rule's state. A forward of T tokens
leaves only what follows its last token. While ``recording()`` is open, every such layer that ``watch`` prepared
notes, per call:

- the state it started from (the array object the cache held: how ``select`` finds the call of a layer),
- the state after each of the T tokens (``gated_delta.recurrent(every_state=True)`` on CUDA; elsewhere mlx-lm's
  per-token ops one token at a time, the same arithmetic ``gated_delta_ops`` runs),
- the convolution's whole input (the window before the call, then the T new tokens' channels).

``Recording.select(cache, marked, fed, kept)`` sets the layer to what it holds after the first ``kept`` of the ``fed``
tokens: the state after token ``kept - 1`` and the K-1 convolution inputs ending there. Exact: these are the values the
forward computed at that position. A layer the recording cannot place (another family's layout, a state that was
None) returns False, and the caller replays instead.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from models.kernels.conv import DepthwiseConv1d

__all__ = ["Recording", "recording", "active", "watch"]

# per thread: a forward another thread runs meanwhile (a prefill beside a solo decoder) is not recorded
_local = threading.local()


@dataclass
class _Call:
    state_in: mx.array  # the state the call started from (the object the layer's cache held)
    states: mx.array  # (B, T, ...) the state after each token
    conv_input: Optional[mx.array]  # (B, K-1 + T, channels), or None when the layer's convolution was not watched


class Recording:
    """What the watched layers computed at every position during one forward."""

    def __init__(self):
        self.calls: list[_Call] = []
        self._conv: Optional[mx.array] = None  # the latest convolution input, for the delta rule call that follows

    def conv(self, conv_input: mx.array) -> None:
        self._conv = conv_input

    def delta_rule(self, state_in: Optional[mx.array], states: mx.array) -> None:
        if state_in is not None:
            self.calls.append(_Call(state_in, states, self._conv))
        self._conv = None

    def select(self, cache, marked: list, fed: int, kept: int) -> bool:
        """Set ``cache`` (an ArraysCache [conv window, state] whose arrays before the forward were ``marked``) to what
        it holds after the first ``kept`` of the ``fed`` tokens; False (nothing changed) when this recording cannot."""
        if len(marked) != 2 or marked[0] is None or marked[1] is None or not 0 < kept <= fed:
            return False
        call = next((c for c in self.calls if c.state_in is marked[1]), None)
        if call is None or call.conv_input is None or call.states.shape[1] != fed:
            return False
        window = marked[0].shape[1]
        if call.conv_input.shape[1] != window + fed:
            return False
        cache.cache = [mx.contiguous(call.conv_input[:, kept : kept + window]), call.states[:, kept - 1]]
        return True


def active() -> Optional[Recording]:
    """This thread's open recording, or None (the layers compute as usual)."""
    return getattr(_local, "recording", None)


@contextmanager
def recording() -> Iterator[Recording]:
    """Within the block, the watched layers note (in this thread) their every-position values into the Recording
    yielded."""
    outer = active()
    _local.recording = rec = Recording()
    try:
        yield rec
    finally:
        _local.recording = outer


class _WatchedConv1d(DepthwiseConv1d):
    """The layer's Conv1d that hands its input to the open recording (the same parameters, the same output; the
    CUDA kernel where ``conv`` says it applies)."""

    def __call__(self, x: mx.array) -> mx.array:
        if (rec := active()) is not None:
            rec.conv(x)
        return super().__call__(x)


def watch(model) -> int:
    """Let ``model``'s gated-delta layers (a ``conv1d`` beside ``A_log`` and ``dt_bias``) note their convolution
    input while a recording is open; returns how many layers are watched."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return 0
    watched = 0
    for m in modules():
        conv = m.get("conv1d") if isinstance(m, dict) else None
        if conv is None or "A_log" not in m or "dt_bias" not in m:
            continue
        if type(conv) in (nn.Conv1d, DepthwiseConv1d):
            conv.__class__ = _WatchedConv1d  # same layout, one more step in __call__: the weights stay where they are
        watched += isinstance(conv, _WatchedConv1d)
    return watched
