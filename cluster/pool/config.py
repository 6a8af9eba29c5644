"""`PoolConfig`: what the worker pool reads of the app's config, and nothing else.

The app builder (`cluster/app.py`) makes one from the `ClusterConfig` and hands it to the pool
actor at its creation; each Router replica carries it to hand again (`WorkerPoolActor.configure`)
should the pool restart or follow an older revision. The pool never sees the routers' limits,
the front ends' settings or the routing policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.cluster.config import (
    ActorNames,
    ClusterConfig,
    FailureConfig,
    RoutingConfig,
    ScalingConfig,
)
from pagedserve.cluster.pool.spec import WorkerSpec


@dataclass(frozen=True)
class PoolConfig:
    """The pool's sections of the app config.

    Attributes:
        spec: how each worker is built (its fingerprint tells a stale worker).
        scaling: the pool's bounds, autoscaling signals and P/D layout.
        failure: the deadlines of its calls, the routers' stats interval and lease.
        routing: the push settings of a leaving worker's cache handover.
        actors: the names of the app's actors (its own, the index's, the workers').
    """

    spec: WorkerSpec
    scaling: ScalingConfig
    failure: FailureConfig
    routing: RoutingConfig
    actors: ActorNames

    @classmethod
    def of(cls, config: ClusterConfig) -> PoolConfig:
        return cls(
            spec=WorkerSpec.of(config),
            scaling=config.scaling,
            failure=config.failure,
            routing=config.routing,
            actors=config.actors,
        )
