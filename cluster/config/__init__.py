"""The app's config, by concern: `ClusterConfig` holds the engine's config and one section
per concern, each its own frozen dataclass that checks its own fields.

    cluster.py    ClusterConfig (the sections, plain data → config: `from_dict`, `nest`)
    scaling.py    ScalingConfig: workers (bounds, autoscaling, P/D roles), Router replicas
    placement.py  PlacementConfig: Ray resources, pinned cores, niceness
    routing.py    RoutingConfig: the routing policy, pull/push, tier and LoRA costs
    failure.py    FailureConfig (and FailureMode): deadlines, liveness, leases, drains
    limits.py     LimitsConfig: sizes, backpressure, retry hint, tenants
    names.py      ActorNames: the app's named actors
    checks.py     the field checks the sections share

Each part of the app is handed only the sections it reads (the worker pool its
`PoolConfig`, `cluster/pool/config.py`; the router its `RouterConfig`,
`cluster/router/config.py`).
"""

from pagedserve.cluster.config.cluster import SECTION_OF, SECTIONS, ClusterConfig, nest
from pagedserve.cluster.config.failure import FAILURE_MODES, FailureConfig, FailureMode
from pagedserve.cluster.config.limits import LimitsConfig
from pagedserve.cluster.config.names import ActorNames
from pagedserve.cluster.config.placement import PlacementConfig
from pagedserve.cluster.config.routing import RoutingConfig
from pagedserve.cluster.config.scaling import ScalingConfig

__all__ = [
    "FAILURE_MODES",
    "SECTIONS",
    "SECTION_OF",
    "ActorNames",
    "ClusterConfig",
    "FailureConfig",
    "FailureMode",
    "LimitsConfig",
    "PlacementConfig",
    "RoutingConfig",
    "ScalingConfig",
    "nest",
]
