"""What the app takes at most, and what it tells a client it refuses: request sizes, queue
and stream bounds, the retry hint, and each tenant's share and quotas. Read by the front
ends (`cluster/api/`), the router's admission, Serve's proxy options and each worker's
engine (its queue bound and tenant weights: `worker_engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedserve.cluster.config.checks import at_least, positive_finite
from pagedserve.cluster.router.tenant_quotas import EVERY_TENANT, TenantPolicy, tenant_policies
from pagedserve.cluster.router.types import BackpressureLimits
from pagedserve.workers.engine.config import EngineConfig


@dataclass(frozen=True)
class LimitsConfig:
    """Size limits, backpressure and tenants.

    Attributes:
        max_prompt_chars: longest prompt the router takes, in characters (or token ids); a
            longer one is refused before it is tokenized.
        max_request_bytes: largest request body, HTTP body or gRPC message; a larger one is
            refused before it is parsed (HTTP 413, gRPC RESOURCE_EXHAUSTED).
        max_pending_grpc_calls: gRPC calls Serve's proxy holds before its event loop takes
            them up; past it gRPC itself drops a new call (CANCELLED, no details, no retry
            hint), so it must exceed the largest burst (gRPC's default drops from 1,000 on:
            see `api.grpc.backlog`). A held call costs the proxy its stream and headers.
        max_waiting_per_worker: new requests a worker's engine queues at most; past it the
            worker refuses at once with `Overloaded` (RESOURCE_EXHAUSTED, HTTP 429). None:
            unbounded.
        max_inflight: requests the router streams at once; past it it refuses at once, the
            same way. None: unbounded.
        retry_after_s: the retry hint a refusal carries.
        max_buffered_deltas: deltas a worker buffers per stream; past it the request is
            paused (it keeps its blocks) until the reader catches up.
        tenants: tenant id (the auth token's, `cluster/api/auth.py`) or `*` (every tenant not
            named) → its `weight` in each worker's fair share of the engine and its optional
            quotas per router replica, `max_inflight` and `tokens_per_minute`
            (`cluster/router/tenant_quotas.py`, docs/fairness.md).
    """

    max_prompt_chars: int = 1_000_000
    max_request_bytes: int = 8 * 1024 * 1024
    max_pending_grpc_calls: int = 20_000
    max_waiting_per_worker: int | None = 256
    max_inflight: int | None = 1024
    retry_after_s: float = 1.0
    max_buffered_deltas: int = 64
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", tenant_policies(self.tenants))
        at_least(self, 1, "max_waiting_per_worker", "max_inflight", optional=True)
        at_least(
            self,
            1,
            "max_prompt_chars",
            "max_request_bytes",
            "max_pending_grpc_calls",
            "max_buffered_deltas",
        )
        positive_finite(self, "retry_after_s")

    @property
    def backpressure(self) -> BackpressureLimits:
        """The backpressure limits, as `cluster_stats` reports them."""
        return BackpressureLimits(
            max_waiting_per_worker=self.max_waiting_per_worker,
            max_inflight=self.max_inflight,
            retry_after_s=self.retry_after_s,
        )

    def worker_engine(self, engine: EngineConfig) -> EngineConfig:
        """The engine config each worker is built from: `engine` with this queue bound and
        the tenants' weights."""
        fair_share = engine.fair_share
        if self.tenants:
            weights = {t: p.weight for t, p in self.tenants.items() if t != EVERY_TENANT}
            every = self.tenants.get(EVERY_TENANT)
            fair_share = replace(
                fair_share,
                tenant_weights={**fair_share.tenant_weights, **weights},
                default_weight=every.weight if every else fair_share.default_weight,
            )
        return replace(engine, max_waiting=self.max_waiting_per_worker, fair_share=fair_share)
