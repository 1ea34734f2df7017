"""The kernel cache's files, shared by processes: a kernel warmer compiles into a staging directory of its own and
publishes each finished kernel into the shared one whole.

MLX's CUDA backend (mlx 0.32, ``backend/cuda/jit_module.cpp``) keeps each compiled module as three files in
``MLX_PTX_CACHE_DIR``: ``NAME.ptx`` (the code), ``NAME.txt`` (its kernels' mangled names) and ``NAME.cu`` (the
source). It writes them in place, without a temporary name, and a reader takes a module as cached as soon as
``NAME.ptx`` exists, then reads ``NAME.txt``. So a process must never compile straight into a directory another
process reads: it could read a half-written ``.ptx``, or a ``.ptx`` without its ``.txt`` (then every launch of that
module fails: "There is no kernel named ..."). Here:

- ``stage(shared, staging)``: the staging directory starts with hard links to every file the shared one holds, so
  the warmer's MLX finds what an earlier start compiled and compiles only the rest;
- ``publish(staging, shared)``: each module the staging directory holds and the shared one lacks is copied under a
  temporary name and renamed into place (atomic on one file system), ``.txt`` and ``.cu`` before ``.ptx``, so a
  reader that sees the ``.ptx`` finds a whole module. Called between the warmer's steps, when MLX has closed every file
  it wrote (a module is written before its first launch).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["stage", "publish", "modules"]

_ORDER = (".txt", ".cu", ".ptx")  # the .ptx last: a reader takes a module as cached once its .ptx exists


def modules(folder: Path) -> set[str]:
    """The names of the whole modules in ``folder`` (a ``.ptx`` and its ``.txt``)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    ptx = {n[:-4] for n in names if n.endswith(".ptx")}
    return {n for n in ptx if n + ".txt" in names}


def stage(shared: Path, staging: Path) -> int:
    """Create ``staging`` with a hard link (a copy where links fail) to every file of ``shared``; returns how many
    modules it starts with."""
    staging.mkdir(parents=True, exist_ok=True)
    names = modules(shared)
    for name in names:
        for suffix in _ORDER:
            src, dst = shared / (name + suffix), staging / (name + suffix)
            if not src.exists() or dst.exists():
                continue
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
    return len(names)


def publish(staging: Path, shared: Path) -> int:
    """Copy every whole module of ``staging`` that ``shared`` lacks into ``shared``, each file under a temporary name
    renamed into place, the ``.ptx`` last; returns how many modules were published."""
    shared.mkdir(parents=True, exist_ok=True)
    have = modules(shared)
    count = 0
    for name in sorted(modules(staging) - have):
        for suffix in _ORDER:
            src = staging / (name + suffix)
            if not src.exists():  # a module MLX wrote without its source: the .ptx and .txt are what count
                continue
            tmp = shared / f".{name}{suffix}.{os.getpid()}.tmp"
            shutil.copyfile(src, tmp)
            os.replace(tmp, shared / (name + suffix))
        count += 1
    return count
