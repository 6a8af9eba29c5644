"""What `pagedserve serve` watches while it runs, and how it ends at once.

- `StopSignals` owns the process's answer to SIGINT and SIGTERM, by the phase it is in.
- `LocalRayWatch` owns knowing whether the Ray cluster the process started still runs: its
  GCS server and raylet are the process's children, so their state says it at once (Ray's
  own client waits up to a minute for a GCS that is gone, then ends the process itself).
  `JoinedRayWatch` does the same for a cluster joined by address, by asking its GCS.
- `end_now_from_a_handler` kills every process under this one (the local Ray) and exits.

The process's life itself (start, serve, stop) is `cluster/serve/process.py`.
"""

from __future__ import annotations

import enum
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

# The Ray daemons that make a local cluster: one of them gone, the cluster is gone.
RAY_DAEMONS = ("gcs_server", "raylet")


class Interrupted(BaseException):  # noqa: N818 (a signal's arrival, not an error)
    """A stop signal arrived while the process checked its config (no Ray yet): the checks
    are abandoned. BaseException, like KeyboardInterrupt, so that no `except Exception` of
    the checks swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Phase(enum.Enum):
    """Where the process is, for what a signal does there."""

    CHECKING = "checking"  # no Ray yet: the checks are abandoned (`Interrupted`)
    STARTING = "starting"  # Ray, workers, Serve: the start is abandoned, at once
    SERVING = "serving"  # the first signal asks for the clean stop
    STOPPING = "stopping"  # the clean stop: a second signal ends the process at once
    ENDING = "ending"  # ending Ray: a signal ends the process at once


class StopSignals:
    """Owns the process's answer to SIGINT and SIGTERM (both alike), by `phase`.

    Serving, the first signal sets `requested`, and the serve loop stops cleanly. Checking,
    a signal raises `Interrupted`. Anywhere else (starting, or a second signal) the process
    ends at once, from the handler: every process under it (the local Ray cluster) is
    killed, one line says so, and it exits with 128 + the signal. Not by raising into the
    main thread: there it lands inside Ray's client calls, which turn it into a SystemError.

    Args:
        end_now: how the process ends at once (tests replace it).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, end_now: Callable[[str, int], Any] | None = None) -> None:
        self.requested = threading.Event()
        self.signum: int | None = None
        self.phase = Phase.CHECKING
        self._end_now = end_now or end_now_from_a_handler

    def install(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        self.requested.set()
        if self.phase is Phase.CHECKING:
            raise Interrupted(signum)
        if self.phase is Phase.SERVING and first:
            return
        name = signal.Signals(signum).name + ("" if first else " again")
        what = "stopped while starting" if self.phase is Phase.STARTING else "stopped at once"
        self._end_now(f"pagedserve: {name}: {what}", 128 + signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


def end_now_from_a_handler(line: str, status: int) -> NoReturn:
    """End the process from a signal handler: kill every process under it (no Ray call: the
    main thread may be inside one), write `line` last, exit with `status`."""
    kill_if_running(descendants_now())
    os.write(2, (line + "\n").encode())
    os._exit(status)


class LocalRayWatch:
    """Whether the local Ray cluster this process started still runs (see the module
    docstring). Call `start` right after `ray.init` started it."""

    def __init__(self, proc: Path = Path("/proc"), gcs_address: str | None = None) -> None:
        self._proc = proc
        self._daemons: dict[str, int] = {}
        self.gcs_address = gcs_address  # "host:port", for `lost_or_closed`

    def start(self) -> None:
        self._daemons = {
            comm: pid for pid, (comm, _) in live_children(os.getpid(), self._proc).items()
            if comm in RAY_DAEMONS
        }  # fmt: skip

    def lost(self) -> str | None:
        """The daemon that is gone ("gcs_server exited"), or None while all run."""
        for comm, pid in self._daemons.items():
            state = _state(pid, self._proc)
            if state is None or state in "ZX":
                return f"its {comm} (pid {pid}) exited"
        return None

    def lost_or_closed(self) -> str | None:
        """`lost`, or the GCS refusing connections at its address: a GCS that got SIGTERM
        stops listening at once, and the daemons exit later (the raylet ~10 s later, in runs
        here). Only for a stop: while serving, a refused connection is no proof that the
        cluster is gone."""
        if (lost := self.lost()) is not None or self.gcs_address is None:
            return lost
        if refuses_connections(self.gcs_address):
            return f"its GCS at {self.gcs_address} refuses connections"
        return None


def refuses_connections(address: str) -> bool:
    """Whether `host:port` refuses a TCP connection: proof that nothing listens there. A
    timeout or a bad address proves nothing either way (False)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


class JoinedRayWatch:
    """Whether a Ray cluster joined by address still answers: a GCS call in the background
    every few seconds; no answer for `deadline_s` means lost."""

    def __init__(self, deadline_s: float = 15.0, every_s: float = 2.0) -> None:
        self.deadline_s, self.every_s = deadline_s, every_s
        self._answered = time.monotonic()
        self._error: str | None = None

    def start(self) -> None:
        threading.Thread(target=self._ask, name="ray-watch", daemon=True).start()

    def _ask(self) -> None:
        import ray

        while True:
            try:
                ray.nodes()
            except Exception as error:  # the client gave up: the GCS is gone
                self._error = f"its GCS does not answer ({type(error).__name__})"
                return
            self._answered = time.monotonic()
            time.sleep(self.every_s)

    def lost(self) -> str | None:
        if self._error:
            return self._error
        silent = time.monotonic() - self._answered
        if silent > self.deadline_s:
            return f"its GCS has not answered for {silent:.0f} s"
        return None

    def lost_or_closed(self) -> str | None:
        """During a stop, as `lost`: a joined cluster's GCS answers its own calls or not."""
        return self.lost()


def live_children(pid: int, proc: Path = Path("/proc")) -> dict[int, tuple[str, str]]:
    """This process's live children: pid → (command name, state)."""
    found = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # ended while we looked
        comm = text[text.index("(") + 1 : text.rindex(")")]
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if int(ppid) == pid and state not in "ZX":
            found[int(stat.parent.name)] = (comm, state)
    return found


def _state(pid: int, proc: Path) -> str | None:
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[0]


def descendants_now() -> dict[int, int | None]:
    """Every process under this one (the local Ray cluster it started, nothing else): pid →
    its start time, which tells it from a later process given the same pid."""
    from pagedserve.workers.process.cpu_placement import descendants
    from pagedserve.workers.process.pid_files import process_start_time

    return {pid: process_start_time(pid) for pid in descendants(os.getpid())}


def kill_if_running(processes: dict[int, int | None]) -> None:
    """SIGKILL those of `processes` still running, even those no longer under this one (a
    process whose parent Ray's shutdown ended is handed to init)."""
    from pagedserve.workers.process.pid_files import process_start_time

    for pid, started in processes.items():
        if started is not None and process_start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
