"""The life of the `pagedserve serve` process once its checks passed: start, serve, stop.

    ray.init ──► start_pool ──► serve.start ──► await_workers ──► serve.run ──► serving
                                    (workers load meanwhile)                        │
    first SIGINT/SIGTERM ──► stop: freeze the pool, drain the workers (in-flight requests
                             finish within `--shutdown-grace-s`; none: at once), end the
                             local Ray ──► exit 0
    a signal while starting, or a second one ──► kill the local Ray now ──► exit 128 + signal
    the local Ray's GCS or raylet gone ──► one line saying so ──► exit 1
    (gone during the stop, as when the signal went to the whole process group: exit 128 + signal)

What a signal does in each phase, and how the loss of Ray is seen: `cluster/serve/process_watch.py`.
`await_workers` waits for the pool's first workers: a start that fails the same way twice
(`PoolStats.failed`) ends the start-up, its cause printed last.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, NoReturn

from pagedserve.cluster.serve.process_watch import (
    JoinedRayWatch,
    LocalRayWatch,
    Phase,
    StopSignals,
    descendants_now,
    kill_if_running,
    live_children,
)

if TYPE_CHECKING:
    import argparse

    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.serve.cli import ServePlan

logger = logging.getLogger(__name__)
POLL_S = 0.5
APP_NAME = "pagedserve"
RAY_SHUTDOWN_TIMEOUT_S = 30.0  # a lost GCS can hold Ray's own shutdown: never wait longer
# How often the list of the processes under this one is read again while serving (~1.5 CPU-ms
# a read): an actor started since is missed only if the cluster then dies under a stop.
KNOWN_REFRESH_S = 10.0


class WorkersFailed(Exception):
    """The pool's first workers did not start; the message says why."""


def await_workers(pool: Any, config: Any, watch: LocalRayWatch | JoinedRayWatch) -> None:
    """Wait until the pool's first `num_workers` workers serve.

    Raises:
        WorkersFailed: two starts failed the same way (the pool gave up: its cause), the
            Ray cluster is gone, or `startup_timeout_s` passed.
    """
    import ray

    from pagedserve.cluster.pool.types import MemberState
    from pagedserve.workers.model.registry import DEFAULT_MODEL

    end = time.monotonic() + config.failure.startup_timeout_s
    while True:
        stats = ray.get(pool.stats.remote(), timeout=config.failure.rpc_timeout_s)
        if stats.failed:
            model = config.engine.model or DEFAULT_MODEL
            raise WorkersFailed(f"workers of {model} cannot start: {stats.failed}")
        serving = stats.membership.in_state(MemberState.SERVING)
        if len(serving) >= config.scaling.num_workers:
            return
        if (lost := watch.lost()) is not None:
            raise WorkersFailed(f"the Ray cluster is gone: {lost}")
        if time.monotonic() > end:
            raise WorkersFailed(
                f"{len(serving)} of {config.scaling.num_workers} workers serve after "
                f"startup_timeout_s ({config.failure.startup_timeout_s:g} s)"
            )
        time.sleep(POLL_S)


