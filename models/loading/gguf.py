"""Convert a GGUF file into an mlx-lm model directory, without torch.

Every tensor is dequantized with the `gguf` package (`GGUFReader` + `gguf.quants.dequantize`), not
`mx.load`, which mis-decodes Q4_K and rejects Q5_0 in mlx 0.32.4. Weights are written in float32
(the loader casts them to the serving dtype), so the conversion is exact up to the GGUF's own
quantization and compares tightly with transformers' GGUF loader.

Output directory (written into a temporary sibling, then renamed: a crash never leaves a partial
directory under the final name):

    config.json  model.safetensors  tokenizer.json  tokenizer_config.json
    generation_config.json  mlx_lane_source.json (sha256 of the source GGUF)
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from models.errors import ModelLoadError
from models.loading.gguf_arch import build_config, check_architecture, fix_tensor, mlx_name
from models.loading.gguf_tokenizer import build_tokenizer, tokenizer_config
from models.loading.hashing import sha256_file
from models.loading.progress import Progress

__all__ = ["convert_gguf", "read_metadata", "SOURCE_FILE", "CONVERTER_VERSION"]

SOURCE_FILE = "mlx_lane_source.json"
CONVERTER_VERSION = 2  # bump whenever the output of a conversion changes: old ones are redone
_SKIP_FIELDS = ("GGUF.",)


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}); check the file is complete") from e


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields of an open GGUFReader as plain Python values."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(_SKIP_FIELDS):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic field type we do not need; keep going
            continue
    return meta


def _write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]], arrays: Iterable[np.ndarray]) -> None:
    """Stream float32 tensors to a safetensors file: header from `specs`, then each array in order.

    Only one tensor is in memory at a time, so converting a 1.5B model needs ~1x its float32 size less.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, shape in specs:
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, shape), arr in zip(specs, arrays, strict=True):
            arr = np.ascontiguousarray(arr, dtype="<f4")
            if tuple(arr.shape) != tuple(shape):
                raise ModelLoadError(f"tensor {name} dequantized to shape {arr.shape}, expected {shape}")
            f.write(arr.tobytes())
        f.flush()
        os.fsync(f.fileno())


def _dequantized(reader, arch: str, meta: dict[str, Any], tensors: list, bar: Progress):
    from gguf.quants import dequantize

    for t in tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"GGUF tensor {t.name} uses quantization {t.tensor_type.name}, which the gguf package cannot "
                f"dequantize ({e}); upgrade gguf or use another quantization of the model"
            ) from e
        yield fix_tensor(arch, t.name, w, meta)
        bar.update()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(path: str | os.PathLike, outdir: str | os.PathLike, *, progress: bool = True,
                 sha256: str | None = None) -> Path:
    """Convert the GGUF at `path` into an mlx-lm model directory `outdir`; returns `outdir`.

    Supports architectures llama, qwen2 and gemma3 (see models.loading.gguf_arch); anything else raises
    ModelLoadError before any weight is read. `sha256` is the file's digest when the caller
    already knows it (it is recorded in mlx_lane_source.json); otherwise it is computed. An
    existing `outdir` is replaced only once the new conversion is complete. Shows a progress bar
    on stderr when `progress` is true.
    """
    src, out = Path(path), Path(outdir)
    if not src.is_file():
        raise ModelLoadError(f"GGUF file {src} does not exist")
    reader = _open(src)
    meta = read_metadata(reader)
    arch = str(meta.get("general.architecture", "?"))
    check_architecture(arch)
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{src} carries no tokenizer (tokenizer.ggml.tokens); mlx-lane needs one to serve text")

    wanted = [(t, mlx_name(arch, t.name)) for t in reader.tensors]
    tensors = [t for t, name in wanted if name is not None]
    specs = [(name, tuple(int(d) for d in reversed(t.shape))) for t, name in wanted if name is not None]
    names = {name for name, _ in specs}
    tied = "lm_head.weight" not in names
    vocab_size = dict(specs)["model.embed_tokens.weight"][0]
    config = build_config(arch, meta, vocab_size=vocab_size, tied=tied)
    tokenizer = build_tokenizer(meta, arch)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        bar = Progress(f"converting {src.name}", len(tensors), enabled=progress)
        _write_safetensors(tmp / "model.safetensors", specs, _dequantized(reader, arch, meta, tensors, bar))
        bar.close()
        _write_json(tmp / "config.json", config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        _write_json(tmp / "generation_config.json", gen)
        _write_json(tmp / SOURCE_FILE, {
            "gguf_sha256": sha256 or sha256_file(src),
            "gguf_name": src.name,
            "gguf_size": src.stat().st_size,
            "architecture": arch,
            "context_length": config["max_position_embeddings"],
            "converter_version": CONVERTER_VERSION,
        })
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
