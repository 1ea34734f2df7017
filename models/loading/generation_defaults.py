"""The sampling defaults a model ships in its ``generation_config.json`` (Hugging Face's file beside config.json).

A checkpoint's authors often name the sampling it was tuned for (Qwen3: temperature 0.6, top_p 0.95, top_k 20);
mlx_lm.server ignores the file and decodes greedily, mlx-vlm reads it (``mlx_vlm.generate.common.
resolve_sampling_defaults``) and agents that send no sampling fields expect the model's own. ``read_sampling_defaults
(model_dir)`` returns what the file declares, field by field (``None``: not declared, the API's default holds):

- ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` as declared (a value out of range or of
  the wrong type is ignored, and the log says so);
- ``do_sample: false`` (Hugging Face's switch for greedy decoding) makes the default temperature 0, as mlx-vlm reads
  it: the declared temperature is then what sampling would use, not what the model is served with.

No model is loaded and nothing else is read: the file is small JSON, read for a model that is not loaded yet too
(``/v1/models`` shows an on-demand model's defaults).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

__all__ = ["SamplingDefaults", "NO_DEFAULTS", "read_sampling_defaults", "FILE"]

log = logging.getLogger("mlx_lane.models")

FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling fields a model declares; ``None``: not declared."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None

    def as_dict(self) -> dict:
        """The declared fields only (what /v1/models shows)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


NO_DEFAULTS = SamplingDefaults()

# field -> (type, lowest, highest, lowest included): the ranges the request fields accept
_RANGES = {
    "temperature": (float, 0.0, 2.0, True),
    "top_p": (float, 0.0, 1.0, False),  # 0 would be greedy: a declared 0 is more likely a placeholder
    "top_k": (int, 0, None, True),
    "min_p": (float, 0.0, 1.0, True),
    "repetition_penalty": (float, 0.0, 10.0, False),
}


def read_sampling_defaults(model_dir) -> SamplingDefaults:
    """The defaults ``model_dir/generation_config.json`` declares (``NO_DEFAULTS`` when there is no such file or it
    does not parse)."""
    path = Path(model_dir) / FILE
    if not path.parent.is_dir():  # a GGUF file not converted yet, a hub name: nothing to read here
        return NO_DEFAULTS
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return NO_DEFAULTS
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return NO_DEFAULTS
    return sampling_defaults_of(config, str(path))


def sampling_defaults_of(config, where: str = FILE) -> SamplingDefaults:
    """The defaults a parsed ``generation_config.json`` declares (see the module docstring)."""
    if not isinstance(config, dict):
        return NO_DEFAULTS
    values: dict = {}
    for name, (kind, low, high, low_included) in _RANGES.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            log.warning("%s: ignoring %s=%r (not a number)", where, name, value)
            continue
        value = kind(value)
        if value < low or (value == low and not low_included) or (high is not None and value > high):
            log.warning("%s: ignoring %s=%r (out of range)", where, name, value)
            continue
        values[name] = value
    if config.get("do_sample") is False:  # Hugging Face decodes greedily then, whatever the temperature says
        values["temperature"] = 0.0
    return SamplingDefaults(**values)
