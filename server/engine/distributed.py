"""One model over several processes: the MLX distributed group and the few collectives the lane needs.

``mlx-lane serve`` started under ``mlx.launch`` (MLX_RANK and the backend's variables in the environment) finds a
group of more than one process; ``init_group`` returns a ``Group`` then, None for a plain single process (every
distributed hook stays out of the way). Rank 0 serves HTTP and leads the lane; every other rank follows it
(server.lane.replay).

Every collective here is an ``all_sum`` in which rank 0 contributes the value and the others zeros: a broadcast
from rank 0 in one collective, which every MLX backend has (ring, NCCL, MPI, JACCL). They run on the lane's
stream (``bind``), the stream that also carries the sharded model's own collectives: MLX executes one stream's
work in order, so every rank sees the collectives in the same order as long as it issues the same calls.

Debugging a hang or a garbled plan: `mlx-lane serve --debug-trace-collectives` (``trace_collectives(True)``) logs
every collective of this module with its sequence number, shape and caller on every rank (the n-th lines of two
ranks must match).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

log = logging.getLogger("mlx_lane.distributed")

_INLINE = 4096  # bytes of a broadcast's first collective: a tick plan usually fits, so one collective per tick
_LEN = 4  # its first bytes: the payload length (little endian)

MODES = ("tensor", "pipeline")
_TRACE = False  # trace_collectives


def trace_collectives(on: bool) -> None:
    """Log every collective (see the module docstring); server.serve sets it from --debug-trace-collectives."""
    global _TRACE
    _TRACE = bool(on)


@dataclass
class Group:
    """This process's place in the group (``size`` > 1) and the broadcasts the lane uses."""

    group: object  # mx.distributed.Group
    rank: int
    size: int
    mode: str  # "tensor" | "pipeline"
    backend: str
    stream: Optional[object] = None  # the lane's MLX stream (bind)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def bind(self, stream) -> None:
        """Run this group's collectives on ``stream`` (the lane's, which also runs the model)."""
        self.stream = stream

    def shard_fingerprint(self, fingerprint: str, rank: Optional[int] = None) -> str:
        """The fingerprint of one rank's shard of the model (hex, like every fingerprint): it namespaces that
        rank's KV, so the RAM tier, the SSD directory (``<cache_dir>/<shard fingerprint>/``) and the header of
        every cache file name the shard, and no file of one rank, split or single process can seed another."""
        rank = self.rank if rank is None else rank
        return hashlib.sha256(f"{fingerprint}\0shard\0{self.mode}\0{self.size}\0{rank}".encode()).hexdigest()

    def shard_manifest(self, fingerprint: str) -> dict:
        """What ``shard.json`` in each rank's SSD directory says: an entry is restored only from the files of
        every rank, and these are the directories that hold them."""
        return {"model_fingerprint": fingerprint, "mode": self.mode, "world_size": self.size, "rank": self.rank,
                "ranks": [self.shard_fingerprint(fingerprint, r) for r in range(self.size)]}

    def describe(self) -> dict:
        return {"world_size": self.size, "rank": self.rank, "mode": self.mode, "backend": self.backend}

    # -- collectives ----------------------------------------------------------------------------
    def _sum(self, x: mx.array) -> mx.array:
        if _TRACE:
            import traceback
            self._n = getattr(self, "_n", 0) + 1
            log.warning("collective %d %s %s <- %s", self._n, x.shape, x.dtype,
                        " / ".join(f"{f.name}:{f.lineno}" for f in traceback.extract_stack()[-6:-1]))
        if self.stream is None:
            out = mx.distributed.all_sum(x, group=self.group)
        else:
            with mx.stream(self.stream):
                out = mx.distributed.all_sum(x, group=self.group)
        mx.eval(out)
        return out

    def share_bytes(self, data: Optional[bytes]) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None). One collective when it fits in 4 KiB."""
        if self.leader:
            payload = data or b""
            head = bytearray(_INLINE)
            head[:_LEN] = len(payload).to_bytes(_LEN, "little")
            inline = payload[: _INLINE - _LEN]
            head[_LEN : _LEN + len(inline)] = inline
            buf = mx.array(np.frombuffer(bytes(head), dtype=np.uint8))
        else:
            buf = mx.zeros((_INLINE,), dtype=mx.uint8)
        got = np.array(self._sum(buf)).tobytes()
        n = int.from_bytes(got[:_LEN], "little")
        if n <= _INLINE - _LEN:
            return got[_LEN : _LEN + n]
        if self.leader:
            rest = mx.array(np.frombuffer(payload, dtype=np.uint8))
        else:
            rest = mx.zeros((n,), dtype=mx.uint8)
        return np.array(self._sum(rest)).tobytes()

    def share_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (the others' arguments are ignored)."""
        return int(self._sum(mx.array([int(value) if self.leader else 0], dtype=mx.int64)).item())

    def count(self, flag: bool) -> int:
        """How many ranks passed True."""
        return int(self._sum(mx.array([1 if flag else 0], dtype=mx.int32)).item())

    def open_doorbell(self):
        """Every rank at the same point: the socket rank 0 wakes resting followers with
        (``server.engine.doorbell.Doorbell``), or None on every rank where the group cannot have one."""
        from server.engine.doorbell import Doorbell

        return Doorbell.open(self)

    def same_seed(self) -> int:
        """Seed MLX's global random state with rank 0's seed on every rank: unseeded sampling draws the same
        numbers everywhere (each rank samples from the same logits; see server.lane.replay)."""
        seed = self.share_int(int.from_bytes(os.urandom(4), "little"))
        mx.random.seed(seed)
        return seed


def world_size() -> int:
    """Processes in the group this process was launched in (1 without mlx.launch). Never starts a backend when
    nothing says one was asked for."""
    if not any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return 1
    return mx.distributed.init().size()


def init_group(mode: str = "tensor", backend: str = "any") -> Optional[Group]:
    """The group when this process was launched as one of several (``mlx.launch``), else None."""
    if mode not in MODES:
        raise ValueError(f"unknown sharding mode {mode!r}; use one of {', '.join(MODES)}")
    if world_size() == 1:
        return None
    group = mx.distributed.init(backend=backend)
    used = backend if backend != "any" else _backend_name()
    g = Group(group, group.rank(), group.size(), mode, used)
    log.info("distributed: rank %d of %d (%s-parallel, %s backend)", g.rank, g.size, mode, used)
    return g


def _backend_name() -> str:
    """The backend mlx.launch set up, from the variables it exports."""
    for env, name in (("NCCL_HOST_IP", "nccl"), ("MLX_HOSTFILE", "ring"), ("MLX_IBV_DEVICES", "jaccl"),
                      ("OMPI_COMM_WORLD_RANK", "mpi")):
        if env in os.environ:
            return name
    return "any"