# ------------------------------------------------------------------ the process
def serve_until_stopped(
    plan: ServePlan, args: argparse.Namespace, signals: StopSignals, debug: bool
) -> NoReturn:
    """Start the cluster `plan` describes, serve until a signal or the loss of Ray, stop, and
    exit (`end`): 0 after a clean stop; 1 when the start failed or Ray was lost; 2 for a
    mistake found once a joined cluster told its GPUs; 128 + the signal when one abandoned
    the start or the stop.
    """
    import ray

    from pagedserve.cluster.serve.preflight import StartError
    from pagedserve.cluster.serve.ray_startup import (
        allow_slow_startup,
        quiet_log_monitor,
        quiet_observability,
    )

    local = plan.address is None
    allow_slow_startup()
    if local:
        quiet_log_monitor()
        quiet_observability(plan.ray_dashboard)
    signals.phase = Phase.STARTING
    try:
        context = ray.init(address=plan.address or "local", include_dashboard=plan.ray_dashboard)
        signals.install()  # again: Ray's client puts its own (which aborts) on SIGTERM
        watch: LocalRayWatch | JoinedRayWatch = (
            LocalRayWatch(gcs_address=context.address_info.get("gcs_address"))
            if local
            else JoinedRayWatch()
        )
        watch.start()
        print(ray_tools_line(context.address_info), flush=True)
        if not local:  # a joined cluster's GPUs size its workers: check again with them
            from pagedserve.cluster.serve.cli import checked_plan

            plan = checked_plan(args, int(ray.cluster_resources().get("GPU", 0)))
        start_serving(plan, watch)
    except StartError as error:
        return end(signals, local, f"pagedserve: error: {error}", 2, error if debug else None)
    except WorkersFailed as error:
        return end(signals, local, f"pagedserve: error: {error}", 1, error if debug else None)
    except Exception as error:  # Ray or Serve failed to start: its own words, in one line
        first = " ".join(str(error).split()) or type(error).__name__
        line = f"pagedserve: error: starting failed: {type(error).__name__}: {first}"
        return end(signals, local, line, 1, error if debug else None)
    signals.phase = Phase.SERVING
    print(serving_line(plan), flush=True)
    lost = None
    known, known_at = (descendants_now() if local else {}), time.monotonic()  # `stop_watching`
    while not signals.requested.wait(POLL_S) and (lost := watch.lost()) is None:
        if local and time.monotonic() - known_at > KNOWN_REFRESH_S:
            known, known_at = descendants_now(), time.monotonic()
    if lost is not None:
        line = f"pagedserve: the Ray cluster is gone: {lost}; exiting"
        return end(signals, local, line, 1, ray_lost=True)
    summary, lost = stop_watching(plan, signals, watch)  # a second signal ends it meanwhile
    if lost is not None:  # e.g. the signal went to the whole process group, Ray's GCS too
        line = f"pagedserve: {signals.name}: the Ray cluster stopped with it ({lost}); exiting"
        status = 128 + (signals.signum or 0)
        return end(signals, local, line, status, ray_lost=True, known=known)
    return end(signals, local, f"pagedserve: stopped ({summary})", 0)


def ray_tools_line(address_info: dict[str, Any]) -> str:
    """Where the Ray cluster is, and how an operator reaches it with Ray's own tools. Its
    token auth is on, and Ray's CLI sends the token (~/.ray/auth_token, which `ray.init`
    wrote or found) only when RAY_AUTH_MODE=token says to; `ray list` asks the dashboard,
    `ray status` the GCS."""
    gcs = address_info.get("gcs_address", "?")
    dashboard = address_info.get("webui_url") or ""
    where = f", dashboard http://{dashboard}" if dashboard else ""
    tool = "list actors" if dashboard else "status"
    more = "" if dashboard else " (`ray list` and the web UI: start with --ray-dashboard)"
    return (
        f"pagedserve: Ray cluster at {gcs}{where}; Ray's tools: "
        f"RAY_AUTH_MODE=token RAY_ADDRESS={gcs} ray {tool}{more}"
    )


def serving_line(plan: ServePlan) -> str:
    config = plan.config
    return (
        f"pagedserve: serving on http://{plan.host}:{plan.http_port}{_http_path(plan)}"
        f" and gRPC :{plan.grpc_port}"
        f" with {config.scaling.num_workers} workers{_roles(config)}; Ctrl-C stops"
    )


def _http_path(plan: ServePlan) -> str:
    """Who serves HTTP, as the serving line says it."""
    if plan.direct_ingress:
        return " (by the Router replica)"
    return f" (through Serve's proxy: {plan.http_through_proxy})"


def _roles(config: ClusterConfig) -> str:
    """The P/D layout, as the serving line shows it ('' without P/D)."""
    if not config.scaling.disaggregated:
        return ""
    scaling = config.scaling
    mixed = scaling.num_workers - scaling.prefill_workers - scaling.decode_workers
    return f" ({scaling.prefill_workers} prefill, {scaling.decode_workers} decode, {mixed} mixed)"


