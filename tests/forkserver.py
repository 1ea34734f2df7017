"""A fork server for the suite's test servers: the third-party imports of a server start, paid once per pytest worker.

Why: a test server on this 2-core CPU costs 3-4.5 s of CPU to be ready, ~2 s of it importing mlx-lm (which imports
transformers), FastAPI, uvicorn and pydantic, and the suite starts ~85 of them. Forked from here, the same server was
ready after 2.0-2.3 s of its own CPU instead of 4.4-4.6 s (3 starts each way, alternated, 2026-12-07).
``ServerProc`` (tests/serverproc.py) asks this process, started once per pytest worker with the servers' own
environment, to fork a child that runs
``python -m <entry> serve ...`` as the subprocess would: the child takes the test's environment, working directory,
argv and log file, then runs the entry module as ``__main__``. Only third-party modules are imported here: every
module of this project is imported by the child, after its environment is in place (they read MLX_LANE_* at
import), and nothing here starts a thread (a forked child has only the thread that forked).

Protocol (a Unix socket, one JSON line each way): ``{"argv": [...], "env": {...}, "cwd": ..., "log": path,
"module": ...}`` -> ``{"pid": n}``; when the child ends, this process reaps it and writes its exit status (Popen's
convention: -N for a signal) to ``<log>.exit``, which ``ForkedProcess`` reads. The server exits when its parent (the
pytest worker) has gone. tests/conftest.py turns it on (``serverproc.FORK_SERVER``); MLX_LANE_TEST_FORK_SERVER=0
keeps it off (every server a fresh interpreter, as a user's).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# What a server start imports from other projects, heaviest first (python -X importtime, 2026-12-07: mlx_lm's
# package init imports mlx_lm.convert -> utils -> tokenizer_utils -> transformers, ~1.1 s; fastapi 0.27 s)
PRELOAD = ("mlx.core", "mlx.nn", "mlx_lm", "mlx_lm.models.cache", "mlx_lm.generate", "mlx_lm.sample_utils",
           "mlx_lm.tokenizer_utils", "transformers", "fastapi", "fastapi.responses", "starlette", "uvicorn",
           "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.http.httptools_impl",
           "uvicorn.protocols.websockets.websockets_sansio_impl", "pydantic", "orjson", "safetensors", "jinja2",
           "prometheus_client", "httpx", "numpy")


def _exit_status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(req: dict) -> None:
    """In the forked child: become the server the request describes; never returns."""
    code = 1
    try:
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = [req["module"], *req["argv"]]
        import runpy

        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # an optional one (httptools...): the child imports what it needs itself
            pass
    if len(os.listdir("/proc/self/task")) > 1:  # a thread (MLX starts one at its first evaluation) would be lost
        print("threads: not forking", flush=True)
        return
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    logs: dict[int, str] = {}
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener], [], [], 0.05)
        while logs:  # reap: each child's exit status beside its log
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            log = logs.pop(pid, None)
            if log is not None:
                Path(log + ".exit.tmp").write_text(str(_exit_status(status)))
                os.replace(log + ".exit.tmp", log + ".exit")
        if os.getppid() != parent:
            return
        if not readable:
            continue
        conn, _ = listener.accept()
        with conn, conn.makefile("rwb") as f:
            req = json.loads(f.readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(req)
            logs[pid] = req["log"]
            f.write(json.dumps({"pid": pid}).encode() + b"\n")
            f.flush()


class ForkedProcess:
    """The part of ``subprocess.Popen`` the suite uses, for a server forked by the fork server."""

    def __init__(self, pid: int, log: str, args: list):
        self.pid, self.args, self._exit, self.returncode = pid, args, Path(log + ".exit"), None

    def poll(self):
        if self.returncode is None and self._exit.exists():
            self.returncode = int(self._exit.read_text())
            self._exit.unlink(missing_ok=True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server: dict = {}


def _stop(proc: subprocess.Popen, folder: str) -> None:
    """At the test process's exit: the fork server goes (its servers were stopped by their tests) and its folder."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(folder, ignore_errors=True)


def spawn(module: str, argv: list, env: dict, cwd: Path, log: Path, server_environment: dict) -> ForkedProcess | None:
    """A server forked by this worker's fork server (started on first use with ``server_environment``), or None when
    it is off or could not start (the caller starts a subprocess instead)."""
    if _server.get("broken"):
        return None
    if _server.get("pid") != os.getpid():  # none yet in this process (or one inherited across a fork)
        folder = tempfile.mkdtemp(prefix="mlx-lane-forkserver-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", path], env=server_environment,
                                cwd=str(Path(__file__).resolve().parents[1]), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=open(os.path.join(folder, "log"), "wb"))
        ready = proc.stdout.readline() if proc.stdout is not None else b""
        if ready.strip() != b"ready":
            proc.kill()
            _server["broken"] = True
            return None
        _server.update(pid=os.getpid(), path=path, proc=proc)
        atexit.register(_stop, proc, folder)
    request = {"module": module, "argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, s.makefile("rwb") as f:
            s.connect(_server["path"])
            f.write(json.dumps(request).encode() + b"\n")
            f.flush()
            pid = json.loads(f.readline())["pid"]
    except (OSError, ValueError, KeyError):  # the fork server is gone: this and later servers start as subprocesses
        _server["broken"] = True
        return None
    return ForkedProcess(pid, str(log), [module, *argv])


if __name__ == "__main__":
    serve(sys.argv[1])
