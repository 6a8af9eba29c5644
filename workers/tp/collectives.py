"""The group's process group: all-reduce and gather over gloo (CPU) or NCCL (GPU).

A process group object of its own (not torch.distributed's process-wide default group), so one
process may hold several groups, e.g. two engines of a test, or an engine started after another
closed, and nothing global is left behind.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
from torch import Tensor

# How long a collective waits for a peer before it fails (a rank that died mid-step fails the
# step at once: its connection closes; this bounds a rank that hangs).
COLLECTIVE_TIMEOUT_S = 120.0
# How long ranks wait for each other to join.
JOIN_TIMEOUT_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the group's rendezvous; rank 0 listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class Collectives:
    """One rank's membership of a group of ``size`` ranks."""

    def __init__(self, backend: str, host: str, port: int, rank: int, size: int) -> None:
        """Join the group (blocks until every rank has joined, at most `JOIN_TIMEOUT_S`).

        Args:
            backend: ``gloo`` or ``nccl``.
            host: rank 0's address; rank 0 serves the rendezvous store on ``port``.
        """
        self.rank = rank
        self.size = size
        # Wall time spent in collectives (waiting for peers included) and their count: what a
        # benchmark reports as the group's communication share.
        self.seconds = 0.0
        self.calls = 0
        self._store = dist.TCPStore(
            host,
            port,
            size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
        )
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(self._store, rank, size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(self._store, rank, size, options)
        else:
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the group, in place; every rank gets the same bits."""
        started = time.perf_counter()
        self._group.allreduce(tensor).wait()
        self._count(started)
        return tensor

    def gather(self, tensor: Tensor) -> list[Tensor] | None:
        """Every rank's ``tensor`` (one shape on all) on rank 0, in rank order; None elsewhere."""
        tensor = tensor.contiguous()
        outputs = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else []
        started = time.perf_counter()
        self._group.gather(outputs, tensor, 0).wait()
        self._count(started)
        return outputs if self.rank == 0 else None

    def _count(self, started: float) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1

    def close(self) -> None:
        """Leave the group (drops the connections)."""
        self._group = None
        self._store = None


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"
