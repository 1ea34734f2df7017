"""Weight quantization: `mlx-lane quantize SRC OUT` (uniform, sensitivity-mixed, optionally rotation-folded).

What mlx-lm ships is used as is: `mlx_lm.utils.quantize_model` (per-layer predicate -> the per-layer
`quantization` block of config.json), `mlx_lm.utils.save` (weights + config + tokenizer), and, for `target_bpw`,
`mlx_lm.quant.dynamic_quant.estimate_sensitivities` (gradient of the KL to the float model against the low-bit /
high-bit weight difference, per layer) and `estimate_threshold` (binary search of the sensitivity threshold that
meets the bits-per-weight target). What this module adds: spec resolution through models.loading.load (GGUF, `default`,
packaged names), offline calibration text (Python stdlib sources, models.quant.data), rotation folding
(models.quant.rotation) before quantizing, stderr progress, and a provenance block.

Output: a normal mlx-lm directory (`mlx_lm.load(OUT)` works) whose config.json carries
- `quantization` (and mlx-lm's mirror `quantization_config`): `{"group_size", "bits", "mode"}` plus one entry per
  layer quantized differently from the default (mixed precision);
- `mlx_lane_quantize`: the recipe, the source, and the sha256 of the written weights. The weights hash matters:
  models.loading.fingerprint reads only config and safetensors headers, and two quantizations of one source (rotated or
  not, other calibration) have identical headers; the hash in config.json keeps their KV-cache namespaces apart.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from models.errors import ModelLoadError

__all__ = ["BITS", "QuantSpec", "QuantizeResult", "quantize_dir", "load_float", "high_bits_for", "say"]

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_HIGH = {2: 4, 3: 4, 4: 6, 5: 6, 6: 8, 8: 8}
RECIPE_KEY = "mlx_lane_quantize"


def say(msg: str) -> None:
    """Progress goes to stderr; stdout carries only results."""
    print(f"[quantize] {msg}", file=sys.stderr, flush=True)


def high_bits_for(bits: int) -> int:
    return _HIGH[bits]


@dataclass(frozen=True)
class QuantSpec:
    """One quantization recipe. `target_bpw` None = uniform `bits`; otherwise mixed `bits`/`high_bits` layers."""

    bits: int = 4
    group_size: int = 64
    target_bpw: float | None = None
    high_bits: int | None = None  # None: high_bits_for(bits)
    rotate: str | None = None  # None, "hadamard" or "block" (models.quant.rotation)
    dtype: str | None = None  # dtype of what stays float (norms, scales); None: the source's
    calib_tokens: int = 1024
    seq_len: int = 256
    seed: int = 0

    def validate(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.high_bits is not None and (self.high_bits not in BITS or self.high_bits <= self.bits):
            raise ValueError(f"high_bits must be one of {BITS} and above bits={self.bits}, got {self.high_bits}")
        if self.target_bpw is not None and self.target_bpw <= 0:
            raise ValueError(f"target_bpw must be > 0, got {self.target_bpw}")
        if self.rotate not in (None, "hadamard", "block"):
            raise ValueError(f"rotate must be 'hadamard' or 'block', got {self.rotate!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class QuantizeResult:
    path: Path
    bits_per_weight: float
    layers: dict[str, int]  # bits -> number of layers quantized with it ("float" for layers left alone)
    seconds: float


def resolve_source(spec: str) -> tuple[Path, str]:
    """(mlx-lm directory, model id) for a spec, by models.loading.load's rules (GGUF converted once, `default`, ...)."""
    from models.loading.load import _resolve  # the one resolution path; private there, shared on purpose

    return _resolve(spec, True)


def load_float(model_dir: Path, dtype: str | None = None):
    """(model, tokenizer, config) with float weights; refuses an already quantized source."""
    import mlx.core as mx
    from mlx_lm.utils import load

    try:
        model, tokenizer, config = load(str(model_dir), return_config=True)
    except (ValueError, FileNotFoundError, OSError, KeyError) as e:
        raise ModelLoadError(f"mlx-lm could not load {model_dir}: {e}") from e
    if "quantization" in config:
        raise ModelLoadError(f"{model_dir} is already quantized; quantize from a float model")
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        config["torch_dtype"] = dtype
    mx.eval(model.parameters())
    return model, tokenizer, config


