"""`bench/proc_cpu.py`: process roles from their titles, CPU per role between snapshots."""

from __future__ import annotations

import os

import pytest

from pagedserve.bench.proc_cpu import ProcCpu, client_cpu_s, cpu_by_role, role_of, session_cpu


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
