"""CPU seconds each process of a server's session spent over a window, grouped by role.

`bench serve-compare` snapshots the server's session (the processes `start_new_session` put
under it: our server's local Ray, or vLLM's API server and engine core) before and after each
timed run; the difference says where the machine's cores went while tokens streamed (the
engine, the router, Serve's proxy and controller, Ray's own daemons), which client-side
latencies alone cannot tell apart. Linux only (`/proc`); elsewhere the snapshots are empty.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# A Ray worker process names itself `ray::<Class>`, `ray::<Class>.<method>` while it runs one,
# or `ray::<actor name>:<Class>.<method>` (Serve: `ray::ServeReplica:<app>:<Deployment>`): the
# role is the class (the deployment). Everything else is named by its executable.
_RAY_TITLE = re.compile(r"^ray::(?:[^:\s]+:)*([A-Za-z_]\w*)")


@dataclass(frozen=True)
class ProcCpu:
    """One process's role (see `role_of`) and its CPU seconds (user + system) so far."""

    role: str
    cpu_s: float


def role_of(cmdline: str, comm: str) -> str:
    """A short name for what a process does: `Worker`, `Router`, `ProxyActor`, `gcs_server`...

    Ray workers are named by the actor in their title (`ray::Worker.generate` and
    `ray::pagedserve-worker-0:Worker.generate` → `Worker`; a Serve replica
    `ray::ServeReplica:app:Router` → `Router`); an idle pooled Ray worker
    (`ray::IDLE`) is `IDLE`; other processes by their program (`python -m x` → `x`).
    """
    match = _RAY_TITLE.match(cmdline)
    if match:
        return match.group(1)
    words = cmdline.split()
    if "-m" in words and words.index("-m") + 1 < len(words):
        return words[words.index("-m") + 1]
    if words:
        return Path(words[0]).name
    return comm


def session_cpu(session: int, proc: Path = Path("/proc")) -> dict[int, ProcCpu]:
    """pid → role and CPU seconds of every live process of `session` (empty off Linux)."""
    found: dict[int, ProcCpu] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (
                (stat.parent / "cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode("utf-8", "replace")
            )
        except OSError:
            continue  # exited while we looked
        comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        fields = rest.split()
        if int(fields[3]) != session:  # fields[3] is the session id (field 6 of stat)
            continue
        cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        found[int(stat.parent.name)] = ProcCpu(role_of(cmdline.strip(), comm), cpu_s)
    return found


def cpu_by_role(before: dict[int, ProcCpu], after: dict[int, ProcCpu]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots, most first, each process under its
    role in `after` (a pooled `IDLE` worker may have become an actor). A process that started
    in between counts from zero; one that ended in between is lost (it is not in `after`)."""
    spent: dict[str, float] = {}
    for pid, now in after.items():
        then = before.get(pid)
        delta = now.cpu_s - (then.cpu_s if then is not None else 0.0)
        spent[now.role] = spent.get(now.role, 0.0) + max(0.0, delta)
    return dict(sorted(spent.items(), key=lambda item: -item[1]))


def client_cpu_s() -> float:
    """This process's CPU seconds so far (the load client's own share of the machine)."""
    times = os.times()
    return times.user + times.system
