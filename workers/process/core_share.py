"""Cores shared by the workers of one machine: each engine runs on the machine's cores divided
among the workers that have work now.

On a CPU node, one engine on every core loses ~1/7 of its threads' time at the OpenMP
barriers of a saturated step, and its Python runs on one core while the others wait; two
engines of one thread each deliver more tokens there. Alone, though, a request is served
sooner by an engine on every core. So `pagedserve serve` starts two workers per NUMA node
that share the cores (bench/README.md, "Cores that follow the load"): before each step a
worker counts the workers of its machine that have work, itself included, and runs that step
on `cores // busy` torch threads (at least 1). A worker that goes idle says so, and its peer
takes every core from its next step on.

The board is a small file of fixed slots, one per worker of the machine, mapped into each
worker's memory: a slot holds its owner's pid and, while the owner has work, the monotonic
time (system-wide on Linux) its last step began; 0 while idle. A worker writes only its own
slot, so no lock is taken per step; claiming and freeing a slot take the file's lock. The
last worker out removes the board, and a worker starting removes the boards of apps whose
workers were all killed without closing theirs (`remove_dead_boards`). A slot
whose owner died (its pid gone) is free and not counted; nor is a stamp older than
`STALE_S`, so a hung peer gives its cores back too.

Two workers may briefly run on more threads than the machine has cores: a worker that wakes
while its peer's step is running takes its share at once, and the peer takes its smaller
share from its next step. That lasts at most one step, and never more than the cores plus one
thread per waking worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SLOTS = 64  # workers of one machine that can share its cores
STALE_S = 60.0  # a peer's stamp older than this is not counted (a step never lasts that long)
BOARD_PREFIX = "pagedserve-cores-"
_SLOT = struct.Struct("<qd")  # owner pid, stamp of the last step begun (0.0: idle)


def board_path(namespace: str, node_id: str) -> Path:
    """The board of one app's workers on one machine (in shared memory where there is some)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"{BOARD_PREFIX}{namespace}-{node_id}"


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class CoreShare:
    """One worker's slot on its machine's board (see the module docstring).

    Args:
        path: the board file (created on first use).
        cores: the cores the machine's sharing workers run on.
        clock: the monotonic clock stamps are read from (tests inject one).
        pid: this worker's pid (tests give each share in one process its own).
    """

    def __init__(
        self,
        path: Path,
        cores: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        pid: int | None = None,
    ) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.path, self.cores, self._clock = path, cores, clock
        self.pid = os.getpid() if pid is None else pid
        remove_dead_boards(path.parent, keep=path)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, max(os.fstat(self._fd).st_size, SLOTS * _SLOT.size))
        self._board = mmap.mmap(self._fd, SLOTS * _SLOT.size)
        try:
            self.slot = self._claim()
        except RuntimeError:
            self._board.close()
            os.close(self._fd)
            raise
        self.applied: int | None = None  # torch threads `take_share` last set (None: never)

    def threads_for_step(self) -> int:
        """Stamp this worker busy and return its share: `cores // busy workers`, at least 1."""
        now = self._clock()
        _SLOT.pack_into(self._board, self.slot * _SLOT.size, self.pid, now)
        return max(1, self.cores // self.busy_workers(now))

    def take_share(self) -> int:
        """`threads_for_step`, set as the calling thread's torch threads where it changed.
        Call it on the thread that runs the steps: libgomp keeps a thread count per thread
        that starts parallel work."""
        threads = self.threads_for_step()
        if threads != self.applied:
            import torch  # loaded by the engine already

            torch.set_num_threads(threads)
            self.applied = threads
        return threads

    def busy_workers(self, now: float | None = None) -> int:
        """The workers on the board with work now (this one included where it has)."""
        now = self._clock() if now is None else now
        return sum(1 for slot in range(SLOTS) if self._busy(slot, now))

    def idle(self) -> None:
        """This worker has no work: its peers may take its cores from their next step."""
        _SLOT.pack_into(self._board, self.slot * _SLOT.size, self.pid, 0.0)

    def close(self) -> None:
        """Free the slot; the last worker out removes the board."""
        if self._board.closed:
            return
        with self._locked():
            _SLOT.pack_into(self._board, self.slot * _SLOT.size, 0, 0.0)
            if not any(self._owner(slot) for slot in range(SLOTS)):
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
        self._board.close()
        os.close(self._fd)

    def _busy(self, slot: int, now: float) -> bool:
        pid, stamp = _SLOT.unpack_from(self._board, slot * _SLOT.size)
        return pid != 0 and stamp > 0.0 and now - stamp < STALE_S and _alive(pid)

    def _owner(self, slot: int) -> int:
        return _SLOT.unpack_from(self._board, slot * _SLOT.size)[0]

    def _claim(self) -> int:
        """A free slot (never used, or its owner's process gone), now this worker's."""
        with self._locked():
            for slot in range(SLOTS):
                owner = self._owner(slot)
                if owner == 0 or (owner != self.pid and not _alive(owner)):
                    _SLOT.pack_into(self._board, slot * _SLOT.size, self.pid, 0.0)
                    return slot
        raise RuntimeError(
            f"{SLOTS} workers already share this machine's cores ({self.path}); "
            "set worker_threads to run more"
        )

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def remove_dead_boards(root: Path, keep: Path | None = None) -> list[Path]:
    """Remove the boards in `root` no live worker holds a slot of, older than `STALE_S` (a
    newer one may be a board whose first worker is claiming its slot): those of apps whose
    workers were killed without closing theirs. Returns what was removed."""
    removed = []
    for board in root.glob(f"{BOARD_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            if board == keep or time.time() - board.stat().st_mtime < STALE_S:
                continue
            data = board.read_bytes()
            owners = [
                _SLOT.unpack_from(data, i * _SLOT.size)[0] for i in range(len(data) // _SLOT.size)
            ]
            if not any(owner and _alive(owner) for owner in owners):
                board.unlink()
                removed.append(board)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
