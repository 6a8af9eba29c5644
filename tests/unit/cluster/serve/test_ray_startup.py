"""Ray's start-up deadlines: raised where the environment says nothing, kept where it does;
the node-registration wait that Ray fixes at 30 s, made patient; grpcio's fork handlers off in
every process that starts Ray's; the local cluster's log monitor listing its files less often,
and what it records for no reader."""

import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray._private.node
import ray._private.services

from pagedserve.cluster.serve.ray_startup import (
    GRPC_EXEC_ONLY_FORKS,
    LOG_MONITOR_ENV,
    NODE_REGISTRATION_DEADLINE_S,
    QUIET_RECORDING_ENV,
    SERVE_METRICS_ENV,
    STARTUP_DEADLINES,
    allow_slow_startup,
    exec_only_forks,
    patient,
    quiet_log_monitor,
    quiet_observability,
)

TESTS = Path(__file__).resolve().parents[3]


def test_missing_deadlines_are_raised_to_minutes():
    environ: dict[str, str] = {}
    allow_slow_startup(environ)
    assert environ == {**STARTUP_DEADLINES, **GRPC_EXEC_ONLY_FORKS}
    assert int(environ["RAY_agent_register_timeout_ms"]) >= 120_000  # Ray's default: 30,000
    assert int(environ["RAY_worker_register_timeout_seconds"]) >= 120  # Ray's default: 60
    assert float(environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) >= 60  # Serve's default: 5
    assert int(environ["RAY_gcs_server_port_wait_time_s"]) >= 120  # Ray's default: 30


def test_ray_still_reads_the_gcs_port_wait_from_the_environment():
    """If a Ray upgrade renames the variable, the raised wait no longer applies and this fails."""
    source = inspect.getsource(ray._private.node.Node.start_gcs_server)
    assert '"RAY_gcs_server_port_wait_time_s"' in source


def test_a_deadline_the_environment_sets_is_kept():
    environ = {"RAY_agent_register_timeout_ms": "45000", "PATH": "/bin"}
    allow_slow_startup(environ)
    assert environ["RAY_agent_register_timeout_ms"] == "45000"
    assert environ["RAY_worker_register_timeout_seconds"] == "300"
    assert environ["PATH"] == "/bin"


def test_the_log_monitor_lists_its_files_every_half_second_unless_told_otherwise():
    environ = {"PATH": "/bin"}
    quiet_log_monitor(environ)
    assert environ == {"PATH": "/bin", **LOG_MONITOR_ENV}
    told = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "50"}
    quiet_log_monitor(told)
    assert told == {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "50"}


def test_ray_s_log_monitor_under_that_setting_lists_its_files_only_past_the_interval(
    monkeypatch,
):
    """If a Ray upgrade renames the variable or lists files on another condition, this fails."""
    from ray._private import log_monitor

    source = inspect.getsource(log_monitor)
    assert 'os.getenv("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"' in source
    threshold = int(LOG_MONITOR_ENV["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"])
    monkeypatch.setattr(log_monitor, "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", threshold)
    monitor = log_monitor.LogMonitor.__new__(log_monitor.LogMonitor)
    monitor.log_filenames = {"worker-1.out", "worker-1.err"}
    now = time.time()
    assert not monitor.should_update_filenames(now)
    assert monitor.should_update_filenames(now - 2 * log_monitor.LOG_NAME_UPDATE_INTERVAL_S)


def test_without_the_dashboard_a_local_cluster_records_no_task_events_stats_or_ray_metrics():
    environ = {"PATH": "/bin"}
    quiet_observability(dashboard=False, environ=environ)
    assert environ == {
        "PATH": "/bin",
        "RAY_task_events_report_interval_ms": "0",
        "RAY_event_stats": "0",
        "RAY_enable_metrics_collection": "0",
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    }


