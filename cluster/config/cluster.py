"""`ClusterConfig`: the app's config, one section per concern, and how plain data (a YAML
file, Serve's args, flags) becomes one.

    engine:    EngineConfig      every worker's engine (`workers/engine/config.py`)
    scaling:   ScalingConfig     workers (bounds, autoscaling, P/D roles) and Router replicas
    placement: PlacementConfig   Ray resources, pinned cores and niceness
    routing:   RoutingConfig     the routing policy, pull/push, tier and LoRA costs
    failure:   FailureConfig     deadlines, liveness, leases, drains, lost workers' requests
    limits:    LimitsConfig      sizes, backpressure, retry hint, tenants
    name, namespace              the actors' names (`ActorNames`)

Each section checks its own fields when built; `ClusterConfig` checks only what spans two
(the P/D roles against the pool, `worker_threads` against each worker's slice of cores).
Each part of the app is handed the sections it reads, never the whole config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pagedserve.cluster.config.failure import FailureConfig
from pagedserve.cluster.config.limits import LimitsConfig
from pagedserve.cluster.config.names import ActorNames
from pagedserve.cluster.config.placement import PlacementConfig
from pagedserve.cluster.config.routing import RoutingConfig
from pagedserve.cluster.config.scaling import ScalingConfig
from pagedserve.workers.engine.config import EngineConfig

# Section name → its class: the YAML file's nested mappings, in this order.
SECTIONS: dict[str, type] = {
    "scaling": ScalingConfig,
    "placement": PlacementConfig,
    "routing": RoutingConfig,
    "failure": FailureConfig,
    "limits": LimitsConfig,
}
# A field name → the section that holds it (every section's field names are distinct).
SECTION_OF: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in fields(cls)}


@dataclass(frozen=True)
class ClusterConfig:
    """Everything `build_app` needs, by concern (see the module docstring).

    Attributes:
        engine: the config every worker's engine is built from.
        scaling: how many workers and Router replicas run (`ScalingConfig`).
        placement: where they run (`PlacementConfig`).
        routing: how a worker is picked and KV moves (`RoutingConfig`).
        failure: deadlines, liveness and drains (`FailureConfig`).
        limits: sizes, backpressure and tenants (`LimitsConfig`).
        namespace: Ray namespace of the named actors (index, pool, workers).
        name: prefix of the actors' names, so two apps can share a Ray cluster.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    namespace: str = "pagedserve"
    name: str = "pagedserve"

    def __post_init__(self) -> None:
        for section, cls in SECTIONS.items():
            if not isinstance(getattr(self, section), cls):
                raise TypeError(f"{section} must be a {cls.__name__}")
        self.placement.check_slices(self.scaling.num_workers)

    @property
    def actors(self) -> ActorNames:
        """The names of the app's actors."""
        return ActorNames(self.name, self.namespace)

    @property
    def worker_engine(self) -> EngineConfig:
        """The engine config each worker is built from (`LimitsConfig.worker_engine`)."""
        return self.limits.worker_engine(self.engine)

    def to_dict(self) -> dict[str, Any]:
        """Plain data in the documented (nested) shape; `from_dict` reads it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        """Build from plain data (YAML, Serve args), naming any unknown key.

        The documented shape nests each section (`scaling: {num_workers: 2}`). A field
        written at the top level, the flat shape of earlier releases (`num_workers: 2`), is
        taken into its section (`nest`), so existing files and serveConfigV2 args keep
        working; one given both ways is refused."""
        data = nest(data)
        engine = data.pop("engine", None) or {}
        if isinstance(engine, dict):
            _check_keys("engine", engine, EngineConfig)
            engine = EngineConfig(**engine)
        sections = {}
        for section, section_cls in SECTIONS.items():
            value = data.pop(section, None) or {}
            if isinstance(value, dict):
                _check_keys(section, value, section_cls)
                value = section_cls(**value)
            sections[section] = value
        _check_keys("cluster config", data, cls)
        return cls(engine=engine, **sections, **data)


def nest(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with every top-level key that is a section's field moved into that section
    (`{"num_workers": 2}` → `{"scaling": {"num_workers": 2}}`); the rest as it was.

    Raises:
        ValueError: a field given both at the top level and in its section.
    """
    nested = dict(data)
    for key in [k for k in data if k in SECTION_OF]:
        section = SECTION_OF[key]
        held = nested.get(section) or {}
        if not isinstance(held, dict):
            raise ValueError(f"{key} is {section}.{key}: give it inside {section}, not beside it")
        if key in held:
            raise ValueError(f"{key} is given twice: at the top level and as {section}.{key}")
        nested[section] = {**held, key: nested.pop(key)}
    return nested


def _check_keys(where: str, data: dict[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if not unknown:
        return
    moved = [f"{k} is {SECTION_OF[k]}.{k}" for k in unknown if k in SECTION_OF]
    hint = f" ({'; '.join(moved)})" if moved else ""
    raise ValueError(
        f"unknown {where} keys: {', '.join(unknown)}{hint}; known: {', '.join(sorted(known))}"
    )
