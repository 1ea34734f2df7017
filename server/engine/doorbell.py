"""Rank 0 wakes the followers of a sharded model that rest while the lane is idle: one plain TCP socket per follower.

Why: MLX's ring backend waits for a collective by polling its non-blocking sockets (``SocketThread::worker`` in
mlx/distributed/ring/ring.cpp: ``recv`` until it stops returning EAGAIN), so a follower waiting in the next tick's
broadcast keeps a core busy for as long as rank 0 has nothing to do: 0.6 of a core per follower on this 2-core CPU,
idle, for hours (a Mac in a Thunderbolt ring included). A resting follower blocks in ``recv`` on this socket instead
and costs nothing; rank 0 writes one byte to each before the broadcast that ends the rest (server.lane.replay).

Where rank 0 listens: the address the launcher gave every rank for rank 0 (``mlx.launch``'s ring hostfile, its first
entry; NCCL's ``NCCL_HOST_IP``). Where neither is known (MPI, JACCL, a hand-made group), or a follower cannot connect,
the whole group keeps polling as before: ``open`` agrees on that in three collectives, so no rank rests alone. Each
follower first says a secret rank 0 drew for this start and its rank, so a stranger that connects to the port first
takes no follower's place.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Optional

log = logging.getLogger("mlx_lane.distributed")

CONNECT_TIMEOUT_S = 10.0


def leader_host(environ=os.environ) -> Optional[str]:
    """Rank 0's address as the launcher gave it to every rank, or None."""
    hostfile = environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            text = hostfile if hostfile.lstrip().startswith("[") else open(hostfile).read()
            first = json.loads(text)[0]
            return str(first[0] if isinstance(first, list) else first).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, TypeError):
            return None
    return environ.get("NCCL_HOST_IP") or None


def _accept_followers(server: socket.socket, n: int, secret: int, deadline: float) -> list[socket.socket]:
    """Rank 0: the connections of ``n`` distinct ranks that said ``secret`` before ``deadline`` (fewer on a timeout)."""
    ranks: dict[str, socket.socket] = {}
    while len(ranks) < n and time.monotonic() < deadline:
        server.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn = server.accept()[0]
        except OSError:
            break
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            with conn.makefile("rb") as f:
                said = f.readline(64).decode("ascii", "replace").split()
        except OSError:
            said = []
        if len(said) == 2 and said[0] == str(secret) and said[1] not in ranks:
            ranks[said[1]] = conn
        else:
            conn.close()
    return list(ranks.values())


class Doorbell:
    """Rank 0's sockets to every follower (``ring``), or a follower's socket to rank 0 (``wait``)."""

    def __init__(self, socks: list[socket.socket]):
        self._socks = socks

    @classmethod
    def open(cls, group, timeout: float = CONNECT_TIMEOUT_S) -> Optional["Doorbell"]:
        """Every rank at the same point (three collectives): the doorbell, or None on every rank when one rank has
        none (the group then polls, as MLX's backends do)."""
        host = leader_host()
        socks: list[socket.socket] = []
        if group.leader:
            server = None
            if host:
                try:
                    server = socket.create_server((host, 0))
                except OSError as exc:
                    log.info("no doorbell for the followers (listening on %s: %s): idle followers poll", host, exc)
            group.share_int(server.getsockname()[1] if server is not None else 0)
            # each follower says this start's secret and its rank: a stranger that connects first takes no rank's
            # place (a follower whose connection was never accepted would rest forever)
            secret = group.share_int(int.from_bytes(os.urandom(7), "little"))
            if server is not None:
                with server:
                    socks = _accept_followers(server, group.size - 1, secret, time.monotonic() + timeout)
            mine_failed = len(socks) < group.size - 1
        else:
            port = group.share_int(0)
            secret = group.share_int(0)
            if port and host:
                try:
                    sock = socket.create_connection((host, port), timeout=timeout)
                    sock.sendall(f"{secret} {group.rank}\n".encode())
                    socks.append(sock)
                except OSError as exc:
                    log.info("rank %d: no doorbell from rank 0 (%s:%d: %s): idle, it polls", group.rank, host,
                             port, exc)
            mine_failed = not socks
        if group.count(mine_failed):
            for s in socks:
                s.close()
            return None
        for s in socks:
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(socks)

    def ring(self) -> None:
        """Rank 0: wake every resting follower (one byte each; a follower that is gone fails its own broadcast)."""
        for s in self._socks:
            try:
                s.sendall(b"\1")
            except OSError as exc:
                log.warning("a follower's doorbell failed: %s", exc)

    def wait(self) -> None:
        """A follower: block until rank 0 rings. Raises ConnectionError when rank 0 is gone (its socket closed)."""
        if not self._socks[0].recv(1):
            raise ConnectionError("rank 0 closed the doorbell without a stop message (it exited or was killed)")

    def close(self) -> None:
        for s in self._socks:
            s.close()