def test_with_the_dashboard_its_task_views_keep_their_events():
    environ: dict[str, str] = {}
    quiet_observability(dashboard=True, environ=environ)
    assert environ == {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def test_what_the_environment_says_about_them_is_kept():
    told = {
        "RAY_task_events_report_interval_ms": "1000",
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "0",
    }
    quiet_observability(dashboard=False, environ=told)
    assert told["RAY_task_events_report_interval_ms"] == "1000"
    assert told["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "0"
    assert told["RAY_event_stats"] == "0"


def test_ray_still_reads_those_variables():
    """Ray's C++ processes (every worker's core worker, the GCS) read `RAY_<setting>` for each
    of their settings, and Serve reads its metrics interval in Python: if a Ray upgrade drops
    or renames one, this fails."""
    from ray.serve._private import constants

    ray_dir = Path(ray._private.node.__file__).resolve().parents[1]
    programs = [ray_dir / "_raylet.so", ray_dir / "core/src/ray/gcs/gcs_server"]
    for program in programs:
        binary = program.read_bytes()
        for name in QUIET_RECORDING_ENV:
            assert name.encode() + b"\0" in binary, (program, name)
    (name,) = SERVE_METRICS_ENV
    assert f'"{name}", 100' in inspect.getsource(constants)


def test_the_test_session_itself_starts_ray_with_them():
    import os

    for name in STARTUP_DEADLINES:
        assert name in os.environ, name  # set by tests/conftest.py before any ray.init


def test_the_node_start_up_polls_the_function_made_patient():
    """Ray's node start-up waits for registration by polling `services.get_node`; if a Ray
    upgrade stops doing so, the patient wait below no longer applies and this fails."""
    source = inspect.getsource(ray._private.node.Node.__init__)
    assert "ray._private.services.get_node(" in source
    assert getattr(ray._private.services.get_node, "__pagedserve_patient__", False)
    assert NODE_REGISTRATION_DEADLINE_S >= 120


def test_patient_get_node_retries_until_the_node_registers():
    answers = iter([RuntimeError("not yet"), RuntimeError("not yet"), {"node_id": "n1"}])

    def get_node(gcs_address, node_id):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert patient(get_node, deadline_s=60, poll_s=0)("gcs", "n1") == {"node_id": "n1"}


def test_patient_get_node_gives_up_at_its_deadline_with_the_last_error():
    calls = []

    def get_node(gcs_address, node_id):
        calls.append(1)
        raise RuntimeError("node n1 never registered")

    with pytest.raises(RuntimeError, match="never registered"):
        patient(get_node, deadline_s=0, poll_s=0)("gcs", "n1")
    assert calls == [1]


def test_other_errors_are_not_retried():
    def get_node(gcs_address, node_id):
        raise ValueError("bad address")

    with pytest.raises(ValueError):
        patient(get_node, deadline_s=60, poll_s=0)("gcs", "n1")


def test_exec_only_forks_keeps_what_the_environment_says():
    environ = {"GRPC_ENABLE_FORK_SUPPORT": "true"}
    exec_only_forks(environ)
    assert environ == {"GRPC_ENABLE_FORK_SUPPORT": "true"}


def test_the_test_session_turned_grpc_fork_handlers_off_before_importing_grpc():
    conftest = next(
        module
        for module in list(sys.modules.values())
        if getattr(module, "__file__", "") == str(TESTS / "conftest.py")
    )
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "false"
    assert conftest.GRPC_FORKS_EXEC_ONLY_IN_TIME  # grpc was not imported when it was set


# A process with gRPC threads busy (a server and clients calling it) that forks and execs, as
# `ray.init` starts Ray's processes. With grpcio's fork handlers on, run by hand here: of 100
# forked children of `true` one died of SIGABRT before exec, and the handlers logged from
# fork_posix.cc ("skipping fork() handlers") and the pollers ("Bad file descriptor"). Off, a
# fork is a plain fork.
FORKING_GRPC_PROCESS = textwrap.dedent(
    """
    import subprocess, sys, threading
    from pagedserve.cluster.serve.ray_startup import exec_only_forks
    if sys.argv[1] == "off":
        assert exec_only_forks()
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    done = threading.Event()

    def call_until_done():
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        while not done.is_set():
            stub.Check(health_pb2.HealthCheckRequest())

    callers = [threading.Thread(target=call_until_done) for _ in range(3)]
    for caller in callers:
        caller.start()
    failed = 0
    for _ in range(100):
        child = subprocess.run(["true"], preexec_fn=lambda: None, timeout=60)
        failed += child.returncode != 0
    done.set()
    for caller in callers:
        caller.join()
    server.stop(0)
    print(f"children failed: {failed}")
    """
)


def _fork_beside_busy_grpc(mode: str) -> tuple[str, list[str]]:
    """(the script's last output line, its stderr lines about forks) for `mode` on or off."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    result = subprocess.run(
        [sys.executable, "-c", FORKING_GRPC_PROCESS, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = [line for line in result.stderr.splitlines() if "fork" in line or "Bad file" in line]
    return result.stdout.strip().splitlines()[-1], lines


def test_forks_beside_busy_grpc_threads_run_no_grpc_fork_handlers():
    assert _fork_beside_busy_grpc("off") == ("children failed: 0", [])
