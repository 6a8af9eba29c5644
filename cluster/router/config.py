"""`RouterConfig`: what a router replica reads of the app's config, and nothing else.

The app builder (`cluster/app.py`) makes one from the `ClusterConfig`; `RouterCore` hands each
of its parts the section that part reads (the liveness watch `failure`, migration `routing`,
the front ends `limits`). A router never sees the pool's scaling or the workers' placement
(only whether they share their machines' cores).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.cluster.config import ClusterConfig, FailureConfig, LimitsConfig, RoutingConfig
from pagedserve.workers.engine.config import EngineConfig


@dataclass(frozen=True)
class RouterConfig:
    """The router's sections of the app config.

    Attributes:
        engine: the workers' engine config (the router tokenizes for its model and hashes
            prompts in its block size).
        routing: the policy, pull/push, tier and LoRA costs.
        failure: deadlines, liveness, leases and what a lost worker's requests become.
        limits: sizes, backpressure, retry hint and tenants' quotas.
        disaggregated: whether prefill/decode disaggregation is on (`ScalingConfig`).
        workers_share_cores: whether the workers share their machine's cores
            (`PlacementConfig.worker_share_cores`): routing then packs light traffic.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    disaggregated: bool = False
    workers_share_cores: bool = False

    @classmethod
    def of(cls, config: ClusterConfig) -> RouterConfig:
        return cls(
            engine=config.engine,
            routing=config.routing,
            failure=config.failure,
            limits=config.limits,
            disaggregated=config.scaling.disaggregated,
            workers_share_cores=config.placement.worker_share_cores,
        )