def _mixed_predicate(model, config, tokenizer, spec: QuantSpec):
    """mlx-lm's dynamic-quant sensitivity + threshold search, on stdlib calibration text."""
    import mlx.core as mx
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold

    from models.quant.data import CALIBRATION_FILES, stdlib_batches

    high = spec.high_bits or high_bits_for(spec.bits)
    gs = spec.group_size
    lo_bpw, hi_bpw = _uniform_bpw(model, spec.bits, gs), _uniform_bpw(model, high, gs)
    if not lo_bpw <= spec.target_bpw <= hi_bpw:
        raise ValueError(
            f"target_bpw {spec.target_bpw} is outside what {spec.bits}/{high}-bit layers at group size {gs} can "
            f"reach ({lo_bpw:.3f} .. {hi_bpw:.3f}); change --target-bpw, --bits or --high-bits"
        )
    data = stdlib_batches(tokenizer, CALIBRATION_FILES, spec.calib_tokens, spec.seq_len)
    say(f"sensitivities of {spec.bits}-bit vs {high}-bit layers on {data.size} calibration tokens")
    mx.random.seed(spec.seed)
    sens = dict(estimate_sensitivities(model, data, spec.bits, gs, high, gs, batch_size=2))
    say(f"searching the threshold for {spec.target_bpw} bits per weight")
    threshold = estimate_threshold(model, sens, spec.target_bpw, spec.bits, gs, high, gs)

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if sens.get(path, float("-inf")) > threshold:
            return {"group_size": gs, "bits": high, "mode": "affine"}
        return True

    return predicate, sens


def _uniform_bpw(model, bits: int, group_size: int) -> float:
    import mlx.nn as nn
    from mlx_lm.utils import compute_bits_per_weight

    q = copy.deepcopy(model)
    nn.quantize(q, group_size, bits, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % group_size == 0)
    return compute_bits_per_weight(q)


def _layer_counts(model) -> dict[str, int]:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    counts: dict[str, int] = {}
    for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if hasattr(m, "bits"):
            key = str(m.bits)
        elif hasattr(m, "to_quantized"):
            key = "float"
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts


def _weights_sha256(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def quantize_dir(src: str, out: str | Path, spec: QuantSpec) -> QuantizeResult:
    """Quantize the model named by `src` (any models.loading.load spec) into the mlx-lm directory `out`."""
    from mlx_lm.utils import compute_bits_per_weight, quantize_model, save

    spec.validate()
    t0 = time.monotonic()
    out = Path(out)
    model_dir, model_id = resolve_source(src)
    if out.resolve() == model_dir.resolve():
        raise ValueError("OUT must differ from the source directory")
    say(f"loading {model_id} from {model_dir}")
    model, tokenizer, config = load_float(model_dir, spec.dtype)
    if spec.rotate:
        from models.quant.rotation import rotate_model

        say(f"folding norms and a {spec.rotate} rotation into the weights (float; outputs unchanged)")
        config = rotate_model(model, config, kind=spec.rotate, seed=spec.seed)
    predicate, sens = None, None
    if spec.target_bpw is not None:
        predicate, sens = _mixed_predicate(model, config, tokenizer, spec)
    say(f"quantizing: {spec.bits}-bit, group size {spec.group_size}"
        + (f", target {spec.target_bpw} bpw" if spec.target_bpw is not None else ""))
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints its summary on stdout
        model, config = quantize_model(model, config, spec.group_size, spec.bits, quant_predicate=predicate)
    bpw = compute_bits_per_weight(model)
    layers = _layer_counts(model)
    say(f"writing {out}")
    save(out, model_dir, model, tokenizer, config, donate_model=True)
    recipe = {k: v for k, v in asdict(spec).items()}
    recipe.update(source=model_id, source_dir=str(model_dir), bits_per_weight=round(bpw, 4), layers=layers,
                  weights_sha256=_weights_sha256(out))
    cfg_path = out / "config.json"
    written = json.loads(cfg_path.read_text())
    written[RECIPE_KEY] = recipe
    cfg_path.write_text(json.dumps(dict(sorted(written.items())), indent=4))
    if sens is not None:
        (out / "mlx_lane_sensitivities.json").write_text(json.dumps(sens, indent=1))
    secs = time.monotonic() - t0
    say(f"done: {bpw:.3f} bits per weight, layers by bits {layers}, {secs:.1f}s")
    return QuantizeResult(out, bpw, layers, secs)


def describe(config: dict[str, Any]) -> str:
    """A short label for a quantized directory's recipe, e.g. 'q4g64', 'q3g64+hadamard', 'mixed3/4@3.5'."""
    r = config.get(RECIPE_KEY) or {}
    q = config.get("quantization") or {}
    label = f"q{q.get('bits', '?')}g{q.get('group_size', '?')}"
    if r.get("target_bpw") is not None:
        label = f"mixed{r['bits']}/{r.get('high_bits') or high_bits_for(r['bits'])}@{r['target_bpw']}"
    if r.get("rotate"):
        label += f"+{r['rotate']}"
    return label
