"""Starting, finding and stopping the named actors of one app: the prefix index and workers."""

from __future__ import annotations

import logging

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.grpc_backlog import setup_hook_env_var
from pagedserve.cluster.prefix_index import get_or_create_prefix_index
from pagedserve.workers import drain_signal
from pagedserve.workers.telemetry import TelemetryConfig, otel_env
from pagedserve.workers.worker import Worker
from pagedserve.workers.worker_types import DrainResult

logger = logging.getLogger(__name__)

# Generous: a worker streams many requests at once, each a long-lived generator call.
WORKER_MAX_CONCURRENCY = 4096


def start_worker_group(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None
) -> tuple[ActorHandle, dict[str, ActorHandle]]:
    """Get or create the index and every worker; returns (index, {worker_id: handle}).

    Actors are detached and named, so router replicas share them and they outlive a router
    restart; `stop_worker_group` removes them. Ray restarts a crashed worker (max_restarts),
    and the router re-registers it once it answers again. Workers get the telemetry settings
    at creation and this process's OTEL_* variables in their runtime env, and
    `OMP_NUM_THREADS` when `worker_threads` or `worker_cpus` is set; with `worker_cpus` each
    pins itself to its share of those cores. Each worker's process runs the setup hook that
    makes SIGTERM drain it (`workers/drain_signal.py`).
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
        env = {**otel_env(), setup_hook_env_var(): drain_signal.SETUP_HOOK}
        threads = config.worker_thread_count(i)
        if threads is not None:  # torch reads it at import: set it before the actor starts
            env["OMP_NUM_THREADS"] = str(threads)
        runtime_env = {"env_vars": env}
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
            drain_grace_s=config.drain_grace_s,
        )
    return index, workers


def stop_worker_group(config: ClusterConfig, drain_grace_s: float | None = None) -> None:
    """Drain every worker (`drain_worker_group`), then kill the app's named actors (no
    restart). Missing ones are skipped; a worker that does not drain is killed anyway."""
    drain_worker_group(config, drain_grace_s)
    names = [config.worker_name(i) for i in range(config.num_workers)] + [config.index_name]
    for handle in _existing(config, names).values():
        ray.kill(handle, no_restart=True)


def drain_worker_group(
    config: ClusterConfig, drain_grace_s: float | None = None
) -> dict[str, DrainResult]:
    """`Worker.drain` on every worker at once: each refuses new requests and gives its open
    streams `drain_grace_s` (the config's by default) to finish; what does not finish is
    handed back to its router, as on SIGTERM. Waits at most the grace plus `rpc_timeout_s`.

    Returns:
        worker id → its drain, for the workers that answered in time.
    """
    grace_s = config.drain_grace_s if drain_grace_s is None else drain_grace_s
    workers = _existing(config, [config.worker_name(i) for i in range(config.num_workers)])
    refs = {name: handle.drain.remote(grace_s) for name, handle in workers.items()}
    if not refs:
        return {}
    deadline_s = grace_s + config.rpc_timeout_s
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=deadline_s)
    results = {}
    for name, ref in refs.items():
        if ref not in ready:
            logger.warning("worker %s did not drain within %.0f s", name, deadline_s)
            continue
        try:
            results[name] = ray.get(ref)
        except Exception as error:  # dead or restarting: nothing of it to wait for
            logger.warning("worker %s could not drain: %r", name, error)
            continue
        if results[name].handed_off:
            logger.warning(
                "worker %s: %d streams did not finish within %.0f s and were handed back",
                name,
                results[name].handed_off,
                grace_s,
            )
    return results


def _existing(config: ClusterConfig, names: list[str]) -> dict[str, ActorHandle]:
    """The named actors among `names` that exist now."""
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=config.namespace)
        except ValueError:
            continue
    return handles
