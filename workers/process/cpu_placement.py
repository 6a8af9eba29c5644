"""Where a process runs: which CPU cores (the worker's engine on its own, the control plane on
the rest) and at what priority (its niceness).

On a CPU machine the engine's torch threads and the serving processes (router, Serve's proxy
and controller, the prefix index, Ray's daemons) share the cores. Left to the scheduler, any of
them can take a core from one torch thread in the middle of a step, and every other thread of
that step then waits for it at the step's next barrier. Pinning the worker to cores of its own
(`PlacementConfig.worker_cpus`) and the control plane to others (`control_cpus`) keeps the two
apart, as vLLM's CPU engine does (it binds its OpenMP threads to cores and leaves a core to its
front end).

CPU sets are written as Linux CPU lists (`taskset -c`, `/sys/.../cpulist`): `"1"`, `"0-3"`,
`"0,2,4-7"`. A process is pinned whole, every thread it has now (`/proc/<pid>/task`); threads
it starts later (torch's OpenMP pool, executor threads) inherit the mask. Linux only: where
`os.sched_setaffinity` is missing, pinning is refused with a clear error rather than ignored.

Priority: Ray starts every actor process at niceness 15 (`RAY_worker_niceness`), below its own
daemons and below any ordinary process on the machine. The engine then gets the leftovers of
whatever else runs there, while a peer server (vLLM) runs at 0. `set_niceness` sets a
process's niceness, every thread of it (on Linux niceness is per thread); lowering it needs the
privilege to (CAP_SYS_NICE, or root), and without it the process says so and runs on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str, what: str = "cpu list") -> tuple[int, ...]:
    """`"0,2-3"` → `(0, 2, 3)`: sorted, each core once. Raises ValueError naming `what`."""
    cpus: set[int] = set()
    if not text.strip():
        raise ValueError(f"{what} is empty; give cores like '1', '0-3' or '0,2-3'")
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if sep else low
        except ValueError:
            raise ValueError(
                f"{what}: {part.strip()!r} is not a core or a range of cores (like 2 or 0-3)"
            ) from None
        if low < 0 or high < low:
            raise ValueError(f"{what}: {part.strip()!r} is not a range of cores (low-high, >= 0)")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """`(0, 2, 3)` → `"0,2-3"`."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def worker_share(cpus: Sequence[int], index: int, num_workers: int) -> tuple[int, ...]:
    """Worker `index`'s cores when `num_workers` workers on one machine split `cpus`: equal
    consecutive slices, the remainder left to the last. Raises ValueError if some worker would
    get none."""
    if len(cpus) < num_workers:
        raise ValueError(
            f"worker_cpus has {len(cpus)} core(s) for {num_workers} workers: each needs one"
        )
    size = len(cpus) // num_workers
    end = len(cpus) if index == num_workers - 1 else (index + 1) * size
    return tuple(cpus[index * size : end])


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on."""
    if not hasattr(os, "sched_getaffinity"):
        return tuple(range(os.cpu_count() or 1))
    return tuple(sorted(os.sched_getaffinity(0)))


def check_available(cpus: Iterable[int], what: str) -> None:
    """Raise ValueError if any of `cpus` is not a core this machine lets us use."""
    missing = sorted(set(cpus) - set(available_cpus()))
    if missing:
        raise ValueError(
            f"{what} names cores {format_cpu_list(missing)}, which this machine does not have "
            f"(available: {format_cpu_list(available_cpus())})"
        )


def pin_process(cpus: Iterable[int], pid: int | None = None, what: str = "process") -> int:
    """Pin every thread of process `pid` (this one by default) to `cpus`; returns how many
    threads were pinned. A thread that ends meanwhile is skipped."""
    chosen = set(cpus)
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("CPU placement needs Linux (os.sched_setaffinity)")
    check_available(chosen, what)
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    pinned = 0
    for tid in sorted(int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else [pid or 0]:
        try:
            os.sched_setaffinity(tid, chosen)
        except (ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or not ours to move
        pinned += 1
    logger.info("%s (pid %s) pinned to cores %s", what, pid or os.getpid(), format_cpu_list(chosen))
    return pinned


def process_cpus(pid: int | None = None) -> tuple[int, ...]:
    """The cores a process (this one by default) may run on now."""
    return tuple(sorted(os.sched_getaffinity(pid or 0)))


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every live process started under `pid` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return sorted(found)


def set_niceness(nice: int, pid: int | None = None, what: str = "process") -> bool:
    """Set every thread of process `pid` (this one by default) to niceness `nice` (-20..19).
    Returns False, with a warning, where the system refuses (lowering needs privilege)."""
    if not -20 <= nice <= 19:
        raise ValueError(f"niceness must be in -20..19, got {nice}")
    target = pid or os.getpid()
    tasks = Path(f"/proc/{target}/task")
    tids = sorted(int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else [target]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # ended meanwhile
        except PermissionError:
            logger.warning("%s (pid %s): no permission to set niceness %d", what, target, nice)
            return False
    logger.info("%s (pid %s) at niceness %d", what, target, nice)
    return True


def niceness(pid: int | None = None) -> int:
    """A process's niceness now (its main thread's)."""
    return os.getpriority(os.PRIO_PROCESS, pid or 0)


CAP_SYS_NICE = 23  # linux/capability.h


def may_lower_niceness(status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process may lower a niceness (its effective capabilities hold
    CAP_SYS_NICE, which root's do): what a worker started later needs to set `worker_nice`
    below the niceness it inherited."""
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False
