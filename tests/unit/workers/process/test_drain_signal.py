"""SIGTERM handling of a worker process (`drain_signal`), its pid files (`pid_files`) and
`pagedserve drain-node` (`drain_node`), without Ray: the handler is called as the main thread
would call it, and drain-node signals real child processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading

import pytest

from pagedserve.workers.process.drain_node import drain_node
from pagedserve.workers.process.drain_node import run as drain_node_command
from pagedserve.workers.process.drain_signal import DrainOnSigterm
from pagedserve.workers.process.pid_files import live_workers, process_start_time, register_pid

# A child that exits only on SIGTERM: what a worker process looks like to drain-node.
CHILD = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('ready', flush=True)\n"
    "while True: time.sleep(1)\n"
)


class Recorder:
    """A fallback handler (Ray's, in a worker), a resignal and a hard exit that record their
    calls."""

    def __init__(self) -> None:
        self.ended: list[int] = []
        self.resignalled = threading.Event()
        self.hard_exited = threading.Event()

    def fallback(self, signum, frame) -> None:
        self.ended.append(signum)

    def resignal(self) -> None:
        self.resignalled.set()

    def hard_exit(self) -> None:
        self.hard_exited.set()

    def handler(self, exit_deadline_s: float = 600.0) -> DrainOnSigterm:
        handler = DrainOnSigterm(self.resignal, self.hard_exit, exit_deadline_s)
        handler.fallback = self.fallback
        return handler


def test_sigterm_before_arming_ends_at_once():
    recorder = Recorder()
    handler = recorder.handler()
    handler.handle(signal.SIGTERM, None)
    assert recorder.ended == [signal.SIGTERM] and not recorder.resignalled.is_set()


def test_sigterm_drains_on_the_loop_then_resignals_and_a_second_one_ends():
    recorder = Recorder()
    handler = recorder.handler()
    drained = []

    async def drain() -> None:
        drained.append(threading.current_thread().name)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="actor-loop")
    thread.start()
    try:
        handler.arm(loop, drain)
        handler.handle(signal.SIGTERM, None)  # as the main thread runs it: returns at once
        assert recorder.resignalled.wait(10), "the drain never resignalled"
        assert drained == ["actor-loop"] and recorder.ended == []  # drained, not yet ended
        handler.handle(signal.SIGTERM, None)  # the resignal (or a second SIGTERM): end now
        assert recorder.ended == [signal.SIGTERM]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_a_failed_drain_still_ends_the_process_and_a_stuck_exit_is_cut_short():
    """The resignal's exit (Ray's) may wait on a stream held by a lagging reader: past the
    exit deadline the process ends regardless."""
    recorder = Recorder()
    handler = recorder.handler(exit_deadline_s=0.0)

    async def drain() -> None:
        raise RuntimeError("drain broke")

    async def main() -> None:
        handler.arm(asyncio.get_running_loop(), drain)
        handler.handle(signal.SIGTERM, None)
        # Off the loop, so the failing drain runs meanwhile; 10 s only stops a hang.
        resignalled = await asyncio.to_thread(recorder.resignalled.wait, 10)
        assert resignalled, "the failed drain never resignalled"

    asyncio.run(main())
    assert handler.draining
    assert recorder.hard_exited.wait(10), "the exit deadline never ended the process"


def test_pid_files_list_live_workers_and_drop_stale_ones(tmp_path):
    path = register_pid("w-0", str(tmp_path))
    (tmp_path / "w-gone.pid").write_text("999999999 1\n")  # no such process
    (tmp_path / "w-reused.pid").write_text(f"{path.read_text().split()[0]} 1\n")  # other start
    (tmp_path / "junk.pid").write_text("not a pid file")
    (live,) = live_workers(str(tmp_path))
    assert (live.worker_id, live.start_time) == ("w-0", process_start_time(live.pid))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pid", "w-0.pid"]
    assert live_workers(str(tmp_path / "absent")) == []


@pytest.fixture
def children(tmp_path):
    """Two processes that exit on SIGTERM, each with a pid file in `tmp_path`."""
    procs = []
    for i in range(2):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        (tmp_path / f"w-{i}.pid").write_text(f"{proc.pid} {process_start_time(proc.pid)}\n")
        procs.append(proc)
    reaper = threading.Thread(target=lambda: [p.wait() for p in procs])  # no zombies
    reaper.start()
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    reaper.join()


def test_drain_node_signals_every_worker_and_waits_for_them(tmp_path, children):
    result = drain_node(str(tmp_path), timeout_s=60)
    assert result.signalled == ("w-0", "w-1") and result.still_running == ()
    assert all(proc.returncode == 0 for proc in children)  # each exited on its SIGTERM


def test_drain_node_reports_workers_still_running_at_its_timeout(tmp_path, children, capsys):
    def ignore(pid: int, signum: int) -> None:  # a worker that never exits
        pass

    result = drain_node(str(tmp_path), timeout_s=0, send=ignore)
    assert result.still_running == ("w-0", "w-1")
    bad = type("Args", (), {"pid_dir": str(tmp_path), "timeout_s": float("nan")})
    assert drain_node_command(bad) == 2
    assert "--timeout-s must be a finite number" in capsys.readouterr().err
