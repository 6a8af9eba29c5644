"""Fair share across tenants: the Virtual Token Counter (VTC) of "Fairness in Serving Large
Language Models" (Sheng et al., OSDI '24), as the scheduler's order between tenants.

Each tenant has a counter of the service it received: prompt tokens × `prompt_weight` plus
output tokens × `output_weight`, divided by the tenant's weight. The waiting queue admits the
next request of the backlogged tenant with the smallest counter (within a tenant, the policy's
order: priority, then arrival), and preemption takes its victim from the running tenant with the
largest. A tenant that becomes backlogged again (it had nothing queued or running here) has its
counter lifted to the smallest counter of the tenants backlogged now — or, with none, to the
counter of the last tenant that left — so that idle time is not banked as credit. Nobody waits
while there is room (work-conserving): a tenant alone gets everything.

When every slot (or block) is taken, a waiting request may take the place of the lowest-ranked
running sequence of the most-served tenant (`may_preempt_for`): at once if its own tenant has
nothing running here, was served no more and the victim's tenant runs more than one;
otherwise only if that tenant's counter exceeds
its own tenant's by more than the waiting request will cost in all. Without it a short request
of a light tenant waits for one of a flood's long requests to end (seconds, when the flood's
requests started together); with the margin two busy tenants never trade places back and
forth. The victim yields as any victim does (recompute, swap or move) and is not charged again
for what it recomputes.

Service is charged as the scheduler hands out tokens: prompt positions at `prompt_weight`,
positions past the prompt at `output_weight`, each position once per sequence (a preempted
sequence that recomputes its KV, or a rejected draft token computed again, is not charged
twice), and positions a prefix hit or a moved request's KV brought are not charged at all.

    |counter(A) - counter(B)| <= 2 × the largest weighted cost of one request

holds between two tenants backlogged throughout (the VTC paper's bound; `tests/unit/workers/
test_fair_share.py` checks it on scripted arrivals).

The counters are one worker's: each worker is fair over the requests routed to it; the router's
per-tenant quotas (`cluster/router/tenant_quotas.py`) bound what one tenant can hold cluster-wide.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.workers.protocol.stats import TenantService

if TYPE_CHECKING:
    from pagedserve.workers.engine.request import Request


def check_weight(name: str, value: object) -> float:
    """`value` as a finite float > 0, or `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class FairShareConfig:
    """How a worker's scheduler shares it among tenants.

    Attributes:
        enabled: order across tenants by their virtual token counters; False: the policy's
            order alone (one queue, as if every request were one tenant's).
        prompt_weight: the cost of one prompt token (the paper's w_p).
        output_weight: the cost of one output token (the paper's w_q: a decode step costs
            more per token than a prefill's).
        tenant_weights: tenant id → its share (2.0 gets twice the service of 1.0); a tenant
            not named has `default_weight`.
        default_weight: the share of every tenant not in `tenant_weights`.
        newcomer_steps: a tenant with nothing running here, served no more than those that
            run, has its waiting requests' prompts computed in a step of their own, without
            the running sequences' decodes (never two such steps in a row): its first token
            then waits for the step in flight and its own prompt, not for a flood's batch.
            The work is the same; the flood's next token comes that much later.
    """

    enabled: bool = True
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    newcomer_steps: bool = True

    def __post_init__(self) -> None:
        for name in ("enabled", "newcomer_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fair_share.{name} must be true or false")
        check_weight("fair_share.prompt_weight", self.prompt_weight)
        check_weight("fair_share.output_weight", self.output_weight)
        check_weight("fair_share.default_weight", self.default_weight)
        weights = dict(self.tenant_weights)
        for tenant, weight in weights.items():
            check_weight(f"fair_share.tenant_weights[{tenant!r}]", weight)
        object.__setattr__(self, "tenant_weights", weights)

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_weight)


class VirtualTokenCounters:
    """Owns every tenant's counter and its count of sequences here, and what each sequence
    was charged for (its high-water position), so that nothing is charged twice.

    Args:
        config: the weights.
    """

    def __init__(self, config: FairShareConfig) -> None:
        self.config = config
        self.tenants: dict[str, TenantService] = {}
        self._charged: dict[Request, int] = {}  # sequence → positions charged so far
        self._last_left = 0.0  # the counter of the last tenant that left (the idle floor)

    def _service(self, tenant: str) -> TenantService:
        service = self.tenants.get(tenant)
        if service is None:
            service = self.tenants[tenant] = TenantService()
        return service

    def backlogged(self) -> Iterable[str]:
        return (tenant for tenant, s in self.tenants.items() if s.sequences)

    def arrive(self, request: Request) -> None:
        """A sequence joined this scheduler; a tenant that had none is lifted (no banking)."""
        service = self._service(request.tenant)
        if not service.sequences:
            others = [self.tenants[t].counter for t in self.backlogged()]
            floor = min(others) if others else self._last_left
            service.counter = max(service.counter, floor)
        service.sequences += 1

    def leave(self, request: Request) -> None:
        """A sequence left this scheduler (finished, aborted, moved, handed off)."""
        self._charged.pop(request, None)
        service = self.tenants.get(request.tenant)
        if service is None or not service.sequences:
            return
        service.sequences -= 1
        if not service.sequences:
            self._last_left = service.counter

    def charge(self, request: Request, num_new: int) -> None:
        """`request` computes positions [num_computed, num_computed + num_new) this step;
        charge those never charged before."""
        start = max(request.num_computed_tokens, self._charged.get(request, 0))
        end = request.num_computed_tokens + num_new
        if end <= start:
            return
        self._charged[request] = end
        prompt = max(0, min(end, request.prompt_len) - start)
        output = end - start - prompt
        service = self._service(request.tenant)
        service.prompt_tokens += prompt
        service.output_tokens += output
        cost = prompt * self.config.prompt_weight + output * self.config.output_weight
        service.counter += cost / self.config.weight(request.tenant)

    def may_preempt_for(
        self, waiting: Request, victim: Request, running: Mapping[str, int]
    ) -> bool:
        """Whether `waiting` may take running `victim`'s place (`running`: each tenant's
        running sequences here). `victim`'s tenant must be another, served at least as much
        as `waiting`'s. A tenant with nothing running here takes a slot at once from one that
        runs more than one: its request would otherwise wait for a flood's requests to end,
        and it cannot be preempted back through this rule (the victim's tenant still runs). A
        tenant that runs here must be behind by more than `waiting` will cost in all: the
        hysteresis that keeps two busy tenants from preempting each other back and forth
        (once in, `waiting` cannot bring its tenant past the victim's)."""
        if victim.tenant == waiting.tenant:
            return False
        gap = self.counter(victim.tenant) - self.counter(waiting.tenant)
        if not running.get(waiting.tenant) and running.get(victim.tenant, 0) > 1:
            return gap >= 0
        config = self.config
        cost = waiting.prompt_len * config.prompt_weight
        cost += waiting.params.max_tokens * config.output_weight
        return gap > cost / config.weight(waiting.tenant)

    def counter(self, tenant: str) -> float:
        service = self.tenants.get(tenant)
        return service.counter if service is not None else 0.0

    def snapshot(self) -> dict[str, TenantService]:
        """A copy of every tenant's service (for stats)."""
        return {t: TenantService(**vars(s)) for t, s in self.tenants.items()}


def tenant_heads(candidates: Iterable[Request], counters: VirtualTokenCounters) -> list[Request]:
    """Each tenant's first candidate (candidates come in the policy's order, so that is the
    tenant's best), the least-served tenant's first; ties go to the policy's order."""
    heads: dict[str, Request] = {}
    for request in candidates:
        heads.setdefault(request.tenant, request)
    order = sorted(
        enumerate(heads.values()), key=lambda i_r: (counters.counter(i_r[1].tenant), i_r[0])
    )
    return [request for _, request in order]


def fairest_first(candidates: Iterable[Request], counters: VirtualTokenCounters) -> Request | None:
    """The request to admit next: the least-served tenant's first candidate."""
    heads = tenant_heads(candidates, counters)
    return heads[0] if heads else None


def most_served_last(running: Iterable[Request], counters: VirtualTokenCounters) -> Request | None:
    """The victim: the last (lowest-ranked, in the policy's order) sequence of the running
    tenant with the largest counter; ties go to the policy's order (the latest)."""
    victim: Request | None = None
    victim_counter = -math.inf
    for request in running:  # policy order: of equals, the later one wins
        counter = counters.counter(request.tenant)
        if counter >= victim_counter:
            victim, victim_counter = request, counter
    return victim
