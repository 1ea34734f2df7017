"""Start a real ``mlx-lane serve`` sharded over N processes with ``mlx.launch`` (MLX's ring backend on loopback).

The launcher starts one process per rank; rank 0 serves HTTP. ``stop()`` sends SIGTERM to rank 0 (the group's
shutdown: rank 0 drains, tells the followers to stop, every rank flushes its SSD tier) and waits for the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.serverproc import (entry_module, free_port, free_port_run, log_path, server_env,
                              without_embeddings_unless_asked)

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): a rank's, from ``LaunchedServer.ranks``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mlx_launch() -> list[str]:
    """The ``mlx.launch`` command of this interpreter's mlx (also where mlx is on PYTHONPATH, not installed)."""
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


class LaunchedServer:
    """A live server whose model is sharded over ``n`` processes."""

    def __init__(self, n: int, *args: str, env: dict | None = None, startup_timeout: float = 300.0,
                 backend: str = "ring"):
        self.n = n
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path("mlx-lane-launch-")
        # n processes on one host share its cores: each gets its share of BLAS threads (OpenBLAS's idle threads
        # spin, and on a 2-core machine 3 ranks of 2 threads each made every decode step ~3x slower)
        threads = str(max(1, (os.cpu_count() or 1) // n))
        full_env = server_env({"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", threads),
                               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads), **(env or {})})
        ports = ["--starting-port", str(free_port_run(n))] if backend == "ring" else ["--nccl-port", str(free_port())]
        cmd = [*mlx_launch(), "-n", str(n), "--backend", backend, *ports,
               "--python", sys.executable, "--", "-m", entry_module(full_env), "serve", "--port", str(self.port),
               *without_embeddings_unless_asked(args, full_env)]  # as ServerProc (tests/serverproc.py)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx.launch exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a refused connection costs nothing; a 0.5 s step was 0.25 s lost a start on average
        self.kill()
        raise RuntimeError(f"sharded server did not become ready in {timeout}s:\n{self.log()}")

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the launcher's rank processes."""
        out = {}
        children = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):  # the launcher starts each rank from a thread
            try:
                children += (task / "children").read_text().split()
            except OSError:
                pass
        for pid in map(int, children):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"MLX_RANK="):
                    out[int(item.split(b"=", 1)[1])] = pid
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-30000:]

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM to rank 0; 0 when every rank exited 0 (see exit_status)."""
        if self.proc.poll() is None:
            pid = self.ranks().get(0)
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.exit_status()

    def exit_status(self) -> int:
        """0 when every rank exited 0. mlx.launch itself exits 0 either way; it logs a rank's failure as
        "Node with rank R exited with code C" (or "... was killed")."""
        if self.proc.returncode:
            return self.proc.returncode
        return 1 if "Node with rank" in self.log() else 0

    def kill(self) -> None:
        """SIGKILL to the launcher and every rank (they share the process group the launcher leads)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if not self._log.closed:
            self._log.close()