def start_serving(plan: ServePlan, watch: LocalRayWatch | JoinedRayWatch) -> None:
    """The pool and its first workers (loading while Serve starts), then the app.

    Raises:
        WorkersFailed: the workers did not start (why: the message).
    """
    from ray import serve

    from pagedserve.cluster.api import direct_ingress
    from pagedserve.cluster.api.config import split_app_args
    from pagedserve.cluster.api.serve_options import controller_env_vars, grpc_options, http_options
    from pagedserve.cluster.app import build_app
    from pagedserve.cluster.pool.group import start_pool
    from pagedserve.workers.model.registry import DEFAULT_MODEL
    from pagedserve.workers.ray_internals import version_warning

    config = plan.config
    if (warning := version_warning()) is not None:
        print(f"pagedserve: warning: {warning}", file=sys.stderr, flush=True)
    if plan.layout:
        print(f"pagedserve: sized to this machine: {plan.layout}", flush=True)
    group = start_pool(config, split_app_args(plan.data)[1].telemetry)
    model = config.engine.model or DEFAULT_MODEL
    print(f"pagedserve: starting {config.scaling.num_workers} workers of {model}", flush=True)
    env_vars = controller_env_vars(
        plan.host, config.limits.max_request_bytes, config.limits.max_pending_grpc_calls
    )
    proxy_port = plan.http_port
    if plan.direct_ingress:  # the Router replica takes --http-port; the proxy keeps gRPC
        env_vars |= direct_ingress.controller_env(plan.http_port)
        proxy_port = direct_ingress.proxy_http_port(plan.host)
    serve.start(
        http_options=http_options(plan.host, proxy_port),
        grpc_options=grpc_options(plan.grpc_port),
        controller_options={"runtime_env": {"env_vars": env_vars}},
    )
    await_workers(group.pool, config, watch)
    serve.run(build_app(plan.data), name=APP_NAME, route_prefix="/")
    placement = config.placement
    if plan.address is None and (placement.control_cpus, placement.control_nice) != (None, None):
        place_local_cluster(config)


def stop_watching(
    plan: ServePlan, signals: StopSignals, watch: LocalRayWatch | JoinedRayWatch
) -> tuple[str | None, str | None]:
    """`stop_cleanly`, while watching Ray: (what the stop did, None), or (None, what is gone)
    once the cluster is. A signal sent to the whole process group (systemd's default) reaches
    Ray's GCS and raylet too; the drain's Ray calls would then wait a minute for a GCS that is
    gone (Ray's client's reconnect timeout) before failing. The actors, whose raylet is gone,
    are then no longer under this process: `end` kills them by the list kept while serving."""
    outcome: list[str | BaseException] = []
    done = threading.Event()

    def stop() -> None:
        try:
            outcome.append(stop_cleanly(plan, signals))
        except BaseException as error:  # noqa: BLE001 (re-raised below unless Ray is gone)
            outcome.append(error)
        done.set()

    threading.Thread(target=stop, name="stop-cleanly", daemon=True).start()
    while not done.wait(POLL_S):
        if (lost := watch.lost_or_closed()) is not None:
            return None, lost
    if isinstance(outcome[0], BaseException):
        if (lost := watch.lost_or_closed()) is not None:
            return None, lost
        raise outcome[0]
    return outcome[0], None


def stop_cleanly(plan: ServePlan, signals: StopSignals) -> str:
    """Stop admitting, let requests in flight finish (up to the grace; idle workers end at
    once), then stop the app and its actors. Returns what the stop did, in words.

    Workers first: they drain while the Routers still stream what they finish (new requests
    are refused meanwhile); the pool is frozen before, so that it replaces no draining worker,
    and lives on (answering the Routers) until the app is gone. A cluster started here then
    ends whole with Ray (`end`): once nothing is in flight, taking Serve's app down first
    (3 s idle, for the replica's own shutdown loop) and the actors one by one would only add
    a window in which the Routers see their workers vanish. Only disk tiers are closed first
    (their queued block files written, for the next start).
    """
    from ray import serve

    from pagedserve.cluster.pool.group import (
        close_workers,
        drain_worker_group,
        stop_pool,
        stop_worker_group,
    )

    signals.phase = Phase.STOPPING
    config, grace = plan.config, plan.shutdown_grace_s
    print(
        f"pagedserve: {signals.name}: stopping; requests in flight get up to {grace:g} s "
        "(a second signal stops at once)",
        flush=True,
    )
    stop_pool(config)
    drained = drain_worker_group(config, grace)
    if plan.address is not None:  # a joined cluster lives on: take this app out of it (only:
        serve.delete(APP_NAME)  # Serve itself may hold other apps)
        stop_worker_group(config, drain_grace_s=0.0)
    elif config.worker_engine.kv_disk_tier_dir is not None:
        close_workers(config)
    finished = sum(result.finished for result in drained.values())
    cut = sum(result.handed_off for result in drained.values())
    return f"{finished} streams in flight finished" + (f", {cut} cut at the grace" if cut else "")


