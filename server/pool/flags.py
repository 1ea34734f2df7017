"""``--model`` as given on the command line: the base model and the named on-demand ones.

``--model PATH`` (once, no name) is the base model, as it always was. ``--model NAME=PATH`` (repeatable) adds a
model requests select with ``"model": "NAME"``; without a plain ``--model``, the first named one is the base (it
answers under its NAME too). A value is ``NAME=PATH`` only when NAME is a plain name (letters, digits, ``_ . : -``):
``/models/a=b`` stays a path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from models import ModelLoadError

__all__ = ["ModelFlags", "parse_model_flags", "NAME"]

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


@dataclass
class ModelFlags:
    base: str  # what models.loading.load.load_model resolves for the base model
    base_name: Optional[str] = None  # the NAME it was given (None: a plain --model)
    named: dict[str, str] = field(default_factory=dict)  # the on-demand models: NAME -> PATH


def parse_model_flags(values) -> ModelFlags:
    values = [values] if isinstance(values, str) else list(values or ["default"])
    plain: list[str] = []
    named: dict[str, str] = {}
    for value in values:
        name, sep, path = str(value).partition("=")
        name, path = name.strip(), path.strip()
        if sep and NAME.match(name):
            if not path:
                raise ModelLoadError(f"--model {value!r}: write it as NAME=PATH (PATH: an mlx-lm model directory, "
                                     "a .gguf file or a Hugging Face repo id)")
            if name in named or name == "default":
                raise ModelLoadError(f"--model {value!r}: the name {name!r} is taken; give each model its own name")
            named[name] = path
        else:
            plain.append(str(value).strip())
    if len(plain) > 1:
        raise ModelLoadError(f"--model given {len(plain)} times without a name ({', '.join(plain)}): one is the "
                             "base model; give the others a name, --model NAME=PATH")
    if plain:
        return ModelFlags(plain[0], None, named)
    if named:
        first = next(iter(named))
        return ModelFlags(named.pop(first), first, named)
    return ModelFlags("default")
