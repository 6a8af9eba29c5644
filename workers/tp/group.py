"""Rank 0's handle on ranks 1..k-1: start them, send them commands, notice when one dies.

    rank 0 (the engine's process)          rank r (a process `group.py` started)
      TPGroup(...)   ── start, spec ──►      rank_main: join, shard, READY
      TPGroup.send   ── command ──────►      apply (Forward: all-reduce with every rank)
      TPGroup.collect ◄── reply ───────      (ExportBlocks)
      TPGroup.close  ── Stop ─────────►      exit

A rank that exits, a pipe that breaks or a collective that fails raises `TPGroupFailed` and
stops every rank: the engine above then fails as a whole (its worker goes down and its requests
replay on a peer, as for any worker that dies), so a group never half-serves.
"""

from __future__ import annotations

import logging
import pickle
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection, Listener

from pagedserve.workers.tp.protocol import READY, RankCommand, RankSpec, Stop

_log = logging.getLogger(__name__)

# How long a rank may take to join, load and shard the model before the group gives up.
START_TIMEOUT_S = 300.0
# How long `close` waits for a rank to exit before it is killed.
STOP_TIMEOUT_S = 10.0
RANK_MODULE = "pagedserve.workers.tp.rank_process"


class TPGroupFailed(RuntimeError):
    """A rank of the tensor-parallel group died or failed: the whole group is stopped."""


class TPGroup:
    """Owns the processes and connections of ranks 1..k-1.

    Ranks are fresh interpreters (``python -m pagedserve.workers.tp.rank_process``), not
    multiprocessing children: nothing of the caller's ``__main__`` is imported again, so an
    offline script needs no ``if __name__ == "__main__"`` guard. Each connects back to a
    listener here (an authenticated `multiprocessing.connection`), which then carries its
    `RankSpec` and its commands; everything is sent as plain pickles.
    """

    def __init__(self, specs: list[RankSpec]) -> None:
        """Start a process per spec (ranks 1..k-1) and send each its spec; `wait_ready`
        waits for them to build their shards.

        Raises:
            TPGroupFailed: a rank exited or did not connect within `START_TIMEOUT_S`.
        """
        self.failed: str | None = None
        # Called with the reason as the group fails, before `TPGroupFailed` is raised (a
        # cluster worker exits its process here, so its requests replay on a peer).
        self.on_failure: Callable[[str], None] | None = None
        self._closing = False
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        authkey = secrets.token_bytes(32)
        accepted: queue.Queue = queue.Queue()
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            acceptor = threading.Thread(
                target=_accept_all, args=(listener, len(specs), accepted), daemon=True
            )
            acceptor.start()
            for spec in specs:
                self._procs.append(_start_rank(listener.address, authkey, spec.shard.rank))
            by_rank = self._await_connections(accepted, len(specs))
        self._conns = [by_rank[spec.shard.rank] for spec in specs]
        for conn, spec in zip(self._conns, specs, strict=True):
            with self.guard():
                _send(conn, spec)

    def _await_connections(self, accepted: queue.Queue, count: int) -> dict[int, Connection]:
        by_rank: dict[int, Connection] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(by_rank) < count:
            self._check_alive()
            if time.monotonic() > deadline:
                self._fail(f"ranks not connected after {START_TIMEOUT_S:.0f} s")
            try:
                conn = accepted.get(timeout=0.1)
            except queue.Empty:
                continue
            by_rank[int(_recv(conn))] = conn
        return by_rank

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids (ranks 1..k-1, in order)."""
        return [proc.pid for proc in self._procs]

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until every rank has built its shards.

        Raises:
            TPGroupFailed: a rank exited first, or `timeout_s` passed.
        """
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.1):
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"rank {rank} not ready after {timeout_s:.0f} s")
            with self.guard():
                message = _recv(conn)
            if message != READY:
                self._fail(f"rank {rank} sent {message!r} instead of {READY!r}")

    def send(self, command: RankCommand) -> None:
        """Send ``command`` to every rank (the same one), after checking they all live."""
        self._check_alive()
        with self.guard():
            payload = pickle.dumps(command)
            for conn in self._conns:
                conn.send_bytes(payload)

    def send_each(self, commands: list[RankCommand]) -> None:
        """Send ``commands[i]`` to rank i + 1."""
        self._check_alive()
        with self.guard():
            for conn, command in zip(self._conns, commands, strict=True):
                _send(conn, command)

    def collect(self) -> list:
        """Every rank's reply to the last replying command, in rank order."""
        with self.guard():
            return [_recv(conn) for conn in self._conns]

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a broken connection or a failed collective into `TPGroupFailed` (stopping the
        group)."""
        if self.failed is not None:
            raise TPGroupFailed(self.failed)
        try:
            yield
        except TPGroupFailed:
            raise
        except (EOFError, OSError, RuntimeError) as exc:
            self._fail(f"tensor-parallel group failed: {type(exc).__name__}: {exc}")

    def watch(self) -> None:
        """Notice a rank that dies while the engine is idle too: a thread per rank waits on
        its process and fails the group (calling `on_failure`) unless `close` stopped it."""
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(
                target=self._watch_rank, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True
            ).start()

    def _watch_rank(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing and self.failed is None:
            with suppress(TPGroupFailed):
                self._fail(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def close(self) -> None:
        """Stop every rank (politely, then by force); idempotent."""
        self._closing = True
        for conn in self._conns:
            with suppress(OSError, ValueError):
                _send(conn, Stop())
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._procs = []

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise TPGroupFailed(self.failed)
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                self._fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")

    def _fail(self, reason: str) -> None:
        self.failed = reason
        _log.error("%s; stopping the group", reason)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            proc.wait()
        if self.on_failure is not None:
            self.on_failure(reason)
        raise TPGroupFailed(reason)


def _start_rank(address: tuple[str, int], authkey: bytes, rank: int) -> subprocess.Popen:
    """A rank's interpreter; it reads the listener's key from its stdin (never argv or env)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", RANK_MODULE, address[0], str(address[1]), str(rank)],
        stdin=subprocess.PIPE,
    )
    proc.stdin.write(authkey.hex().encode() + b"\n")
    proc.stdin.close()
    return proc


def _accept_all(listener: Listener, count: int, accepted: queue.Queue) -> None:
    with suppress(OSError):
        for _ in range(count):
            accepted.put(listener.accept())


def _send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message))


def _recv(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())
