"""Ray's start-up deadlines, raised so that a loaded machine starts a local cluster.

A local Ray (`ray.init(address="local")`) starts its raylet, which waits for its dashboard
agent to register (`agent_register_timeout_ms`, 30 s by default) and for each worker process
it spawns (`worker_register_timeout_seconds`, 60 s). Past either deadline Ray gives up: the
raylet crashes with "Check failed" in `WaitForDashboardAgentPorts` (seen at a load average of
~45 on this project's 2-core machines: the integration tests' `ray.init` failed and every
test of the module errored), or a late worker is killed and respawned. Slowness is not a
failure here, so every local cluster this project starts allows minutes instead.

Serve's controller gives a new proxy 5 s to report ready (`RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`),
then kills and restarts it: at a load average of ~40 a proxy missed it again and again, and a
test module's set-up, waiting on the proxy actor, failed with `ActorDiedError` (killed by
`ray.kill`). That deadline is raised the same way.

A new head node waits 30 s for its GCS server to write the port file
(`RAY_gcs_server_port_wait_time_s`); a loaded full test run's `ray.init` failed with "Timed out
waiting for file .../gcs_server_port_...". Raised the same way too. (Ray also takes this value as
the number of one-second tries a node makes to reach the GCS: patient there as well.)

The raylet also waits for its dashboard agent to write its metrics port file, for
`RAY_raylet_start_wait_time_s` (10 s by default): at a load average of ~20 on this project's
2-core machine the agent wrote it after 31 s, the raylet died ("Check failed ... Timed out
waiting for file .../metrics_agent_port_...") and `pagedserve serve` waited the full node
registration deadline for a node that was gone. Raised the same way.

One more deadline is a constant, not a variable: the process that starts a node waits 30 s
for it to register with the GCS (`ray._private.node.Node`, polling
`ray._private.services.get_node`), then raises "The current node timed out during startup".
At a load average of ~45 that failed module set-ups. `wait_patiently_for_node_registration`
makes each of those polls itself wait up to `NODE_REGISTRATION_DEADLINE_S`, so Ray's loop
sees the node on its first try (a unit test fails if Ray stops polling that function).

Set any of these variables in the environment to choose another value; a joined cluster keeps
its own.

Not a deadline, but the other way a node failed to start here: Ray starts its processes
(raylet, GCS, workers) by fork and exec from the process calling `ray.init`, and grpcio's fork
handlers, on by default, run between the two whenever that process has gRPC threads (a test's
OTLP collector, a client's channels). A raylet forked that way never reached exec: no log file,
no registration, "The current node timed out during startup" even after 300 s. It happened
twice in loaded integration runs, each time right after grpcio logged "Other threads are
currently calling into gRPC, skipping fork() handlers". Every process here forks only to exec,
the case grpcio documents `GRPC_ENABLE_FORK_SUPPORT=false` for (`exec_only_forks`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from pagedserve.workers.ray_internals import current_get_node, wrap_get_node

STARTUP_DEADLINES: dict[str, str] = {
    "RAY_agent_register_timeout_ms": "300000",
    "RAY_worker_register_timeout_seconds": "300",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_gcs_server_port_wait_time_s": "300",
    "RAY_raylet_start_wait_time_s": "300",
}
NODE_REGISTRATION_DEADLINE_S = 300.0
_PATIENT = "__pagedserve_patient__"
GRPC_EXEC_ONLY_FORKS: dict[str, str] = {"GRPC_ENABLE_FORK_SUPPORT": "false"}


def set_where_unset(environ: MutableMapping[str, str], values: dict[str, str]) -> None:
    """Each of `values` put in `environ` unless it already names that variable."""
    for name, value in values.items():
        environ.setdefault(name, value)


def exec_only_forks(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn grpcio's fork handlers off (`GRPC_EXEC_ONLY_FORKS`) where the environment says
    nothing: in this process if grpc is not imported yet (grpcio reads the variable on import),
    and in every process started from it. Returns whether this process was in time."""
    set_where_unset(environ, GRPC_EXEC_ONLY_FORKS)
    return "grpc" not in sys.modules


# The log monitor of a local cluster (the process that forwards the workers' log lines here)
# lists the session's log files again every 0.1 s while there are fewer than Ray's threshold
# of them (1,000), and every `LOG_NAME_UPDATE_INTERVAL_S` (0.5 s) past it. Idle, the listing
# cost it 6-9.5 CPU-ms a second on a 2-core machine; past the threshold from the start, 3
# (bench/README.md, "The load sweep on a faster host"). A new worker's log file is then found
# up to 0.5 s later, and read from its start: no line is lost.
LOG_MONITOR_ENV: dict[str, str] = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}


