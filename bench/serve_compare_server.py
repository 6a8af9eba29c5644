"""The servers of `bench serve-compare`: one process and the session it leads, start to stop.

Each server runs in a session of its own (`start_new_session`): started, polled until
``GET /v1/models`` answers, and stopped (SIGTERM, SIGKILL to its process group after
`STOP_GRACE_S`), then waited for until no process of its session is left (our server's local
Ray included) before the next one starts, so that nothing of one arm shares the cores with
the next. The session is also what `proc_cpu` snapshots: every process the server started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

STOP_GRACE_S = 60.0  # SIGTERM, then this long before SIGKILL


class ServerFailed(RuntimeError):
    """A server exited or never answered; the message carries its log's tail."""


class Server:
    """One server process and the session it leads, which it owns: started, polled until it
    serves, and stopped with every process it started (our server's local Ray included)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], cwd: str,
                 port: int, log_path: Path, ready_path: str = "/v1/models") -> None:  # fmt: skip
        self.name = name
        self.ready_path = ready_path  # answers 200 once it serves (`/health`: with auth on)
        self.command = command
        self.env = env
        self.cwd = cwd
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._process: subprocess.Popen | None = None

    @property
    def session(self) -> int | None:
        """The session (and process group) the server leads, while it runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        with open(self.log_path, "w", encoding="utf-8") as log:  # the child keeps its own fd
            self._process = subprocess.Popen(
                self.command, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_serving(self, timeout_s: float) -> float:
        """Polls ``GET /v1/models`` (`ready_path`) until it answers 200; returns the seconds
        that took."""
        assert self._process is not None, "not started"
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self._process.poll() is not None:
                raise self._failed(f"exited (code {self._process.returncode}) while starting")
            try:
                with urllib.request.urlopen(self.base_url + self.ready_path, timeout=5) as reply:
                    if reply.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass  # not listening yet (or answering 503 while it loads)
            time.sleep(1.0)
        raise self._failed(f"did not serve within {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM to the server, SIGKILL to its group after `STOP_GRACE_S`; returns once no
        process of its session is left.

        SIGTERM goes to the server alone, not its group: our server's group holds Ray's GCS
        and raylet, and killing them under it made its Serve shutdown hang until SIGKILL. Ray
        puts each of its workers in a group of their own, but they stay in the session
        `start_new_session` opened: the session is what is waited for, so that none of them
        shares the CPUs with the next arm.
        """
        process, self._process = self._process, None
        if process is None:
            return
        session = process.pid  # a session (and group) leader: its pid names both
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"  the {self.name} server outlived SIGTERM by {STOP_GRACE_S:.0f} s: SIGKILL")
            _signal_group(session, signal.SIGKILL)
            process.wait()
        if _session_gone(session, STOP_GRACE_S):
            return
        left = session_members(session)
        print(f"  the {self.name} server's processes {left} outlived it: SIGKILL")
        for pid in left:  # what outlived its parent's shutdown
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not _session_gone(session, 10.0):
            left = session_members(session)
            print(f"WARNING: the {self.name} server left processes {left}", flush=True)

    def _failed(self, what: str) -> ServerFailed:
        try:
            tail = "".join(self.log_path.read_text(errors="replace").splitlines(True)[-40:])
        except OSError:
            tail = "(no log)"
        return ServerFailed(
            f"the {self.name} server {what}; last lines of {self.log_path}:\n{tail}"
        )


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def session_members(session: int) -> list[int]:
    """Live processes (zombies left out) of a session, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # exited while we looked
        state, session_id = fields[0], int(fields[3])
        if session_id == session and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _session_gone(session: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while session_members(session):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
