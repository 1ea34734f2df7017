"""The servers a benchmark compares, behind one interface: start, url, pid, restart, peak RSS, stop.

    ours       `mlx-lane serve` on the converted default model (tests.serverproc.ServerProc); with `persistent`
               its SSD tier on a directory of the run (a restart restores from it)
    mlx_lm     `python -m mlx_lm server` on the same converted directory, OpenBLAS preloaded as for ours
    llama_cpp  llama.cpp's server through llama-cpp-python[server] (bench/llamacpp_peer.sh builds it once, ~19 min)
               on the original GGUF of the default model (SmolLM2 Q4_1), all cores, n_ctx 8192, its prompt cache
               on (`--cache true`); with `persistent`, `--cache_type disk` in a directory of the run

Peak RSS is the kernel's high-water mark (VmHWM) of each server process, read just before it stops; over
restarts the maximum is kept. Its /health is 404, so llama.cpp's readiness is probed on /v1/models.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, ServerProc, free_port

LLAMACPP_SCRIPT = ROOT / "bench" / "llamacpp_peer.sh"
LABELS = {"ours": "mlx-lane", "mlx_lm": "mlx_lm.server", "llama_cpp": "llama.cpp server (llama-cpp-python)",
          "ours_warmers": "mlx-lane --kernel-warmers auto"}
# variants of ours, each under its name with a home of its own (bench/single_request.py --servers ours,ours_warmers)
OURS_VARIANTS: dict[str, tuple[str, ...]] = {
    "ours_warmers": ("--kernel-warmers", "auto"),  # helper processes compiling the warm-up's kernels (issue 45)
}
ALL = tuple(LABELS)


def vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{url} did not answer 200 within {timeout}s")


class Peer:
    """One server under test. `start()` blocks until it answers; `restart()` = stop + start, timed."""

    name = ""

    def __init__(self, workdir: Path, persistent: bool = False):
        self.workdir = workdir
        self.persistent = persistent
        self.url = ""
        self.peak_rss_mib: float | None = None
        self.restarts: list[float] = []

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def start(self) -> None:
        raise NotImplementedError

    def pid(self) -> int | None:
        raise NotImplementedError

    def _stop(self) -> int:
        raise NotImplementedError

    def stop(self) -> int:
        pid = self.pid()
        if pid is not None:
            hwm = vm_hwm_mib(pid)
            if hwm is not None:
                self.peak_rss_mib = max(self.peak_rss_mib or 0.0, hwm)
        return self._stop()

    def restart(self) -> float:
        """Stop gracefully (SIGTERM: ours flushes its SSD tier) and start again; seconds until it answers."""
        self.stop()
        t = time.perf_counter()
        self.start()
        dt = time.perf_counter() - t
        self.restarts.append(round(dt, 2))
        return dt

    def exit_code(self) -> int | None:
        """The exit status of a server process that has ended (negative: killed by that signal)."""
        proc = getattr(self, "proc", None)
        proc = getattr(proc, "proc", proc)  # Ours wraps a ServerProc
        return proc.poll() if proc is not None else None

    def rss_now_mib(self) -> float | None:
        pid = self.pid()
        return vm_hwm_mib(pid) if pid else None


class Ours(Peer):
    name = "ours"

    def __init__(self, workdir: Path, model_dir: Path, persistent: bool = False, extra: tuple[str, ...] = (),
                 env: dict | None = None, name: str = "ours"):
        super().__init__(workdir, persistent)
        self.name = name  # a variant's name keeps a home of its own: no variant finds another's kernels
        self.model_dir = model_dir
        self.extra = extra
        self.env = env or {}  # more environment for the server (e.g. MLX_LANE_ATTENTION=mlx: `--attention mlx`)
        self.prefix: tuple[str, ...] = ()  # a launcher it runs under (bench/gpu_agents.py --ncu-ours: Nsight Compute)
        self.proc: ServerProc | None = None
        # start() returns once the warm-up that runs behind the first requests (--warm-up behind) is done too, so a
        # workload measures a warm server, as it did when the warm-up ran before ready; a start-up benchmark sets it
        # False to time what a user gets: the port open, the warm-up still to run
        self.wait_warm = True
        self.healthy_s: float | None = None
        self.warm_s: float | None = None

    def start(self) -> None:
        ssd = ("--ssd-cache", str(self.workdir / "ours-kv")) if self.persistent else ("--no-ssd-cache",)
        # the run's own MLX_LANE_HOME: measured cache rates persist across its restarts, never the user's
        # no /v1/embeddings: a fresh home would fetch its model from PyPI at every start, and no benchmark uses it
        env = {"MLX_LANE_HOME": str(self.workdir / f"{self.name}-home"), "MLX_LANE_EMBEDDING_MODEL": "none", **self.env}
        t = time.perf_counter()
        self.proc = ServerProc("--model", str(self.model_dir), "--log-level", "warning", *ssd, *self.extra,
                               env=env, startup_timeout=300, prefix=self.prefix)
        self.url = self.proc.url
        self.healthy_s = time.perf_counter() - t  # launch to the port answering /health
        if self.wait_warm:
            self._wait_warm()
        self.warm_s = time.perf_counter() - t if self.wait_warm else None  # launch to the warm-up done

    def _wait_warm(self, timeout: float = 300) -> None:
        """Until /health says ``warm`` (no warm-up step left: done, failed or off)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health", timeout=5).json().get("warm"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.url}: the warm-up did not finish within {timeout}s")

    def pid(self) -> int | None:
        return self.proc.proc.pid if self.proc and self.proc.proc.poll() is None else None

    def _stop(self) -> int:
        return self.proc.stop(timeout=120) if self.proc else 0


