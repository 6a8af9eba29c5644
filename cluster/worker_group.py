"""Starting, finding and stopping the named actors of one app: the prefix index, the worker
pool and the workers it owns (`cluster/worker_pool.py`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.pool_types import MemberState
from pagedserve.cluster.prefix_index import get_or_create_prefix_index
from pagedserve.cluster.worker_pool import existing_workers, get_or_create_worker_pool
from pagedserve.cluster.worker_spec import WORKER_MAX_CONCURRENCY
from pagedserve.workers.telemetry import TelemetryConfig

__all__ = ["WORKER_MAX_CONCURRENCY", "WorkerGroup", "start_pool", "start_worker_group"]

logger = logging.getLogger(__name__)
CALL_TIMEOUT_S = 60.0  # the pool's first answer: it creates the first workers' actors first


@dataclass(frozen=True)
class WorkerGroup:
    """An app's actors: the index, the pool, and the pool's members now (starting or serving)."""

    index: ActorHandle
    pool: ActorHandle
    workers: dict[str, ActorHandle]


def start_pool(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None, revision: float = 0.0
) -> WorkerGroup:
    """Get or create the index and the worker pool, and hand the pool this config.

    Actors are detached and named, so router replicas share them and they outlive a router
    restart; `stop_worker_group` removes them. The pool creates the first `num_workers`
    workers (or adopts those that exist) and, from `configure`, follows `config` at
    `revision` unless it already follows a newer one: an engine config that differs from
    the workers' makes it replace them one at a time.
    """
    telemetry = telemetry or TelemetryConfig()
    # Restarted by Ray, the index asks the pool for its members now and resyncs from all of
    # them at once (the first names too, should the pool not answer then).
    index = get_or_create_prefix_index(
        name=config.index_name,
        namespace=config.namespace,
        worker_names=[config.worker_name(i) for i in range(config.num_workers)],
        cpus=config.control_cpu_set,
        nice=config.control_nice,
        pool_name=config.pool_name,
    )
    pool = get_or_create_worker_pool(config, telemetry)
    membership = ray.get(pool.configure.remote(config, revision), timeout=CALL_TIMEOUT_S)
    current = membership.in_state(MemberState.STARTING, MemberState.SERVING)
    return WorkerGroup(index, pool, {w: m.handle for w, m in current.items()})


def start_worker_group(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None
) -> tuple[ActorHandle, dict[str, ActorHandle]]:
    """`start_pool`, as (index, {worker_id: handle}) for callers that follow no membership."""
    group = start_pool(config, telemetry)
    return group.index, group.workers


def stop_worker_group(config: ClusterConfig) -> None:
    """Kill the app's named actors (no restart): the pool first, so that it starts no more
    workers, then every worker of the app's name pattern, then the index."""
    _kill(config.pool_name, config.namespace)
    for name in existing_workers(config):
        _kill(name, config.namespace)
    _kill(config.index_name, config.namespace)


def _kill(name: str, namespace: str) -> None:
    with contextlib.suppress(ValueError):  # missing: nothing to stop
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
