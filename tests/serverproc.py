"""Start a real ``mlx-lane serve`` in a subprocess on a free loopback port (test helper)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int, low: int = 20000, high: int = 32000) -> int:
    """The first of ``n`` consecutive free loopback ports (MLX's ring backend listens on ``--starting-port`` + rank).

    Drawn below the kernel's ephemeral range (32768-60999 on Linux), where ``free_port`` and every outgoing
    connection get theirs: a run that began at an ephemeral ``free_port()`` once found rank 1's port taken by a
    concurrent test ("[ring] Couldn't bind socket (error: 98)"). Every port of the run is bound at once to check it."""
    import random

    for _ in range(200):
        start = random.randrange(low, high - n)
        socks = []
        try:
            for port in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports between {low} and {high}")


NO_TORCH = Path(__file__).resolve().parent / "fixtures" / "no_torch"

_log_dir: list[str] = []  # this process's folder of server logs (log_path), made on first use


def log_path(prefix: str) -> Path:
    """A new log file for a test server, in one folder per test process: tests/conftest.py removes it when the
    session passed and names it when one failed (a suite run starts ~140 servers; their logs piled up in /tmp)."""
    if not _log_dir:
        _log_dir.append(tempfile.mkdtemp(prefix="mlx-lane-test-logs-"))
    return Path(tempfile.mkstemp(prefix=prefix, suffix=".log", dir=_log_dir[0])[1])


def log_dir() -> str | None:
    """The folder of this process's server logs, or None when no server started."""
    return _log_dir[0] if _log_dir else None


def server_env(env: dict | None = None) -> dict:
    """The environment of a server subprocess: this one's, unbuffered, torch hidden as in the product's own
    environment (tests/fixtures/no_torch/sitecustomize.py says why), then ``env``."""
    from models.runtime import blas_preload_env, find_openblas

    path = os.pathsep.join(p for p in (str(NO_TORCH), os.environ.get("PYTHONPATH", "")) if p)
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}
    lib = find_openblas()
    # OpenBLAS preloaded as the server would do it itself (models.runtime.ensure_blas), without its re-exec: one
    # interpreter start less for each of the suite's ~70 servers
    return blas_preload_env(full, lib) if lib else full


def _mentions_ssd(args, env) -> bool:
    return any(a in ("--ssd-cache", "--no-ssd-cache") for a in args) or any(
        k in env for k in ("MLX_LANE_SSD_CACHE", "MLX_LANE_NO_SSD_CACHE"))


# The warm-up of a server that does not name --warm-up: None (the product's default) for a benchmark; the suite's
# tests/conftest.py sets "off" (its forwards ran behind the first requests of ~40 test servers, ~1.2 s of CPU each;
# the suite's shared server and tests/integration/test_lane_behaviour.py run the default, behind, by name).
WARM_UP_UNLESS_NAMED: str | None = None


# Servers forked by a fork server that has done their third-party imports (tests/forkserver.py) instead of fresh
# interpreters: the suite's tests/conftest.py turns it on (a benchmark's start-up must be a user's, so not there).
FORK_SERVER = False


def flags_for_tests(args: tuple, env: dict) -> tuple:
    """What a test (or bench) server adds to its flags unless it names them: no SSD tier (the product's default is
    on; a test opts in, so it never touches the user's ~/.cache/mlx-lane/kv, and /admin/cache/clear (RAM only) gives
    a cold server), no embedding model (loading it is 1.7 s of every start on a 2-core CPU, ~70 s over the
    suite; the tests of /v1/embeddings ask for it) and, in the suite, WARM_UP_UNLESS_NAMED."""
    if not _mentions_ssd(args, env):
        args = (*args, "--no-ssd-cache")
    if WARM_UP_UNLESS_NAMED and "--warm-up" not in args and "MLX_LANE_WARM_UP" not in env:
        args = (*args, "--warm-up", WARM_UP_UNLESS_NAMED)
    return without_embeddings_unless_asked(args, env)


def without_embeddings_unless_asked(args: tuple, env: dict) -> tuple:
    if "--embedding-model" not in args and "MLX_LANE_EMBEDDING_MODEL" not in env:
        args = (*args, "--embedding-model", "none")
    return tuple(args)


def entry_module(env: dict) -> str:
    """``server.cli``, or the launcher with test seams (tests/seamed_server.py) when the environment asks for one."""
    from tests.seamed_server import wanted

    return "tests.seamed_server" if wanted(env) else "server.cli"


def _children(pid: int) -> list[int]:
    """The direct children of process ``pid`` (Linux /proc), or ``pid`` itself when it has none."""
    try:
        found = [int(x) for t in Path(f"/proc/{pid}/task").iterdir()
                 for x in (t / "children").read_text().split()]
    except OSError:
        found = []
    return found or [pid]


class ServerProc:
    """A live server. ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, *args: str, env: dict | None = None, startup_timeout: float = 180.0,
                 cwd: Path | None = None, prefix: tuple[str, ...] = ()):
        """``cwd``: the checkout whose ``server`` package runs (default: this one; a benchmark may start another);
        ``prefix``: a launcher the server runs under (a profiler: ``ncu ...``), which ``stop`` leaves to end by
        itself once the server it started has stopped (so it writes its report)."""
        self.prefix = tuple(prefix)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path("mlx-lane-")
        full_env = server_env(env)
        args = flags_for_tests(args, full_env)
        module, argv = entry_module(full_env), ["serve", "--port", str(self.port), *args]
        self._log = open(self.log_path, "wb")
        here = Path(__file__).resolve().parents[1]
        forked = None
        if FORK_SERVER and not self.prefix and (cwd is None or Path(cwd).resolve() == here):
            from tests import forkserver  # the suite's servers: forked with the imports done (its docstring says why)

            forked = forkserver.spawn(module, argv, full_env, here, self.log_path, server_env())
        self.proc = forked or subprocess.Popen([*self.prefix, sys.executable, "-m", module, *argv], stdout=self._log,
                                               stderr=subprocess.STDOUT, env=full_env, cwd=cwd or here)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError(f"server did not become ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]

    def kill(self) -> int:
        """SIGKILL: no shutdown code runs (a crash, as far as the cache is concerned)."""
        self.proc.kill()
        self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            # under a launcher the server is its child: SIGTERM goes to the server, and the launcher ends after it
            for pid in _children(self.proc.pid) if self.prefix else [self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
