"""Who yields when a step runs short: the preemption victims among the running sequences.

Every choice here reads the running queue (in the policy's order: the lowest-ranked last) and
changes nothing; the scheduler (`workers/scheduler/scheduler.py`) carries it out — recompute,
swap or move. The rules, in the order they apply:

- a paused sequence first (its client stopped reading): it is the one sequence that loses no
  progress to waiting, so it yields for a running sequence and a waiting one alike;
- for a running sequence short of blocks, the lowest-ranked running sequence — with fair share
  on, the lowest-ranked of the most-served tenant (`workers/scheduler/fair_share.py`);
- for a waiting request, nothing that runs, unless fair share lets its tenant take the place of
  another served more than its own by more than the request will cost (`fair_victim`,
  `slot_claim`): a waiting request never preempts a running one otherwise (vLLM v0's priority
  policy did; v1 does not).

`tenants` is None where fair share is off: the order is then the policy's alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedserve.workers.scheduler.fair_share import VirtualTokenCounters, most_served_last

if TYPE_CHECKING:
    from pagedserve.workers.engine.request import Request


def paused_victim(running: Sequence[Request]) -> Request | None:
    """The lowest-ranked paused sequence, if any."""
    return next((r for r in reversed(running) if r.paused), None)


def running_victim(running: Sequence[Request], tenants: VirtualTokenCounters | None) -> Request:
    """The sequence to preempt so that a running one gets its block: the lowest-ranked paused
    one, else the lowest (fair: the lowest-ranked of the most-served tenant)."""
    paused = paused_victim(running)
    if paused is not None:
        return paused
    victim = most_served_last(running, tenants) if tenants is not None else None
    return victim if victim is not None else running[-1]


def fair_victim(
    request: Request,
    running: Sequence[Request],
    tenants: VirtualTokenCounters | None,
    exclude: Sequence[Request] = (),
) -> Request | None:
    """The running sequence `request` may take the place of (fair share), if any, of those
    not in `exclude` (victims already chosen for it); None with fair share off."""
    if tenants is None:
        return None
    active = [r for r in running if not r.paused and r not in exclude]
    victim = most_served_last(active, tenants)
    running_per_tenant = Counter(r.tenant for r in active)
    if victim is None or not tenants.may_preempt_for(request, victim, running_per_tenant):
        return None
    return victim


def slot_claim(
    heads: Iterable[Request],
    running: Sequence[Request],
    tenants: VirtualTokenCounters,
    max_num_seqs: int,
) -> tuple[Request, list[Request]] | None:
    """Every slot is taken: the first of `heads` (each tenant's first waiting request, from the
    least served) that fair share lets take the places of running sequences, with those
    sequences; None if there is none. (The least-served tenant's request may not be the one:
    tied with a flood that runs here, the flood's next request may not preempt its own
    tenant, while a tenant with nothing running may.)"""
    num_active = sum(not r.paused for r in running)
    for request in heads:
        victims: list[Request] = []
        while num_active - len(victims) + request.group_size > max_num_seqs:
            victim = fair_victim(request, running, tenants, exclude=victims)
            if victim is None:
                break
            victims.append(victim)
        else:
            return request, victims
    return None


def alone_in_the_pool(request: Request, victim: Request, running: Sequence[Request]) -> bool:
    """Whether `request` needs a block with only its own group running (and `victim` in it):
    a single sequence always fits (intake checks prompt + max_tokens against the pool), a
    beam group of diverged beams may not."""
    group = victim.preempted_with()
    return len(group) > 1 and request in group and all(r in group for r in running)
