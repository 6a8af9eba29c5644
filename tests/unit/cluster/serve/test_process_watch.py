"""What `pagedserve serve` watches, without a cluster: how it answers SIGINT and SIGTERM in
each phase, and how it knows that the local Ray it started is gone (its GCS server or
raylet, children of the process, exited). The running process:
tests/integration/test_serve_process.py."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from pagedserve.cluster.serve.process_watch import Interrupted, LocalRayWatch, Phase, StopSignals


@pytest.fixture
def own_signal_handlers():
    saved = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_sigint_and_sigterm_get_the_same_answer(own_signal_handlers):
    signals = StopSignals()
    signals.install()
    assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) == signals._on_signal


class Ended(Exception):
    """What the tests' `end_now` raises instead of ending the process."""


def ends(line: str, status: int) -> None:
    raise Ended(line, status)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serving_the_first_signal_asks_for_the_clean_stop_a_second_ends_at_once(signum):
    signals = StopSignals(end_now=ends)
    signals.phase = Phase.SERVING
    signals._on_signal(signum, None)  # returns: the serve loop sees `requested`
    assert signals.requested.is_set() and signals.name == signal.Signals(signum).name
    signals.phase = Phase.STOPPING
    with pytest.raises(Ended) as ended:
        signals._on_signal(signal.SIGINT, None)
    assert ended.value.args == ("pagedserve: SIGINT again: stopped at once", 130)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_ends_at_once(signum):
    signals = StopSignals(end_now=ends)
    signals.phase = Phase.STARTING
    with pytest.raises(Ended) as ended:
        signals._on_signal(signum, None)
    name = signal.Signals(signum).name
    assert ended.value.args == (f"pagedserve: {name}: stopped while starting", 128 + signum)


def test_a_signal_while_checking_abandons_the_checks():
    signals = StopSignals(end_now=ends)
    with pytest.raises(Interrupted) as raised:
        signals._on_signal(signal.SIGTERM, None)
    assert raised.value.signum == signal.SIGTERM and signals.requested.is_set()


def fake_process(proc: Path, pid: int, comm: str, state: str, ppid: int) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} {ppid} 1 1 0 -1\n")


def test_the_local_ray_is_lost_when_its_gcs_server_or_raylet_is_gone(tmp_path):
    me = os.getpid()
    fake_process(tmp_path, 101, "gcs_server", "S", me)
    fake_process(tmp_path, 102, "raylet", "S", me)
    fake_process(tmp_path, 103, "python", "S", me)  # a dashboard: not what makes the cluster
    fake_process(tmp_path, 104, "raylet", "S", 1)  # another cluster's
    watch = LocalRayWatch(tmp_path)
    watch.start()
    assert watch.lost() is None
    fake_process(tmp_path, 103, "python", "Z", me)
    assert watch.lost() is None
    fake_process(tmp_path, 102, "raylet", "Z", me)  # exited, not reaped yet
    assert watch.lost() == "its raylet (pid 102) exited"
    fake_process(tmp_path, 102, "raylet", "S", me)
    (tmp_path / "101" / "stat").unlink()  # reaped
    assert watch.lost() == "its gcs_server (pid 101) exited"


def test_during_a_stop_a_gcs_that_refuses_connections_counts_as_gone(tmp_path):
    """A signal to the whole process group reaches the GCS too: it stops listening at once and
    may take a minute to exit, while the stop's Ray calls wait for it."""
    me = os.getpid()
    fake_process(tmp_path, 101, "gcs_server", "S", me)
    fake_process(tmp_path, 102, "raylet", "S", me)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        watch = LocalRayWatch(tmp_path, gcs_address=address)
        watch.start()
        assert watch.lost_or_closed() is None  # listening: the stop goes on
    assert watch.lost() is None  # both daemons still run
    assert watch.lost_or_closed() == f"its GCS at {address} refuses connections"
    fake_process(tmp_path, 102, "raylet", "Z", me)
    assert watch.lost_or_closed() == "its raylet (pid 102) exited"
    unknown = LocalRayWatch(tmp_path)
    unknown.start()  # no address known: the daemons alone say
    fake_process(tmp_path, 102, "raylet", "S", me)
    assert unknown.lost_or_closed() is None
