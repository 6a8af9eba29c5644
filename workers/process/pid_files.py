"""Which worker processes run on this machine: one pid file per worker, for `drain-node`.

Each worker writes `<pid_dir>/<worker_id>.pid` as it starts ("pid start_time", the start time
being the kernel's, from /proc/<pid>/stat) and removes it as it exits. A file whose pid is gone,
or now names another process (pids are reused; the start time tells them apart), is stale:
`live_workers` skips and removes it. The directory is node-local (a pod's /tmp), so what
`pagedserve drain-node` finds there are exactly the workers of this node.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PID_DIR = "/tmp/pagedserve/workers"
SUFFIX = ".pid"


@dataclass(frozen=True)
class WorkerProcess:
    """One worker process on this machine, as its pid file names it."""

    worker_id: str
    pid: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    path: Path

    def alive(self) -> bool:
        """Still running, and still the same process (not a reused pid)."""
        return process_start_time(self.pid) == self.start_time


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot); None when there is no such process
    or it is a zombie (exited, not yet reaped: it will never drain)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # field 3, the state
        return None
    return int(fields[19])  # field 22


def register_pid(worker_id: str, pid_dir: str) -> Path:
    """Write this process's pid file for `worker_id`; it is removed when the process exits."""
    pid = os.getpid()
    start_time = process_start_time(pid)
    directory = Path(pid_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{worker_id}{SUFFIX}"
    temporary = path.with_suffix(f".{pid}.tmp")
    temporary.write_text(f"{pid} {start_time}\n")
    temporary.replace(path)  # atomic: a reader never sees half a file
    atexit.register(_remove_if_ours, path, pid)
    return path


def _remove_if_ours(path: Path, pid: int) -> None:
    """Remove the pid file unless a newer incarnation of the worker has replaced it."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        if int(path.read_text().split()[0]) == pid:
            path.unlink()


def live_workers(pid_dir: str) -> list[WorkerProcess]:
    """The worker processes running now whose pid files are in `pid_dir`, by worker id;
    stale files are removed."""
    directory = Path(pid_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        try:
            pid_text, start_text = path.read_text().split()
            worker = WorkerProcess(path.stem, int(pid_text), int(start_text), path)
        except (OSError, ValueError):
            continue  # unreadable or malformed: not ours to judge, leave it
        if worker.alive():
            found.append(worker)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return found
