"""Offline text for calibration and evaluation: Python standard-library sources of the running interpreter.

Calibration and evaluation read disjoint files, so the quality report is measured on held-out text. The files
are stable for one Python version; the token count is fixed by the caller, so runs are comparable.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

__all__ = ["CALIBRATION_FILES", "EVAL_FILES", "stdlib_text", "stdlib_batches"]

CALIBRATION_FILES = ("functools.py", "argparse.py", "shutil.py")
EVAL_FILES = ("textwrap.py", "heapq.py", "string.py", "fractions.py")


def stdlib_text(names: tuple[str, ...]) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in names:
        path = root / name
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    if not parts:
        raise FileNotFoundError(f"none of {names} found under {root}")
    return "\n\n".join(parts)


def stdlib_batches(tokenizer, names: tuple[str, ...], n_tokens: int, seq_len: int):
    """An int32 mx.array (n_tokens // seq_len, seq_len) of consecutive token windows of the named files."""
    import mlx.core as mx

    if n_tokens < seq_len or seq_len < 2:
        raise ValueError(f"need n_tokens >= seq_len >= 2, got {n_tokens}, {seq_len}")
    ids = tokenizer.encode(stdlib_text(names))
    rows = min(n_tokens // seq_len, len(ids) // seq_len)
    if rows == 0:
        raise ValueError(f"the text has only {len(ids)} tokens, fewer than seq_len {seq_len}")
    return mx.array(ids[: rows * seq_len], dtype=mx.int32).reshape(rows, seq_len)
