"""Where a thread's time goes, sampled from inside the process: a statistical profiler of named Python threads.

``sample(threads, seconds, interval_s)`` wakes every ``interval_s``, reads the named threads' current Python stacks
(``sys._current_frames``) and counts them; ``Profile`` turns the counts into what a reader needs:

  folded     one line per distinct stack, ``outer;...;inner COUNT`` (the "folded" format flamegraph.pl,
             speedscope and inferno read)
  top_self   the lines a sample was executing (``file:line function``), most frequent first, with their share
  top_total  the functions a sample was inside of anywhere on its stack, most frequent first, with their share

Why in-process and not py-spy: it needs no ptrace permission (containers drop it) and no tool on the machine, so it
runs wherever the server does, GPU machines included. What it sees and does not: MLX releases the GIL while it
evaluates or waits for the device (``mx.eval``, ``tolist``, ``item``), so a thread blocked on the GPU shows at the
Python line that waits, which is what tells host-bound from device-bound. A thread running pure Python holds the GIL
for up to ``sys.getswitchinterval()`` (5 ms) at a time, so samples come a little late and land a little off: the
shares are right over seconds, not per step. Sampling costs the sampled threads a GIL hand-over per sample (about a
microsecond each at the default 5 ms interval).
"""

from __future__ import annotations

import collections
import os
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Optional

__all__ = ["Profile", "sample", "MAX_SECONDS"]

MAX_SECONDS = 300.0  # one profile at most this long (a request holding a connection open longer is a mistake)
_DEPTH = 48  # frames kept per stack, innermost first (deeper stacks are cut at their outer end)


@dataclass
class Profile:
    """Counts of sampled stacks per thread name (outermost frame first)."""

    seconds: float = 0.0
    interval_s: float = 0.0
    samples: int = 0  # wake-ups
    stacks: dict[str, collections.Counter] = field(default_factory=dict)  # thread -> (frame, ...) -> count
    missing: list[str] = field(default_factory=list)  # named threads not found when sampling began

    def as_dict(self, top: int = 25) -> dict:
        threads = {}
        for name, counts in self.stacks.items():
            n = sum(counts.values())
            self_lines: collections.Counter = collections.Counter()
            inside: collections.Counter = collections.Counter()
            for stack, c in counts.items():
                if stack:
                    self_lines[stack[-1]] += c
                for fn in {_function(f) for f in stack}:
                    inside[fn] += c
            threads[name] = {
                "samples": n,
                "top_self": [{"line": k, "samples": c, "share": round(c / n, 4)} for k, c in self_lines.most_common(top)],
                "top_total": [{"function": k, "samples": c, "share": round(c / n, 4)} for k, c in inside.most_common(top)],
                "folded": [f"{';'.join(s)} {c}" for s, c in counts.most_common()],
            }
        return {"seconds": round(self.seconds, 3), "interval_ms": round(self.interval_s * 1e3, 3),
                "samples": self.samples, "missing_threads": self.missing, "threads": threads}


def _function(frame_label: str) -> str:
    """``file:line function`` -> ``file function`` (a function counted once however many of its lines ran)."""
    where, _, fn = frame_label.rpartition(" ")
    return f"{where.rsplit(':', 1)[0]} {fn}"


_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _label(frame: FrameType, root: str) -> str:
    code = frame.f_code
    path = code.co_filename
    if path.startswith(root):
        path = path[len(root):]
    elif path.startswith(_STDLIB):
        path = path[len(_STDLIB):]
    else:  # a library: from its package folder on (site-packages/mlx_lm/models/qwen3_next.py -> mlx_lm/models/...)
        for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
            at = path.rfind(marker)
            if at >= 0:
                path = path[at + len(marker):]
                break
    return f"{path}:{frame.f_lineno} {code.co_name}"


def _stack(frame: Optional[FrameType], root: str) -> tuple[str, ...]:
    out: list[str] = []
    while frame is not None and len(out) < _DEPTH:
        out.append(_label(frame, root))
        frame = frame.f_back
    return tuple(reversed(out))


def sample(thread_names: list[str], seconds: float, interval_s: float = 0.005,
           stop: Optional[threading.Event] = None) -> Profile:
    """Sample the Python threads named ``thread_names`` (``threading.Thread.name``; ``"MainThread"`` is the event
    loop's) every ``interval_s`` for ``seconds`` (at most ``MAX_SECONDS``), on the calling thread; ``stop`` ends it
    early. Threads that end meanwhile simply stop being counted."""
    seconds = min(max(seconds, 0.0), MAX_SECONDS)
    interval_s = min(max(interval_s, 0.0005), 1.0)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the repository's root
    by_name = {t.name: t.ident for t in threading.enumerate() if t.ident is not None}
    wanted = {name: by_name[name] for name in thread_names if name in by_name}
    profile = Profile(interval_s=interval_s, missing=[n for n in thread_names if n not in wanted])
    profile.stacks = {name: collections.Counter() for name in wanted}
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        now = time.perf_counter()
        if now >= deadline or (stop is not None and stop.is_set()):
            break
        frames = sys._current_frames()
        for name, ident in wanted.items():
            frame = frames.get(ident)
            if frame is not None:
                profile.stacks[name][_stack(frame, root)] += 1
        del frames
        profile.samples += 1
        time.sleep(max(0.0, interval_s - (time.perf_counter() - now)))
    profile.seconds = time.perf_counter() - t0
    return profile
