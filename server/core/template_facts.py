"""What a model's chat template does with reasoning, read from the template itself: rendered on small probes once per
tokenizer, never assumed from the model's name.

``template_facts(tokenizer) -> TemplateFacts``:

- ``effort_levels``: the ``reasoning_effort`` levels the template takes, in ``EFFORT_SCALE`` order (empty: the
  template reads no ``reasoning_effort``). A level it takes renders without raising; when the template names two or
  more levels of the scale as quoted strings (Qwen3.8: ``['low', 'medium', 'xhigh']``), only those count, and when it
  names fewer (gpt-oss renders any string after ``Reasoning:`` and names only its default, ``"medium"``), the three
  levels OpenAI's reasoning models were trained on (``low``, ``medium``, ``high``).
- ``renders_reasoning``: the template renders an assistant turn's past reasoning from the message's
  ``reasoning_content`` (Qwen3, GLM, MiniMax) or ``thinking`` (gpt-oss) field (``REASONING_FIELDS``: a message
  carries both; transformers fills one from the other too).

``effort_level(facts, wish) -> EffortChoice``: the level a request's effort becomes for this template: the wish when
the template takes it, else the nearest taken level on the scale (between two as near, the higher one: a client that
asks for more reasoning than the lower level gives). Never a level the template raises on: a request is never a 500
for its effort.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

__all__ = ["TemplateFacts", "EffortChoice", "EFFORT_SCALE", "template_facts", "effort_level", "REASONING_FIELDS"]

log = logging.getLogger("mlx_lane.templates")

# OpenAI's reasoning effort levels (openai-python's ReasoningEffort), Anthropic's xhigh and max among them, lowest first
EFFORT_SCALE = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_TRAINED = ("low", "medium", "high")  # what a template that names no levels of its own is given
REASONING_FIELDS = ("reasoning_content", "thinking")  # where templates read a past turn's reasoning
_PROBE = [{"role": "user", "content": "Hi"}]
_MARK = "mlxlane7f3reasoningprobe"


@dataclass(frozen=True)
class TemplateFacts:
    effort_levels: tuple[str, ...] = ()  # the reasoning_effort levels it takes (empty: it reads none)
    renders_reasoning: bool = False  # it renders a past turn's reasoning from REASONING_FIELDS


@dataclass(frozen=True)
class EffortChoice:
    level: Optional[str]  # what the template gets (None: nothing is passed)
    asked: Optional[str]  # what the request asked

    @property
    def changed(self) -> bool:
        return self.level is not None and self.level != self.asked


_facts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def template_facts(tokenizer) -> TemplateFacts:
    """The facts of ``tokenizer``'s chat template (computed on first use, then kept with the tokenizer)."""
    with _lock:
        known = _facts.get(tokenizer)
    if known is not None:
        return known
    facts = TemplateFacts(_effort_levels(tokenizer), _renders_reasoning(tokenizer))
    with _lock:
        _facts[tokenizer] = facts
    return facts


def effort_level(facts: TemplateFacts, wish: Optional[str]) -> EffortChoice:
    """The level ``wish`` (a level of ``EFFORT_SCALE``, or None) becomes for a template with ``facts``."""
    levels = facts.effort_levels
    if wish is None or not levels:
        return EffortChoice(None, wish)
    if wish in levels:
        return EffortChoice(wish, wish)
    at = EFFORT_SCALE.index(wish) if wish in EFFORT_SCALE else EFFORT_SCALE.index("medium")
    nearest = min(levels, key=lambda level: (abs(EFFORT_SCALE.index(level) - at), -EFFORT_SCALE.index(level)))
    return EffortChoice(nearest, wish)


def _source(tokenizer) -> Optional[str]:
    """The template's text (every named template of a tokenizer that has several), or None (a custom renderer)."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        return "\n".join(str(v) for v in source.values())
    return source if isinstance(source, str) else None


def _renders(tokenizer, messages, **kwargs) -> Optional[str]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template raises for what it does not take: that is the answer
        return None
    return out if isinstance(out, str) else None


def _effort_levels(tokenizer) -> tuple[str, ...]:
    source = _source(tokenizer)
    if source is not None and "reasoning_effort" not in source:
        return ()
    taken = [level for level in EFFORT_SCALE
             if _renders(tokenizer, _PROBE, add_generation_prompt=True, reasoning_effort=level) is not None]
    if source is None:  # a custom renderer: it reads the variable only if the level changes what it writes
        outputs = {_renders(tokenizer, _PROBE, add_generation_prompt=True, reasoning_effort=level) for level in taken}
        if len(outputs) < 2:
            return ()
        source = ""
    named = [level for level in taken if re.search(rf"""['"]{level}['"]""", source)]
    if len(named) >= 2:
        return tuple(named)
    trained = tuple(level for level in _TRAINED if level in taken)
    return trained or tuple(taken)


def _renders_reasoning(tokenizer) -> bool:
    turn = [*_PROBE, {"role": "assistant", "content": "Hello", **{name: _MARK for name in REASONING_FIELDS}}]
    out = _renders(tokenizer, turn, add_generation_prompt=False)
    return out is not None and _MARK in out