def end(
    signals: StopSignals,
    local: bool,
    line: str,
    status: int,
    error: BaseException | None = None,
    ray_lost: bool = False,
    known: dict[int, int | None] | None = None,
) -> NoReturn:
    """End Ray (this process's own cluster, or the connection to a joined one), print `line`
    last (nothing Ray forwards can follow it) and exit with `status`.

    The exit skips the interpreter's own teardown: once Ray is shut down and the output
    flushed, nothing is left to it but Ray's native client winding down, which took ~7 s
    after every stop on a 2-core machine. When the cluster is lost (`ray_lost`), Ray's own
    shutdown would wait on its GCS: what is left of a local cluster is killed instead, with
    the processes `known` to have run under this one (actors whose raylet ended are no longer
    under it)."""
    signals.phase = Phase.ENDING  # a signal from here on: `end_now_from_a_handler`
    started = descendants_now() if local else {}
    ended = ray_lost or _end_ray()
    if local:  # whatever Ray's shutdown left: the dashboard's module processes, a half start
        kill_if_running({**(known or {}), **started, **descendants_now()})
    if error is not None:
        traceback.print_exception(error)
    print(line, file=sys.stderr if status else sys.stdout, flush=True)
    if not ended:
        logger.debug("ray.shutdown did not return within %s s", RAY_SHUTDOWN_TIMEOUT_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _end_ray() -> bool:
    """`ray.shutdown`, within `RAY_SHUTDOWN_TIMEOUT_S`; whether it returned."""
    import ray

    done = threading.Event()

    def shutdown() -> None:
        try:
            ray.shutdown(wait_for_processes=True)
        except Exception:  # noqa: BLE001 (a lost cluster: its processes end below)
            logger.debug("ray.shutdown failed", exc_info=True)
        done.set()

    threading.Thread(target=shutdown, name="ray-shutdown", daemon=True).start()
    return done.wait(RAY_SHUTDOWN_TIMEOUT_S)


def place_local_cluster(config: ClusterConfig) -> None:
    """Pin this process and the local Ray cluster it started (GCS, raylet, Serve's proxy and
    controller, pooled workers: every process under this one) to `control_cpus`, and give
    each of them `control_nice`: Ray's actors (started at 15) and its daemons (the GCS, the
    raylet, the dashboard agent, the log monitor: started at this process's niceness) alike.
    The exception is the raylet where this process may not lower a niceness: Ray starts every
    later actor (a replaced worker, the pool's next one) 15 above the raylet, and such a
    worker could not come back down to `worker_nice`. The worker actors are left as they
    placed themselves.

    The daemons spend ~30 CPU-ms a second idle, none of it on a token's way; at 0 each of
    their wakeups could preempt an engine thread mid-step as readily as the engine's own. At
    5, at 1 req/s on 2 cores, TPOT p50 was 1.08x better (1.00-1.12) and TTFT p50 1.10x
    (bench/README.md, "Ray's metrics, leases, Ray's daemons below the engine")."""
    import ray

    from pagedserve.workers.process.cpu_placement import (
        descendants,
        format_cpu_list,
        may_lower_niceness,
        niceness,
        pin_process,
        set_niceness,
    )

    handles = [
        ray.get_actor(config.actors.worker_name(i), namespace=config.namespace)
        for i in range(config.scaling.num_workers)
    ]
    workers = {info.pid for info in ray.get([h.describe.remote() for h in handles])}
    cpus, nice = config.placement.control_cpu_set, config.placement.control_nice
    placed = 0
    keep_niceness = (
        set()
        if may_lower_niceness()
        else {pid for pid, (comm, _) in live_children(os.getpid()).items() if comm == "raylet"}
    )
    for pid in [os.getpid(), *descendants(os.getpid())]:
        if pid in workers:
            continue
        try:
            if cpus is not None:
                pin_process(cpus, pid, what="control plane")
            if nice is not None and pid not in keep_niceness and niceness(pid) != nice:
                set_niceness(nice, pid, what="control plane")
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        placed += 1
    where = "any core" if cpus is None else f"cores {format_cpu_list(cpus)}"
    print(
        f"pagedserve: control plane ({placed} processes) on {where}, niceness "
        f"{'as Ray set it' if nice is None else nice}; workers on "
        f"{config.placement.worker_cpus or 'any core'}, niceness {config.placement.worker_nice}",
        flush=True,
    )
