"""`bench/proc_cpu.py`: process roles from their titles, CPU per role between snapshots."""

from __future__ import annotations

import os

import pytest

from pagedserve.bench.proc_cpu import (
    ENDED,
    ProcCpu,
    client_cpu_s,
    cpu_by_role,
    engine_split,
    is_engine_role,
    role_of,
    session_cpu,
)


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        ("ray::ServeReplica:pagedserve:Router.handle_request", "Router"),
        ("ray::pagedserve-worker-0:Worker.generate", "Worker"),
        ("ray::ProxyActor", "ProxyActor"),
        ("ray::IDLE", "IDLE"),
        ("/venv/lib/ray/core/src/ray/gcs/gcs_server --port=1", "gcs_server"),
        ("/venv/bin/python -m pagedserve serve --num-workers 1", "pagedserve"),
        ("VLLM::EngineCore", "VLLM::EngineCore"),
        ("/venv/bin/python -u /venv/ray/_private/log_monitor.py --x=1", "log_monitor"),
        ("/venv/bin/python3 -c import sys", "python3"),
        ("", "comm"),
    ],
)
def test_roles_come_from_titles(cmdline, role):
    assert role_of(cmdline, "comm") == role


def test_cpu_per_role_between_snapshots():
    before = {1: ProcCpu("IDLE", 2.0), 2: ProcCpu("Router", 1.0), 3: ProcCpu("gone", 5.0)}
    after = {1: ProcCpu("Worker", 7.0), 2: ProcCpu("Router", 1.5), 4: ProcCpu("Router", 0.25)}
    # pid 1 became the worker after its snapshot as an idle pooled process; pid 4 is new.
    assert cpu_by_role(before, after) == {"Worker": 5.0, "Router": 0.75}


def test_this_session_is_seen_with_this_process_in_it():
    found = session_cpu(os.getsid(0))
    assert os.getpid() in found and found[os.getpid()].cpu_s >= 0
    assert client_cpu_s() > 0


def test_an_ended_process_counts_through_what_its_parent_reaped():
    # pid 3 had spent 5 s before; it ended and its parent (1) reaped it: 5.5 s in all, so it
    # spent 0.5 s in the window. New pid 4 reaped a child of its own that spent 0.25 s.
    before = {1: ProcCpu("pagedserve", 1.0, 2.0), 3: ProcCpu("IDLE", 5.0)}
    after = {1: ProcCpu("pagedserve", 1.0, 7.5), 4: ProcCpu("raylet", 0.0, 0.25)}
    assert cpu_by_role(before, after) == {ENDED: 0.75, "pagedserve": 0.0, "raylet": 0.0}


def fake_proc(tmp_path, processes):
    """A /proc of `(pid, ppid, session, utime ticks, cmdline)` processes."""
    for pid, ppid, session, utime, cmdline in processes:
        directory = tmp_path / str(pid)
        directory.mkdir()
        fields = ["S", ppid, pid, session, 0, 0, 0, 0, 0, 0, 0, utime, 0, 0, 0] + [0] * 20
        (directory / "stat").write_text(f"{pid} (comm) " + " ".join(map(str, fields)))
        (directory / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())
    return tmp_path


def test_a_descendant_that_left_the_session_is_still_counted(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    proc = fake_proc(tmp_path, [
        (100, 1, 100, ticks, "/venv/bin/python -m pagedserve serve"),  # the server, leader
        (101, 100, 101, 2 * ticks, "/ray/gcs_server --port=1"),  # its own session now
        (102, 101, 101, ticks, "ray::Worker"),  # under it
        (200, 1, 200, ticks, "python -m someone.else"),  # not ours
    ])  # fmt: skip
    found = session_cpu(100, proc)
    assert sorted(found) == [100, 101, 102]
    assert found[101] == ProcCpu("gcs_server", 2.0, 0.0)


def test_the_engine_roles_of_each_server():
    engines = ["Worker", "VLLM::Worker", "VLLM::Worker_TP0", "VLLM::EngineCore"]
    assert all(map(is_engine_role, [*engines, "pagedserve.bench.engine_arrivals"]))
    assert not any(
        map(is_engine_role, ["Router", "ProxyActor", "vllm.entrypoints.openai.api_server"])
    )
    assert engine_split({"Worker": 3.0, "Router": 0.5, "gcs_server": 0.25}) == (3.0, 0.75)
