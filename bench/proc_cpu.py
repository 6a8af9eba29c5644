"""CPU seconds each process of a server's session spent over a window, grouped by role.

`bench serve-compare` snapshots the server's session before and after each timed run; the
difference says where the machine's cores went while tokens streamed (the engine, the router,
Serve's proxy and controller, Ray's own daemons), which client-side latencies alone cannot
tell apart. A snapshot holds every live process of the session `start_new_session` opened
for the server (our server's CLI and the local Ray it starts: GCS, raylet, dashboard agents,
Serve's proxy and controller, the actors; or vLLM's API server, engine core and worker) and
every descendant of those that left the session, so nothing the server started is missed. A
process that ended inside the window is counted through its parent's children-time
(`cutime`/`cstime`, which the kernel adds when the parent reaps it) under the role
``(ended)``; one reaped by no process of the snapshot is lost. Linux only (`/proc`);
elsewhere the snapshots are empty.

`engine_split` divides the roles in two: the engine (ours: the `Worker` actor, which holds
the scheduler and the model; vLLM: its `EngineCore` process, its scheduler and engine loop,
and its `Worker` process, the model) and everything outside it.
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
ENDED = "(ended)"
# The roles that are an engine: ours (the worker actor), vLLM's (titled by
# `setproctitle` as `VLLM::EngineCore[_DPn]` and `VLLM::Worker[_TPn...]`), and the `engine`
# arm of `bench serve-compare` (our engine alone, `python -m pagedserve.bench.engine_arrivals`).
ENGINE_ARM_ROLE = "pagedserve.bench.engine_arrivals"
ENGINE_ROLES = ("Worker", ENGINE_ARM_ROLE)
ENGINE_ROLE_PREFIXES = ("VLLM::EngineCore", "VLLM::Worker")


@dataclass(frozen=True)
class ProcCpu:
    """One process's role (see `role_of`) and its CPU seconds (user + system) so far; and
    those of its children it has reaped."""

    role: str
    cpu_s: float
    children_cpu_s: float = 0.0


def role_of(cmdline: str, comm: str) -> str:
    """A short name for what a process does: `Worker`, `Router`, `ProxyActor`, `gcs_server`...

    Ray workers are named by the actor in their title (`ray::Worker.generate` and
    `ray::pagedserve-worker-0:Worker.generate` → `Worker`; a Serve replica
    `ray::ServeReplica:app:Router` → `Router`); an idle pooled Ray worker
    (`ray::IDLE`) is `IDLE`; other processes by their program (`python -m x` → `x`,
    `python -u /ray/_private/log_monitor.py ...` → `log_monitor`).
    """
    match = _RAY_TITLE.match(cmdline)
    if match:
        return match.group(1)
    words = cmdline.split()
    if "-m" in words and words.index("-m") + 1 < len(words):
        return words[words.index("-m") + 1]
    if not words:
        return comm
    program = Path(words[0]).name
    if program.startswith("python"):  # a script: named by it (Ray's monitors and agents)
        script = next((w for w in words[1:] if not w.startswith("-")), "")
        if script.endswith(".py"):
            return Path(script).stem
    return program


def is_engine_role(role: str) -> bool:
    """Whether processes of `role` run an engine (see `ENGINE_ROLES`)."""
    return role in ENGINE_ROLES or role.startswith(ENGINE_ROLE_PREFIXES)


def engine_split(cpu_s: dict[str, float]) -> tuple[float, float]:
    """(engine, everything else) of a `cpu_by_role` result."""
    engine = sum(s for role, s in cpu_s.items() if is_engine_role(role))
    return engine, sum(cpu_s.values()) - engine


@dataclass(frozen=True)
class _Stat:
    ppid: int
    session: int
    cpu_s: float
    children_cpu_s: float
    comm: str


def _read_stats(proc: Path) -> dict[int, _Stat]:
    stats: dict[int, _Stat] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        comm, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        f = fields.split()  # f[0] is field 3 of stat(5): state, ppid, pgrp, session, ...
        if f[0] in ("Z", "X"):
            continue  # its CPU is its parent's to count once reaped
        ticks = [int(x) / _TICKS for x in f[11:15]]  # utime, stime, cutime, cstime
        stats[int(stat.parent.name)] = _Stat(
            int(f[1]), int(f[3]), ticks[0] + ticks[1], ticks[2] + ticks[3], comm
        )
    return stats


def _with_descendants(stats: dict[int, _Stat], session: int) -> set[int]:
    """The session's members, and every descendant of its leader or of a member, wherever
    its session is."""
    children: dict[int, list[int]] = {}
    for pid, s in stats.items():
        children.setdefault(s.ppid, []).append(pid)
    found = {pid for pid, s in stats.items() if s.session == session}
    todo = [session, *found]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found & stats.keys()


def session_cpu(session: int, proc: Path = Path("/proc")) -> dict[int, ProcCpu]:
    """pid → role and CPU seconds of every live process of `session` and of every descendant
    of those (empty off Linux)."""
    stats = _read_stats(proc)
    found: dict[int, ProcCpu] = {}
    for pid in _with_descendants(stats, session):
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        cmdline = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
        s = stats[pid]
        found[pid] = ProcCpu(role_of(cmdline, s.comm), s.cpu_s, s.children_cpu_s)
    return found


def cpu_by_role(before: dict[int, ProcCpu], after: dict[int, ProcCpu]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots, most first, each process under its
    role in `after` (a pooled `IDLE` worker may have become an actor). A process that started
    in between counts from zero; one that ended in between counts under `ENDED`, from what
    its parent reaped less what it had spent before (see the module docstring)."""
    spent: dict[str, float] = {}
    reaped = 0.0
    for pid, now in after.items():
        then = before.get(pid)
        delta = now.cpu_s - (then.cpu_s if then is not None else 0.0)
        spent[now.role] = spent.get(now.role, 0.0) + max(0.0, delta)
        reaped += now.children_cpu_s - (then.children_cpu_s if then is not None else 0.0)
    ended_before = sum(p.cpu_s + p.children_cpu_s for pid, p in before.items() if pid not in after)
    if reaped - ended_before > 0:
        spent[ENDED] = reaped - ended_before
    return dict(sorted(spent.items(), key=lambda item: -item[1]))


def client_cpu_s() -> float:
    """This process's CPU seconds so far (the load client's own share of the machine)."""
    times = os.times()
    return times.user + times.system
