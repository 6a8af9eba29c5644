"""Starting, finding and stopping the named actors of one app: the prefix index, the worker
pool and the workers it owns (`cluster/pool/pool.py`).

These are the app's own lifecycle (the app builder, `pagedserve serve`, benchmarks and tests
call them), so they take the whole `ClusterConfig` and hand each actor its part: the pool its
`PoolConfig`, the index its names and control-plane placement."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.index.prefix_index import get_or_create_prefix_index
from pagedserve.cluster.pool.config import PoolConfig
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
    "create_pool",
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


def create_pool(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None
) -> tuple[ActorHandle, ActorHandle]:
    """Get or create the index and the worker pool actors, and return (index, pool) at once:
    nothing here waits on them (the app builder calls it; each Router replica hands the pool
    its config when it starts, `PoolFollower.first`).

    Actors are detached and named, so router replicas share them and they outlive a router
    restart; `stop_worker_group` removes them. Created, the pool starts the first
    `num_workers` workers (or adopts those that exist).
    """
    telemetry = telemetry or TelemetryConfig()
    actors, placement = config.actors, config.placement
    # Restarted by Ray, the index asks the pool for its members now and resyncs from all of
    # them at once (the first names too, should the pool not answer then).
    index = get_or_create_prefix_index(
        name=actors.index_name,
        namespace=actors.namespace,
        worker_names=[actors.worker_name(i) for i in range(config.scaling.num_workers)],
        cpus=placement.control_cpu_set,
        nice=placement.control_nice,
        pool_name=actors.pool_name,
    )
    return index, get_or_create_worker_pool(PoolConfig.of(config), telemetry)


def start_pool(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None, revision: float = 0.0
) -> WorkerGroup:
    """`create_pool`, then hand the pool this config and wait for its answer (blocking: for
    callers outside an event loop, such as `pagedserve serve` and tests).

    From `configure` the pool follows `config` at `revision` unless it already follows a
    newer one: an engine config that differs from the workers' makes it replace them one at
    a time.
    """
    index, pool = create_pool(config, telemetry)
    # The pool's first answer comes once its process is up and it has created (or adopted)
    # the first workers' actors: on a loaded machine that took over a minute, so it gets the
    # deadline a router gives its workers to start.
    membership = ray.get(
        pool.configure.remote(PoolConfig.of(config), revision),
        timeout=config.failure.startup_timeout_s,
    )
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
    actors = config.actors
    stop_pool(config)
    drain_worker_group(config, drain_grace_s)
    if config.engine.kv_disk_tier_dir is not None:
        close_workers(config)
    for name in existing_workers(actors):
        _kill(name, actors.namespace)
    _kill(actors.pool_name, actors.namespace)
    _kill(actors.index_name, actors.namespace)
    FollowedRevision(actors.pool_name, actors.namespace).forget()


def stop_pool(config: ClusterConfig) -> None:
    """Freeze the app's worker pool (`WorkerPoolActor.freeze`): the workers stay as they are,
    and nothing starts or retires any more of them. The pool itself lives on, answering the
    routers' membership polls (killed, it would leave every router polling a dead pool), until
    `stop_worker_group` kills it; one that does not answer in time is killed now."""
    actors = config.actors
    try:
        pool = ray.get_actor(actors.pool_name, namespace=actors.namespace)
    except ValueError:
        return  # none: nothing decides
    try:
        ray.get(pool.freeze.remote(), timeout=config.failure.rpc_timeout_s)
    except Exception as error:  # dead, restarting or stuck: it must not decide on
        logger.warning("the worker pool did not freeze (%r); killing it", error)
        _kill(actors.pool_name, actors.namespace)


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
    grace_s = config.failure.drain_grace_s if drain_grace_s is None else drain_grace_s
    workers = _existing(config, list(existing_workers(config.actors)))
    refs = {name: handle.drain.remote(grace_s) for name, handle in workers.items()}
    if not refs:
        return {}
    deadline_s = grace_s + config.failure.rpc_timeout_s
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
    workers = _existing(config, list(existing_workers(config.actors)))
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
            handles[name] = ray.get_actor(name, namespace=config.actors.namespace)
        except ValueError:
            continue
    return handles


def _kill(name: str, namespace: str) -> None:
    with contextlib.suppress(ValueError):  # missing: nothing to stop
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
