"""Streaming sha256 of big files, remembered across runs.

The digest of a file is stored in `<home>/hash-cache/<key>.json` (key: sha256 of the absolute
path) together with the file's size and mtime; when both still match, the file is not re-read.
The cache lives under mlx-lane's home, not beside the file, because a GGUF may sit in a
read-only directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["sha256_file", "file_sha256_cached"]

_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at `path`, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def file_sha256_cached(path: Path, cache_dir: Path) -> str:
    """Hex sha256 of `path`, reusing the digest in `cache_dir` when size and mtime are unchanged."""
    path = Path(path).resolve()
    st = path.stat()
    entry = cache_dir / (hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".json")
    try:
        saved = json.loads(entry.read_text())
        if saved["path"] == str(path) and saved["size"] == st.st_size and saved["mtime_ns"] == st.st_mtime_ns:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    try:
        _write_json_atomic(entry, {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest})
    except OSError:
        pass  # an unwritable cache only costs a re-hash next time
    return digest
