"""What the generation core needs of the running server, and nothing more: the lane to submit to, the serving
counters, the prefix cache (for the SSD prefetch), how a request's cache namespace is computed, and two defaults.
The process wiring (server.serve) builds one; the core never sees the whole ``ServerState``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from models.loading.generation_defaults import NO_DEFAULTS, SamplingDefaults
from server.core.media import ImageLimits
from server.core.next_turn import NextTurns
from server.lane.events import SamplingParams
from server.lane.lane import Lane
from server.lane.target import Target
from server.stats import ServingStats

__all__ = ["CoreContext"]


@dataclass(frozen=True)
class CoreContext:
    lane: Lane
    stats: ServingStats
    prompt_cache: Any  # a cache.protocol.PrefixCache: ``prefetch`` starts SSD reads while a request waits
    namespace_for: Callable[[Target, SamplingParams], str]  # the engine's rule (server.engine.engine.Engine)
    keepalive_s: float = 10.0  # --keepalive: a stream that waits this long gets a keep-alive
    default_max_tokens: int = 2048  # when a chat / completions / Messages request gives no max_tokens
    image_limits: ImageLimits = ImageLimits()  # --max-images, --max-image-bytes, --max-image-pixels, --allow-image-urls
    model_defaults: bool = True  # sampling fields a request leaves out come from the model's generation_config.json
    # (--ignore-model-defaults: False, the API's defaults)
    next_turns: Optional[NextTurns] = field(default_factory=NextTurns)  # the next turn's cache entry after a chat
    # reply (server.core.next_turn); None: --no-next-turn-cache

    def sampling_defaults(self, slot) -> SamplingDefaults:
        """The sampling defaults a request to ``slot``'s model gets for the fields it leaves out."""
        return slot.sampling_defaults if self.model_defaults else NO_DEFAULTS
