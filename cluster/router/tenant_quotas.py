"""Per-tenant settings and the router's admission by tenant: optional quotas on what one tenant
holds (requests in flight, tokens per minute), refused at once with a retry hint the same way
as the router's own limit (`Overloaded`: RESOURCE_EXHAUSTED / HTTP 429 with `retry-after`).

A tenant is the auth token's (`cluster/api/auth.py`: the first 16 hex digits of the token's
SHA-256; "" with auth off). The cluster config names tenants by that id, and `*` for every
tenant not named:

    tenants:
      "*":              {max_inflight: 64}
      9f86d081884c7d65: {weight: 2.0, tokens_per_minute: 600000}

`weight` goes to every worker's scheduler (`workers/scheduler/fair_share.py`: its share of the
engine, counted in weighted tokens); the quotas are each router replica's (as `max_inflight` is).

Tokens per minute is a token bucket holding at most a minute's tokens and refilled at the
quota's rate: a request takes its prompt tokens plus `max_tokens × n` when admitted, and what
it did not generate goes back when it ends. A request that asks for more than a whole minute's
tokens can never pass and is refused as invalid (400 / INVALID_ARGUMENT), not overloaded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.workers.protocol.errors import Overloaded, RequestRejected
from pagedserve.workers.scheduler.fair_share import check_weight

EVERY_TENANT = "*"


class TenantQuotaExceeded(Overloaded):
    """A tenant is at one of its quotas now; retry after `retry_after_s`."""


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's share and quotas.

    Attributes:
        weight: its share of each worker's engine (2.0: twice the service of 1.0).
        max_inflight: its requests a router replica streams at once (None: no quota).
        tokens_per_minute: prompt + output tokens it may use per minute on a router replica
            (None: no quota).
    """

    weight: float = 1.0
    max_inflight: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        check_weight("weight", self.weight)
        for name in ("max_inflight", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")


def tenant_policies(data: Mapping[str, Any]) -> dict[str, TenantPolicy]:
    """The cluster config's `tenants` (tenant id or `*` → a policy or a dict of its fields)."""
    policies = {}
    for tenant, policy in dict(data).items():
        if isinstance(policy, TenantPolicy):
            policies[tenant] = policy
            continue
        if not isinstance(policy, Mapping):
            raise ValueError(f"tenants[{tenant!r}] must be a mapping, got {policy!r}")
        unknown = sorted(set(policy) - {"weight", "max_inflight", "tokens_per_minute"})
        if unknown:
            raise ValueError(f"tenants[{tenant!r}]: unknown keys {', '.join(unknown)}")
        try:
            policies[tenant] = TenantPolicy(**policy)
        except ValueError as error:
            raise ValueError(f"tenants[{tenant!r}].{error}") from None
    return policies


def policy_of(policies: Mapping[str, TenantPolicy], tenant: str) -> TenantPolicy:
    return policies.get(tenant) or policies.get(EVERY_TENANT) or TenantPolicy()


@dataclass
class TenantCounts:
    """What one router counted of one tenant (`RouterCounters.tenants`)."""

    admitted: int = 0
    refused_inflight: int = 0  # past its `max_inflight`
    refused_tokens: int = 0  # past its `tokens_per_minute`
    prompt_tokens: int = 0  # of its admitted requests
    output_tokens: int = 0  # streamed to it

    def add(self, other: TenantCounts) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class TenantAdmission:
    """Owns each tenant's requests in flight on this router and its token bucket.

    Args:
        policies: tenant id (or `*`) → its policy.
        retry_after_s: the least retry hint a refusal carries.
        clock: monotonic seconds (tests inject one).
    """

    policies: Mapping[str, TenantPolicy]
    retry_after_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    inflight: dict[str, int] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def enter(self, tenant: str) -> None:
        """Count a new request of `tenant`, or raise `TenantQuotaExceeded` (nothing counted)."""
        limit = policy_of(self.policies, tenant).max_inflight
        held = self.inflight.get(tenant, 0)
        if limit is not None and held >= limit:
            raise TenantQuotaExceeded(
                f"this tenant streams its limit of {limit} requests", self.retry_after_s
            )
        self.inflight[tenant] = held + 1

    def leave(self, tenant: str) -> None:
        held = self.inflight.get(tenant, 0) - 1
        if held > 0:
            self.inflight[tenant] = held
        else:
            self.inflight.pop(tenant, None)

    def take_tokens(self, tenant: str, tokens: int) -> None:
        """Take `tokens` from the tenant's bucket, or raise: `TenantQuotaExceeded` (with the
        seconds until the bucket holds them) when it is short now, `RequestRejected` when it
        can never hold them."""
        rate = policy_of(self.policies, tenant).tokens_per_minute
        if rate is None:
            return
        bucket = self._refill(tenant, rate)
        if tokens > rate:
            raise RequestRejected(
                f"max_tokens: the request needs {tokens} tokens (prompt + max_tokens × n), "
                f"more than this tenant's {rate} tokens per minute"
            )
        if bucket.tokens < tokens:
            wait_s = (tokens - bucket.tokens) * 60.0 / rate
            raise TenantQuotaExceeded(
                f"this tenant used its {rate} tokens per minute",
                max(self.retry_after_s, math.ceil(wait_s)),
            )
        bucket.tokens -= tokens

    def give_back(self, tenant: str, tokens: int) -> None:
        """Return tokens a request took but did not use."""
        rate = policy_of(self.policies, tenant).tokens_per_minute
        if rate is None or tokens <= 0:
            return
        bucket = self._refill(tenant, rate)
        bucket.tokens = min(float(rate), bucket.tokens + tokens)

    def _refill(self, tenant: str, rate: int) -> _Bucket:
        now = self.clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(rate), now)
        bucket.tokens = min(float(rate), bucket.tokens + (now - bucket.at) * rate / 60.0)
        bucket.at = now
        return bucket
