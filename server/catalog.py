"""What this server serves: its model names, ``--model-alias`` patterns, and the LoRA adapters.

Names (``is_served``; server.http.target resolves a request's name once): agent clients send model names of their own (Claude Code:
``claude-sonnet-4-5`` and a small fast model; Codex: whatever its profile says). ``--model-alias 'claude-*'`` maps
every matching name onto the one served model; any other unknown name is a 404 (``ModelNotFound``), which each API
shapes as its own error. A loaded LoRA adapter's name (``--adapter NAME=PATH``) selects that adapter; it wins over an
alias pattern.

Adapters (``AdapterRegistry``): names -> ``models.loading.adapters.Adapter`` and their counters. A request selects an
adapter through its ``model`` field; the adapter travels in the request's ``server.lane.target.Target`` to the lane,
which computes the request with the adapter's model and caches its KV under the adapter's namespace.
Unloading only forgets the name: requests already running keep their reference and finish with it.

Who may load (``load_refusal``, the policy; ``POST /admin/adapters`` in server.http.admin is the mechanism): an
adapter directory is code-free data, but it is read from the server's disk, so a path is accepted only from an
authenticated client (the server runs with ``--api-key``), or when it lies under ``--adapter-dir`` (the operator's
choice of what anyone on the port may load). Without either, run-time loading is refused: a server bound without a
key must not read paths that any local process names.
"""


from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Optional


__all__ = ["AdapterRegistry", "load_refusal", "adapter_path_for", "AdapterCounters", "is_served"]


@dataclass
class AdapterCounters:
    requests: int = 0
    cache_hits: int = 0  # requests whose prompt was partly served by the prefix cache
    cached_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, finished) -> None:
        """Count one finished request (server.lane.events.Finished)."""
        self.requests += 1
        self.cache_hits += 1 if finished.cached_tokens > 0 else 0
        self.cached_tokens += finished.cached_tokens
        self.prompt_tokens += finished.prompt_tokens
        self.completion_tokens += finished.completion_tokens

    def as_dict(self) -> dict:
        return {"requests": self.requests, "cache_hits": self.cache_hits, "cached_tokens": self.cached_tokens,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


class AdapterRegistry:
    """Thread-safe: handlers resolve names, the admin endpoint adds and removes, the lane counts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_name: dict = {}
        self._counters: dict[str, AdapterCounters] = {}

    def get(self, name: Optional[str]):
        if not name:
            return None
        with self._lock:
            return self._by_name.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def all(self) -> list:
        with self._lock:
            return [self._by_name[n] for n in sorted(self._by_name)]

    def add(self, adapter) -> None:
        with self._lock:
            self._by_name[adapter.name] = adapter
            self._counters.setdefault(adapter.name, AdapterCounters())

    def remove(self, name: str):
        """Forget ``name``; returns the adapter or None. Its counters stay (a reload continues them)."""
        with self._lock:
            return self._by_name.pop(name, None)

    def counters(self, name: str) -> AdapterCounters:
        """The counters a finished request of adapter ``name`` is added to (by the lane thread)."""
        with self._lock:
            return self._counters.setdefault(name, AdapterCounters())

    def stats_block(self) -> dict:
        """The ``adapters`` block of /stats: each name ever served, loaded or not, with its counters."""
        with self._lock:
            out = {}
            for name, c in sorted(self._counters.items()):
                a = self._by_name.get(name)
                out[name] = {"loaded": a is not None, **c.as_dict()}
                if a is not None:
                    out[name].update({"identity": a.identity[:16], "path": str(a.path), "rank": a.rank,
                                      "num_layers": a.num_layers, "fine_tune_type": a.fine_tune_type})
            return out


def _under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def adapter_path_for(name: str, path: Optional[str], adapter_dir: Optional[str]) -> Path:
    """Where to load adapter ``name`` from: ``path`` when given, else ``<adapter_dir>/<name>``. Raises ValueError
    when neither is possible."""
    if path:
        return Path(os.path.realpath(os.path.expanduser(path)))
    if not adapter_dir:
        raise ValueError("give 'path' (the adapter directory mlx_lm.lora wrote), or start the server with "
                         "--adapter-dir DIR to load adapters by name from DIR/<name>")
    return Path(os.path.realpath(os.path.join(os.path.expanduser(adapter_dir), name)))


def load_refusal(path: Path, *, authenticated: bool, adapter_dir: Optional[str]) -> Optional[str]:
    """Why a run-time load of ``path`` is refused (None: allowed). ``authenticated``: the server has --api-key (the
    guard already checked the request's key). ``path`` is a realpath, so symlinks and '..' cannot leave the dir."""
    if authenticated:
        return None
    if adapter_dir:
        root = Path(os.path.realpath(os.path.expanduser(adapter_dir)))
        if _under(path, root) and path != root:
            return None
        return (f"this server has no --api-key, so it loads adapters only from under its --adapter-dir "
                f"({root}); the path given is outside it")
    return ("loading adapters at run time needs --api-key (an authenticated client may name any path) or "
            "--adapter-dir DIR (anyone may load adapters found under DIR); this server has neither. Restart it "
            "with one of them, or load the adapter at start with --adapter NAME=PATH")


# -- served names ------------------------------------------------------------------------------------------------


def is_served(names, aliases, requested: str) -> bool:
    """True when ``requested`` is a served name or matches an alias pattern (case-sensitive glob)."""
    return requested in names or any(fnmatchcase(requested, pattern) for pattern in aliases)
