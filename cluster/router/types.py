"""What the router reports (its counters, its in-flight requests, the cluster's stats), apart
from `RouterCore` so that light modules (gRPC conversion, clients, benches) can name them.
Import them from here, never from `cluster/router/router.py` (which only uses them). What it
takes and raises (`GenerateRequest`, `NoWorkerAvailable`, `WorkerLost`) is in
`workers/protocol/`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from pagedserve.cluster.index.stats import IndexStats
from pagedserve.cluster.index.view import ViewStats
from pagedserve.cluster.router.tenant_quotas import TenantCounts
from pagedserve.workers.protocol.stats import WorkerInfo, WorkerStats

if TYPE_CHECKING:  # it imports `RouterCounters` from here
    from pagedserve.cluster.router.reports import ClusterRouters


class MigrationKind(StrEnum):
    """How KV went from one worker to another (`cluster/pool/migration.py`): its span's name
    (`migration.<kind>`) and its metrics' label."""

    PULL = "pull"
    PUSH = "push"
    MOVE = "move"


@dataclass
class RouterCounters:
    """What one router counted since it started (`cluster_stats().router`).

    `as_dict` gives the flat names the gRPC `router_counters` map and dashboards use
    (`routed.kv_aware`, `migrations.pull_blocks`, `refused.router`, ...).
    """

    routed: dict[str, int] = field(default_factory=dict)  # decisions per routing policy
    prefix_hits: int = 0  # routed to a worker holding part of the prompt
    prefix_misses: int = 0
    moves: int = 0
    pulls: int = 0
    pull_blocks: int = 0
    pushes: int = 0
    push_blocks: int = 0
    replays: int = 0
    workers_lost: int = 0
    workers_stalled: int = 0
    legs_retried: int = 0  # a replay or move leg refused by one worker, sent to the next
    workers_restarted: int = 0
    workers_drained: int = 0
    drain_handoffs: int = 0  # streams a draining worker cut off (replayed on a peer)
    refused_router: int = 0  # past `max_inflight`
    refused_worker: int = 0  # a worker's waiting queue was full
    refused_draining: int = 0  # a draining worker refused a new request (replayed)
    refused_duplicate_id: int = 0
    index_unavailable: int = 0  # prefix feed reads that failed: routing kept its last view
    pd_handoffs: int = 0  # P/D: requests (branches) handed from a prefill to a decode worker
    pd_handoff_tokens: int = 0  # the KV tokens those handoffs carried
    pd_fallbacks: int = 0  # P/D: no worker of the phase's role routable, any one taken
    refused_tenant: int = 0  # past a tenant's quota (`cluster/router/tenant_quotas.py`)
    # Run-time LoRA adapters loaded onto a worker that joined later (`RouterLoras.follow_loras`),
    # and those that failed there (logged; the worker serves the others).
    lora_healed: int = 0
    lora_heal_failures: int = 0
    tenants: dict[str, TenantCounts] = field(default_factory=dict)  # tenant id → its counts

    def count_routed(self, policy: str) -> None:
        self.routed[policy] = self.routed.get(policy, 0) + 1

    def tenant(self, tenant: str) -> TenantCounts:
        counts = self.tenants.get(tenant)
        if counts is None:
            counts = self.tenants[tenant] = TenantCounts()
        return counts

    def add(self, other: RouterCounters) -> None:
        """Add another router's counts to these (cluster totals: `cluster/router/reports.py`)."""
        for policy, n in other.routed.items():
            self.routed[policy] = self.routed.get(policy, 0) + n
        for tenant, counts in other.tenants.items():
            self.tenant(tenant).add(counts)
        for name in _FLAT_NAMES:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        flat = {f"routed.{policy}": n for policy, n in sorted(self.routed.items())}
        for name, key in _FLAT_NAMES.items():
            flat[key] = getattr(self, name)
        for tenant, counts in sorted(self.tenants.items()):  # "" (auth off): `anonymous`
            for name, value in vars(counts).items():
                flat[f"tenant.{tenant or 'anonymous'}.{name}"] = value
        return flat


_FLAT_NAMES = {
    "prefix_hits": "routed.prefix_hit",
    "prefix_misses": "routed.prefix_miss",
    "moves": "migrations.move",
    "pulls": "migrations.pull",
    "pull_blocks": "migrations.pull_blocks",
    "pushes": "migrations.push",
    "push_blocks": "migrations.push_blocks",
    "replays": "replays",
    "workers_lost": "workers_lost",
    "workers_stalled": "workers_stalled",
    "legs_retried": "legs_retried",
    "workers_restarted": "workers_restarted",
    "workers_drained": "workers_drained",
    "drain_handoffs": "drain_handoffs",
    "refused_router": "refused.router",
    "refused_worker": "refused.worker",
    "refused_draining": "refused.draining",
    "refused_duplicate_id": "refused.duplicate_id",
    "index_unavailable": "index_unavailable",
    "pd_handoffs": "pd.handoffs",
    "pd_handoff_tokens": "pd.handoff_tokens",
    "pd_fallbacks": "pd.fallbacks",
    "refused_tenant": "refused.tenant",
    "lora_healed": "lora.healed",
    "lora_heal_failures": "lora.heal_failures",
}


@dataclass(frozen=True)
class BackpressureLimits:
    """The limits past which the cluster refuses at once (RESOURCE_EXHAUSTED / HTTP 429)."""

    max_waiting_per_worker: int | None
    max_inflight: int | None
    retry_after_s: float


@dataclass(frozen=True)
class WorkerView:
    """One worker as a router sees it: alive, its own in-flight count, its last report."""

    worker_id: str
    alive: bool
    inflight: int
    info: WorkerInfo | None
    stats: WorkerStats | None


@dataclass(frozen=True)
class RouterInflight:
    """`RouterCore.inflight()`: what one router holds open now (all empty once it is idle).

    Attributes:
        request_ids: the (tenant-scoped) ids reserved by requests still streaming.
        num_requests: the router's own count of them (admission's limit is checked on it).
        workers: worker id → (requests, demand tokens) the router counts on that worker, for
            the workers where either is not 0.
    """

    request_ids: tuple[str, ...]
    num_requests: int
    workers: dict[str, tuple[int, int]]

    @property
    def idle(self) -> bool:
        return not self.request_ids and not self.num_requests and not self.workers


@dataclass(frozen=True)
class ClusterStats:
    """`RouterCore.cluster_stats()`: every worker, this router's counters, every router
    replica's summed (`cluster`, from the index actor: None when it did not answer), the index
    (as the index actor reports it) and this router's own prefix view of it."""

    workers: dict[str, WorkerView]
    router: RouterCounters
    limits: BackpressureLimits
    index: IndexStats | None
    policy: str
    view: ViewStats | None = None
    cluster: ClusterRouters | None = None
