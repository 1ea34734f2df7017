"""N `mlx-lane serve` replicas behind HAProxy, on this machine (`make cluster`; README "More than one machine").

    python deploy/cluster.py --replicas 2 --port 8080                      # 2 replicas + the proxy, Ctrl-C stops all
    python deploy/cluster.py --replicas 2 --port 8080 -- --model default --max-batch 4   # serve flags after --
    python deploy/cluster.py --port 8080 --backend hostA:8081 --backend hostB:8081   # proxy only: replicas elsewhere

The replicas listen on 127.0.0.1, ports --base-port, --base-port + 1, ... and share one SSD cache folder
(--ssd-cache, default mlx-lane's own ~/.cache/mlx-lane/kv): a conversation that moves to another replica restores
its KV from the files the first one wrote. HAProxy (deploy/haproxy.cfg.in, rendered into --run-dir) routes by
session key on a consistent-hash ring, least-connections without a key, and checks /health every second.
`--balance roundrobin` replaces both policies by round-robin (the benchmark's baseline; not for use).

`Cluster` is the same thing as a library (tests and bench/cluster_affinity.py): start, kill -9 a replica, stop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
TEMPLATE = DEPLOY / "haproxy.cfg.in"
BALANCES = {"session": ("hash var(txn.session)", "leastconn"), "roundrobin": ("roundrobin", "roundrobin")}

__all__ = ["Cluster", "render_config", "haproxy_binary", "main"]


class ClusterError(RuntimeError):
    """The proxy or a replica could not start; the message says what to do."""


def haproxy_binary() -> str:
    """The haproxy executable, or ClusterError telling how to install it."""
    path = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
                                           if os.access(p, os.X_OK)), None)
    if path is None:
        raise ClusterError("haproxy is not installed: `sudo apt-get install haproxy` (Debian/Ubuntu, 2.6 or newer), "
                           "or `make haproxy` as root")
    return path


def render_config(backends: list[tuple[str, str]], *, bind: str, run_dir: str | Path, balance: str = "session",
                  hash_balance_factor: int = 0, bufsize: int = 1 << 20, maxconn: int = 512) -> str:
    """haproxy.cfg for `backends` [(name, "host:port")], from deploy/haproxy.cfg.in.

    `hash_balance_factor` > 100 bounds the hash (HAProxy's bounded-load consistent hashing): a replica already
    serving more than factor% of the average load passes a key's request to the next replica on the ring (which
    restores the conversation from the shared SSD folder). 0 leaves affinity unbounded."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(BALANCES)}")
    if hash_balance_factor and hash_balance_factor <= 100:
        raise ValueError("hash_balance_factor must be 0 (off) or above 100 (a percentage of the average load)")
    session, plain = BALANCES[balance]
    bound = (f"    # bounded load: no replica takes more than {hash_balance_factor}% of the average number of requests "
             f"in flight\n    hash-balance-factor {hash_balance_factor}") if hash_balance_factor else \
        "    # unbounded: a key always goes to its replica, however busy (deploy/cluster.py --hash-balance-factor)"
    checked = "\n".join(f"    server {name} {addr}" for name, addr in backends)
    tracked = "\n".join(f"    server {name} {addr} track by_session/{name}" for name, addr in backends)
    values = {"BIND": bind, "RUN_DIR": str(run_dir), "DEPLOY_DIR": str(DEPLOY), "BUFSIZE": str(bufsize),
              "MAXCONN": str(maxconn), "SESSION_BALANCE": session, "PLAIN_BALANCE": plain,
              "SERVERS_CHECKED": checked, "SERVERS_TRACKED": tracked, "HASH_BALANCE": bound}
    text = TEMPLATE.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _http_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Replicas (subprocesses of this process, unless `backends` names running ones) and one HAProxy.

    Ownership: `stop()` ends every process this object started (SIGTERM, then SIGKILL after `timeout`)."""

    def __init__(self, replicas: int = 2, *, port: int | None = None, host: str = "127.0.0.1",
                 base_port: int | None = None, ssd_cache: str | None = None, balance: str = "session",
                 serve_args: tuple[str, ...] = (), env: dict | None = None, run_dir: str | Path | None = None,
                 backends: list[str] | None = None, python: str = sys.executable,
                 hash_balance_factor: int = 0, entry: str = "server.cli") -> None:
        """``entry``: the module each replica runs (``server.cli``; a test runs its seamed launcher)."""
        self.port = port or free_port()
        self.host = host
        self.url = f"http://127.0.0.1:{self.port}" if host in ("127.0.0.1", "0.0.0.0") else f"http://{host}:{self.port}"
        self.balance = balance
        self.hash_balance_factor = hash_balance_factor
        self.serve_args = tuple(serve_args)
        self.ssd_cache = ssd_cache
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.python = python
        self.entry = entry
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="mlx-lane-cluster-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.external = bool(backends)
        if backends:
            self.addrs = list(backends)
        else:
            ports = [base_port + i for i in range(replicas)] if base_port else [free_port() for _ in range(replicas)]
            self.addrs = [f"127.0.0.1:{p}" for p in ports]
        self.names = [f"r{i + 1}" for i in range(len(self.addrs))]
        self.procs: dict[int, subprocess.Popen] = {}
        self.proxy: subprocess.Popen | None = None
        self.config_path = self.run_dir / "haproxy.cfg"

    # ------------------------------------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 300.0) -> Cluster:
        haproxy = haproxy_binary()
        if not self.external:
            for i in range(len(self.addrs)):
                self.start_replica(i)
            for i in range(len(self.addrs)):
                self.wait_replica(i, timeout)
        self.config_path.write_text(render_config(list(zip(self.names, self.addrs)), bind=f"{self.host}:{self.port}",
                                                  run_dir=self.run_dir, balance=self.balance,
                                                  hash_balance_factor=self.hash_balance_factor))
        check = subprocess.run([haproxy, "-c", "-q", "-f", str(self.config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise ClusterError(f"haproxy refused {self.config_path}:\n{check.stdout}{check.stderr}")
        log = open(self.run_dir / "haproxy.log", "wb")
        self.proxy = subprocess.Popen([haproxy, "-W", "-db", "-f", str(self.config_path)], stdout=log,
                                      stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not _http_ok(self.url + "/health"):
            if self.proxy.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"haproxy did not come up on {self.url}:\n{self.log('haproxy')}")
            time.sleep(0.1)
        return self

    def start_replica(self, i: int) -> None:
        host, port = self.addrs[i].rsplit(":", 1)
        args = [self.python, "-m", self.entry, "serve", "--host", host, "--port", port, *self.serve_args]
        if self.ssd_cache and "--ssd-cache" not in self.serve_args and "--no-ssd-cache" not in self.serve_args:
            args += ["--ssd-cache", self.ssd_cache]
        log = open(self.run_dir / f"{self.names[i]}.log", "ab")
        self.procs[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)

    def wait_replica(self, i: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not _http_ok(self.replica_url(i) + "/health"):
            proc = self.procs.get(i)
            if proc is not None and proc.poll() is not None:
                raise ClusterError(f"replica {self.names[i]} exited with {proc.returncode}:\n{self.log(self.names[i])}")
            if time.monotonic() > deadline:
                raise ClusterError(f"replica {self.names[i]} not ready in {timeout:.0f}s:\n{self.log(self.names[i])}")
            time.sleep(0.3)

    def kill(self, i: int) -> None:
        """kill -9 replica i (no shutdown code runs: a crash)."""
        self.procs[i].kill()
        self.procs[i].wait()

    def stop(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM the replicas (they flush their SSD writes) and the proxy; exit codes by name."""
        codes: dict[str, int | None] = {}
        for i, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGTERM)  # master-worker mode: SIGTERM stops it at once
        for name, p in [*((self.names[i], p) for i, p in self.procs.items()), ("haproxy", self.proxy)]:
            if p is None:
                continue
            try:
                codes[name] = p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
        return codes

    # ------------------------------------------------------------------------------------------------- queries

    def replica_url(self, i: int) -> str:
        return f"http://{self.addrs[i]}"

    def index_of(self, name: str) -> int:
        return self.names.index(name)

    def log(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace")[-20000:] if path.exists() else ""

    def server_states(self) -> dict[str, str]:
        """{replica name: "UP" | "DOWN" | ...} of the session backend, from HAProxy's stats socket."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.run_dir / "haproxy.sock"))
            s.sendall(b"show stat\n")
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        lines = raw.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","))) for line in lines[1:] if line]
        return {r["svname"]: r["status"] for r in rows if r.get("pxname") == "by_session" and r["svname"] in self.names}

    def wait_state(self, name: str, state: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.server_states().get(name, "").startswith(state):
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} never became {state}: {self.server_states()}")
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", "2")), help="default 2")
    ap.add_argument("--host", default="127.0.0.1", help="the proxy's bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="the proxy's port (default 8080)")
    ap.add_argument("--base-port", type=int, default=8081, help="first replica's port (default 8081)")
    ap.add_argument("--ssd-cache", default=None, help="the SSD cache folder all replicas share "
                                                      "(default: mlx-lane's, ~/.cache/mlx-lane/kv)")
    ap.add_argument("--balance", choices=sorted(BALANCES), default="session",
                    help="session: consistent hash on the session key, least-connections without one (default); "
                         "roundrobin: the baseline, for comparison")
    ap.add_argument("--hash-balance-factor", type=int, default=0, metavar="PCT",
                    help="bound the session hash: a replica serving more than PCT%% of the average load in flight "
                         "passes new requests to the next replica on the ring (e.g. 150); 0 = unbounded (default)")
    ap.add_argument("--backend", action="append", metavar="HOST:PORT",
                    help="proxy replicas that already run (repeatable); none are started then")
    ap.add_argument("--run-dir", default=None, help="where haproxy.cfg and the logs go (default: a temp folder)")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    cluster = Cluster(args.replicas, port=args.port, host=args.host, base_port=args.base_port,
                      ssd_cache=args.ssd_cache, balance=args.balance, serve_args=tuple(serve_args),
                      run_dir=args.run_dir, backends=args.backend, hash_balance_factor=args.hash_balance_factor)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        print(f"mlx-lane cluster: proxy {cluster.url} -> {', '.join(cluster.addrs)} (balance {args.balance})\n"
              f"  config {cluster.config_path}; logs in {cluster.run_dir}; Ctrl-C stops everything", flush=True)
        while not stopping:
            if cluster.proxy.poll() is not None:
                print(f"haproxy exited with {cluster.proxy.returncode}:\n{cluster.log('haproxy')}", file=sys.stderr)
                return 1
            for i, p in cluster.procs.items():
                if p.poll() is not None:  # a replica died: the proxy routes around it; say so and restart it
                    print(f"replica {cluster.names[i]} exited with {p.returncode}; restarting it", flush=True)
                    cluster.start_replica(i)
            time.sleep(1.0)
        return 0
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        codes = cluster.stop()
        print(f"stopped: {codes}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
