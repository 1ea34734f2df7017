"""nemotron_h's Mamba-2 mixer, told where each row of a batched prompt ends (mlx-lm 0.32.2 tells granitemoehybrid's).

mlx-lm's batched prompt forward (``PromptProcessingBatch``) right-pads rows of different lengths and records each
row's length in its ``ArraysCache`` (``cache.lengths``). granitemoehybrid's mixer hands those lengths to
``ssm_update``, which stops each row's state at its own end; nemotron_h's hands only the mask, so a shorter row's
state ran on through the padding, and the lane had to prefill nemotron_h one prompt per forward
(server.engine.slot's ``_PADDED_STATE_EXACT``). ``install(model)`` gives nemotron_h's mixer granitemoehybrid's
``_ssm``: the same computation, plus the lengths (None outside a batched prompt: unchanged there). It calls the
module's ``ssm_update`` by name at call time, so models.kernels' switch of that function still applies.
``tests/unit/test_zoo_models.py`` holds nemotron_h's batched prompts to its tokens alone.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

__all__ = ["install", "lengths_reach_state"]


def _ssm_with_lengths(self, hidden_states: mx.array, B: mx.array, C: mx.array, dt: mx.array, cache,
                      mask: Optional[mx.array]) -> mx.array:
    from mlx_lm.models import nemotron_h

    batch_size, seq_len, _ = hidden_states.shape
    hidden_states = hidden_states.reshape(batch_size, seq_len, self.num_heads, self.head_dim)
    B = B.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
    C = C.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
    state, lengths = (cache[1], cache.lengths) if cache else (None, None)
    y, state = nemotron_h.ssm_update(hidden_states, self.A_log, B, C, self.D.astype(hidden_states.dtype), dt,
                                     self.dt_bias, state, self.time_step_limit, mask, lengths)
    if cache:
        cache[1] = state
    return y.reshape(batch_size, seq_len, self.intermediate_size)


_ssm_with_lengths.mlx_lane_lengths = True  # type: ignore[attr-defined]


def _mixer_class(model):
    modules = model.modules() if hasattr(model, "modules") else []
    return next((type(m) for m in modules if type(m).__name__ == "NemotronHMamba2Mixer"
                 and type(m).__module__ == "mlx_lm.models.nemotron_h"), None)  # mlx-vlm's own class: left alone


def install(model) -> bool:
    """Give nemotron_h's mixer its rows' lengths if ``model`` has one; True when it does (now or from an earlier
    load: the class is mlx-lm's, shared by every nemotron_h model of the process)."""
    cls = _mixer_class(model)
    if cls is None:
        return False
    if not getattr(cls._ssm, "mlx_lane_lengths", False):
        _ssm_with_lengths.mlx_lane_original = cls._ssm  # type: ignore[attr-defined]
        cls._ssm = _ssm_with_lengths
    return True


def lengths_reach_state(model) -> bool:
    """False only for a model with nemotron_h's mixer not yet given its lengths (its batched prompts would not be
    exact); the engine's facts ask this before letting such a model prefill together."""
    cls = _mixer_class(model)
    return cls is None or getattr(cls._ssm, "mlx_lane_lengths", False)
