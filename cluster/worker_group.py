"""Starting, finding and stopping the named actors of one app: the prefix index and workers."""

from __future__ import annotations

import logging

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.prefix_index import get_or_create_prefix_index
from pagedserve.workers.telemetry import TelemetryConfig, otel_env
from pagedserve.workers.worker import Worker

logger = logging.getLogger(__name__)

# Generous: a worker streams many requests at once, each a long-lived generator call.
WORKER_MAX_CONCURRENCY = 4096
# How long a stop waits for a worker to flush its disk tier (at most 64 MiB of queued writes).
WORKER_CLOSE_TIMEOUT_S = 30.0


def start_worker_group(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None
) -> tuple[ActorHandle, dict[str, ActorHandle]]:
    """Get or create the index and every worker; returns (index, {worker_id: handle}).

    Actors are detached and named, so router replicas share them and they outlive a router
    restart; `stop_worker_group` removes them. Ray restarts a crashed worker (max_restarts),
    and the router re-registers it once it answers again. Workers get the telemetry settings
    at creation and this process's OTEL_* variables in their runtime env, and
    `OMP_NUM_THREADS` when `worker_threads` or `worker_cpus` is set; with `worker_cpus` each
    pins itself to its share of those cores.
    """
    telemetry = telemetry or TelemetryConfig()
    names = [config.worker_name(i) for i in range(config.num_workers)]
    # The index gets the names so that, restarted by Ray, it resyncs from every worker at once.
    index = get_or_create_prefix_index(
        name=config.index_name,
        namespace=config.namespace,
        worker_names=names,
        cpus=config.control_cpu_set,
        nice=config.control_nice,
    )
    remote_worker = ray.remote(Worker)
    workers = {}
    for i, worker_id in enumerate(names):
        env = otel_env()
        threads = config.worker_thread_count(i)
        if threads is not None:  # torch reads it at import: set it before the actor starts
            env["OMP_NUM_THREADS"] = str(threads)
        runtime_env = {"env_vars": env} if env else None
        workers[worker_id] = remote_worker.options(
            name=worker_id,
            namespace=config.namespace,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,
            max_task_retries=0,
            num_gpus=config.worker_num_gpus,
            num_cpus=config.worker_num_cpus,
            resources=dict(config.worker_resources),
            max_concurrency=WORKER_MAX_CONCURRENCY,
            runtime_env=runtime_env,
        ).remote(
            worker_id,
            config.worker_engine,
            config.index_name,
            config.namespace,
            telemetry,
            lease_timeout_s=config.lease_timeout_s,
            max_buffered_deltas=config.max_buffered_deltas,
            cpus=config.worker_cpu_share(i),
            nice=config.worker_nice,
        )
    return index, workers


def stop_worker_group(config: ClusterConfig) -> None:
    """Kill the app's named actors (no restart). Missing ones are skipped.

    With a disk tier, each worker is first closed (`Worker.close`, under a deadline) so that
    its queued block files are written before the kill: the next worker on the directory
    finds them.
    """
    worker_names = [config.worker_name(i) for i in range(config.num_workers)]
    if config.worker_engine.kv_disk_tier_dir is not None:
        _close_workers(config, worker_names)
    for name in [*worker_names, config.index_name]:
        try:
            ray.kill(ray.get_actor(name, namespace=config.namespace), no_restart=True)
        except ValueError:
            continue


def _close_workers(config: ClusterConfig, names: list[str]) -> None:
    """Close every worker still there, at once; one that fails or is late is killed as is."""
    closing = []
    for name in names:
        try:
            closing.append((name, ray.get_actor(name, namespace=config.namespace).close.remote()))
        except ValueError:
            continue
    for name, ref in closing:
        try:
            ray.get(ref, timeout=WORKER_CLOSE_TIMEOUT_S)
        except Exception as error:  # dead, restarting or stuck: its pending writes are lost
            logger.warning("worker %s did not close (%r); killing it anyway", name, error)