def quiet_log_monitor(environ: MutableMapping[str, str] = os.environ) -> None:
    """Make the log monitor of a local cluster started from this process list its files every
    0.5 s instead of every 0.1 s (`LOG_MONITOR_ENV`), where the environment says nothing.
    Call it before `ray.init` starts the cluster."""
    set_where_unset(environ, LOG_MONITOR_ENV)


# What a local cluster started without Ray's dashboard records for no reader, and how often
# Serve hands its request metrics to Ray's metric API:
# - Task events (`RAY_task_events_report_interval_ms`): every process buffers the state changes
#   of each Ray task and sends them to the GCS every second, for `ray list tasks`, the
#   dashboard's task views and `ray.timeline()`. The first two need the dashboard; with it off
#   only `ray.timeline()` from a driver joined to the cluster would read them.
# - Event stats (`RAY_event_stats`): every Ray C++ process times each handler of its event
#   loops, for its debug dumps and Ray's internal `ray_operation_*` metrics.
# - Ray's own metrics (`RAY_enable_metrics_collection`): every process records Ray's `ray_*`
#   metrics (tasks, RPCs, object store, event-loop lag) and sends them to the node's dashboard
#   agent, which exports them for the dashboard's graphs and a Prometheus scraping Ray's
#   metrics port. The project's own metrics are the Router's `GET /metrics`
#   (`prometheus_client`, `cluster/router/metrics.py`), which this does not touch.
# - Serve's replicas and proxies export their cached request metrics every 0.1 s
#   (`RAY_SERVE_METRICS_EXPORT_INTERVAL_MS`), waking their event loops ten times a second;
#   every second is still well inside a Prometheus scrape interval.
# Idle, alternated 30 s windows on a 2-core machine, the processes other than the worker took
# 74 and 69 CPU-ms a second before the first two, 62 and 64 after; Ray's metrics off took
# another 5-8 off (84 and 89 against 79 and 80 on a slower hour; the dashboard agent 7-8
# against 4). bench/README.md, "What Ray records for no reader" and "Ray's metrics, leases,
# Ray's daemons below the engine".
QUIET_RECORDING_ENV: dict[str, str] = {
    "RAY_task_events_report_interval_ms": "0",
    "RAY_event_stats": "0",
    "RAY_enable_metrics_collection": "0",
}
SERVE_METRICS_ENV: dict[str, str] = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def quiet_observability(dashboard: bool, environ: MutableMapping[str, str] = os.environ) -> None:
    """Make a local cluster started from this process export Serve's request metrics every
    second (`SERVE_METRICS_ENV`) and, without the dashboard, record no task events, event
    stats or Ray's own metrics (`QUIET_RECORDING_ENV`), where the environment says nothing.
    Call it before `ray.init` starts the cluster."""
    set_where_unset(
        environ, SERVE_METRICS_ENV if dashboard else QUIET_RECORDING_ENV | SERVE_METRICS_ENV
    )


def allow_slow_startup(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set Ray's start-up deadlines (`STARTUP_DEADLINES`) where the environment has none, turn
    grpcio's fork handlers off for the processes Ray starts (`exec_only_forks`), and make this
    process wait patiently for the nodes it starts to register.

    Call it before `ray.init` starts a local cluster: its processes read them as they start.
    """
    set_where_unset(environ, STARTUP_DEADLINES)
    exec_only_forks(environ)
    wait_patiently_for_node_registration()


def wait_patiently_for_node_registration() -> None:
    """Make this process's node start-up wait `NODE_REGISTRATION_DEADLINE_S` for a new node to
    register with the GCS instead of Ray's fixed 30 s. Idempotent."""
    if not getattr(current_get_node(), _PATIENT, False):
        wrap_get_node(lambda get_node: patient(get_node, NODE_REGISTRATION_DEADLINE_S))


def patient(
    get_node: Callable[..., Any], deadline_s: float, poll_s: float = 0.2
) -> Callable[..., Any]:
    """`get_node` retried while it raises `RuntimeError` (the node is not registered yet),
    until `deadline_s` has passed; then its last error is raised."""

    @functools.wraps(get_node)
    def get_node_patiently(*args: Any, **kwargs: Any) -> Any:
        end = time.monotonic() + deadline_s
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() >= end:
                    raise
                time.sleep(poll_s)

    setattr(get_node_patiently, _PATIENT, True)
    return get_node_patiently
