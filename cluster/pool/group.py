"""Starting, finding and stopping the named actors of one app: the prefix index, the worker
pool and the workers it owns (`cluster/pool/pool.py`)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.index.prefix_index import get_or_create_prefix_index
from pagedserve.cluster.pool.followed import FollowedRevision
from pagedserve.cluster.pool.pool import existing_workers, get_or_create_worker_pool
from pagedserve.cluster.pool.spec import WORKER_MAX_CONCURRENCY
from pagedserve.cluster.pool.types import MemberState
from pagedserve.workers.protocol.stats import DrainResult
from pagedserve.workers.telemetry.telemetry import TelemetryConfig

__all__ = [
    "WORKER_MAX_CONCURRENCY",
    "WorkerGroup",
    "close_workers",
    "drain_worker_group",
    "start_pool",
    "start_worker_group",
    "stop_pool",
    "stop_worker_group",
]

logger = logging.getLogger(__name__)
# How long a stop waits for a worker to write its disk tier out (at most 64 MiB queued).
WORKER_CLOSE_TIMEOUT_S = 30.0


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
    # The pool's first answer comes once its process is up and it has created (or adopted)
    # the first workers' actors: on a loaded machine that took over a minute, so it gets the
    # deadline a router gives its workers to start.
    membership = ray.get(pool.configure.remote(config, revision), timeout=config.startup_timeout_s)
    current = membership.in_state(MemberState.STARTING, MemberState.SERVING)
    return WorkerGroup(index, pool, {w: m.handle for w, m in current.items()})


def start_worker_group(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None
) -> tuple[ActorHandle, dict[str, ActorHandle]]:
    """`start_pool`, as (index, {worker_id: handle}) for callers that follow no membership."""
    group = start_pool(config, telemetry)
    return group.index, group.workers


def stop_worker_group(config: ClusterConfig, drain_grace_s: float | None = None) -> None:
    """Stop the app's named actors (no restart), losing nothing that can finish: the pool is
    frozen first, so that it starts and retires no more workers; then every worker of the
    app's name pattern drains (`drain_worker_group`), with a disk tier is closed
    (`Worker.close`: its queued block files are written, for the next worker on the
    directory) and is killed (one that does not drain or close is killed anyway); then the
    pool and the index."""
    stop_pool(config)
    drain_worker_group(config, drain_grace_s)
    if config.worker_engine.kv_disk_tier_dir is not None:
        close_workers(config)
    for name in existing_workers(config):
        _kill(name, config.namespace)
    _kill(config.pool_name, config.namespace)
    _kill(config.index_name, config.namespace)
    FollowedRevision(config.pool_name, config.namespace).forget()


def stop_pool(config: ClusterConfig) -> None:
    """Freeze the app's worker pool (`WorkerPoolActor.freeze`): the workers stay as they are,
    and nothing starts or retires any more of them. The pool itself lives on, answering the
    routers' membership polls (killed, it would leave every router polling a dead pool), until
    `stop_worker_group` kills it; one that does not answer in time is killed now."""
    try:
        pool = ray.get_actor(config.pool_name, namespace=config.namespace)
    except ValueError:
        return  # none: nothing decides
    try:
        ray.get(pool.freeze.remote(), timeout=config.rpc_timeout_s)
    except Exception as error:  # dead, restarting or stuck: it must not decide on
        logger.warning("the worker pool did not freeze (%r); killing it", error)
        _kill(config.pool_name, config.namespace)


def drain_worker_group(
    config: ClusterConfig, drain_grace_s: float | None = None
) -> dict[str, DrainResult]:
    """`Worker.drain` on every worker of the app at once: each refuses new requests and gives
    its open streams `drain_grace_s` (the config's by default) to finish; what does not
    finish is handed back to its router, as on SIGTERM. Waits at most the grace plus
    `rpc_timeout_s`.

    Returns:
        worker id → its drain, for the workers that answered in time.
    """
    grace_s = config.drain_grace_s if drain_grace_s is None else drain_grace_s
    workers = _existing(config, list(existing_workers(config)))
    refs = {name: handle.drain.remote(grace_s) for name, handle in workers.items()}
    if not refs:
        return {}
    deadline_s = grace_s + config.rpc_timeout_s
    ready = _wait_all(list(refs.values()), deadline_s)
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


def _wait_all(refs: list, timeout_s: float) -> list:
    """`ray.wait` for all of `refs` within `timeout_s`, in slices of at most a second, so that
    the caller's signal handlers run meanwhile (a second Ctrl-C ends `pagedserve serve` at
    once, not after the grace). Returns the refs that are ready."""
    end = time.monotonic() + timeout_s
    ready: list = []
    pending = refs
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, left))
        ready += done
    return ready


def close_workers(config: ClusterConfig) -> None:
    """`Worker.close` on every worker of the app at once, within `WORKER_CLOSE_TIMEOUT_S`."""
    workers = _existing(config, list(existing_workers(config)))
    refs = {name: handle.close.remote() for name, handle in workers.items()}
    for name, ref in refs.items():
        try:
            ray.get(ref, timeout=WORKER_CLOSE_TIMEOUT_S)
        except Exception as error:  # dead, restarting or stuck: its queued writes are lost
            logger.warning("worker %s did not close (%r); killing it anyway", name, error)


def _existing(config: ClusterConfig, names: list[str]) -> dict[str, ActorHandle]:
    """The named actors among `names` that exist now."""
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=config.namespace)
        except ValueError:
            continue
    return handles


def _kill(name: str, namespace: str) -> None:
    with contextlib.suppress(ValueError):  # missing: nothing to stop
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