class _Popen(Peer):
    """A peer that is a plain subprocess with a log file."""

    def __init__(self, workdir: Path, persistent: bool = False):
        super().__init__(workdir, persistent)
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None  # the server's stdout + stderr, once started

    def _spawn(self, cmd: list[str], env: dict, ready_path: str, cwd: Path | None = None) -> None:
        port = free_port()
        cmd = [c.replace("{port}", str(port)) for c in cmd]
        log = Path(tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")[1])
        self.log_path = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.url = f"http://127.0.0.1:{port}"
        _wait_http(self.url + ready_path, self.proc, log)

    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    def _stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class MlxLm(_Popen):
    name = "mlx_lm"

    def __init__(self, workdir: Path, model_dir: Path, persistent: bool = False, extra: tuple[str, ...] = (),
                 env: dict | None = None):
        super().__init__(workdir, persistent)
        self.model_dir = model_dir
        self.extra = extra
        self.env = env or {}  # more environment for the server (e.g. MLX_PTX_CACHE_DIR: a kernel cache of its own)

    def start(self) -> None:
        from models.runtime import blas_preload_env, find_openblas

        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        lib = find_openblas()
        if lib:
            env = blas_preload_env(env, lib)
        self._spawn([sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model_dir), "--port", "{port}",
                     "--log-level", "WARNING", *self.extra], env, "/health")


class LlamaCpp(_Popen):
    name = "llama_cpp"

    def __init__(self, workdir: Path, gguf: Path, persistent: bool = False, python: str | None = None,
                 extra: tuple[str, ...] = ()):
        super().__init__(workdir, persistent)
        self.gguf = gguf
        self.python = python or llamacpp_python()
        self.extra = extra

    def start(self) -> None:
        threads = str(os.cpu_count() or 1)  # its default is half the cores; MLX uses all of them
        cmd = [self.python, "-m", "llama_cpp.server", "--model", str(self.gguf), "--host", "127.0.0.1",
               "--port", "{port}", "--n_ctx", "8192", "--n_threads", threads, "--n_threads_batch", threads,
               "--cache", "true", "--verbose", "false"]
        if self.persistent:
            cmd += ["--cache_type", "disk"]  # LlamaDiskCache under ./.cache/llama_cache of its working dir
        cmd += list(self.extra)
        cwd = self.workdir / "llama-cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        self._spawn(cmd, dict(os.environ, PYTHONUNBUFFERED="1"), "/v1/models", cwd=cwd)


def llamacpp_python() -> str:
    """The llama.cpp peer's python (built once by bench/llamacpp_peer.sh; ~19 min the first time)."""
    out = subprocess.run(["bash", str(LLAMACPP_SCRIPT)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def default_paths() -> tuple[Path, Path]:
    """(converted default model dir, its original GGUF)."""
    from models.loading.default import ensure_default_model
    from models.loading.packaged import packaged_paths

    model_dir = Path(ensure_default_model(False))
    gguf = packaged_paths(model_dir.name)[0]
    return model_dir, gguf


def make(names: list[str], workdir: Path, persistent: bool = False,
         extra: dict[str, tuple[str, ...]] | None = None, model_dir: Path | None = None) -> list[Peer]:
    """The named peers (not started yet); `extra` maps a name to command-line arguments appended to its server's;
    `model_dir`: an MLX model directory instead of the default model (then llama.cpp, which needs its GGUF, is out)."""
    if model_dir is not None:
        if "llama_cpp" in names:
            raise SystemExit("llama_cpp runs the default model's GGUF only: leave it out with --model")
        gguf = None
    else:
        model_dir, gguf = default_paths()
    extra = extra or {}
    out: list[Peer] = []
    for n in names:
        if n == "ours":
            out.append(Ours(workdir, model_dir, persistent, extra=tuple(extra.get(n, ()))))
        elif n in OURS_VARIANTS:
            out.append(Ours(workdir, model_dir, persistent, extra=OURS_VARIANTS[n] + tuple(extra.get(n, ())), name=n))
        elif n == "mlx_lm":
            out.append(MlxLm(workdir, model_dir, persistent, extra=tuple(extra.get(n, ()))))
        elif n == "llama_cpp":
            out.append(LlamaCpp(workdir, gguf, persistent, extra=tuple(extra.get(n, ()))))
        else:
            raise SystemExit(f"unknown server {n!r}: choose from {', '.join(ALL)}")
    return out
