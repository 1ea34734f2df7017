"""The model fingerprint: the namespace under which KV caches of this model may be reused.

sha256 over, in order: a format tag; config.json re-serialised canonically (sorted keys); for
each `*.safetensors` file (sorted by name) its name, size and JSON header bytes (tensor names,
shapes, dtypes, offsets - cheap to read, and it changes whenever the weights layout does); the
source GGUF's sha256 when the directory is a conversion (mlx_lane_source.json), which also
covers weight *values*; and the serving dtype. It does not read the weights, so it is fast
and stable across restarts.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from models.errors import ModelLoadError

__all__ = ["fingerprint"]

_TAG = b"mlx-lane-fingerprint-v1\0"


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelLoadError(f"{path} is truncated (no safetensors header); delete it and re-convert")
        (n,) = struct.unpack("<Q", head)
        return f.read(n)


def fingerprint(model_dir: Path, dtype: str) -> str:
    """Hex sha256 identifying (config, weights, dtype) of the mlx-lm model in `model_dir`."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(_TAG)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{model_dir}/config.json is missing or invalid ({e})") from e
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for st in sorted(model_dir.glob("*.safetensors")):
        h.update(b"\0file\0" + st.name.encode() + b"\0" + str(st.stat().st_size).encode() + b"\0")
        h.update(_safetensors_header(st))
    source = model_dir / "mlx_lane_source.json"
    if source.is_file():
        try:
            h.update(b"\0gguf\0" + str(json.loads(source.read_text()).get("gguf_sha256")).encode())
        except ValueError:
            pass
    h.update(b"\0dtype\0" + dtype.encode())
    return h.hexdigest()
