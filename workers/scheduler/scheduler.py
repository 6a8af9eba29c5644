"""Continuous batching: which sequences run this step, with how many tokens, and who yields.

Every step the scheduler hands out a token budget. Running sequences go first — decodes before
prefill chunks, so a long prompt cannot starve requests that are already streaming — then
swapped-out sequences come back, then waiting ones are admitted. When the pool cannot supply a
block, a running sequence is preempted until it can: who yields is chosen in
`workers/scheduler/victims.py` (the lowest-ranked: under `priority` the highest value, then the
latest arrival, as vLLM v1 picks; a paused one first), how it yields (recompute, swap or move)
is carried out in `workers/scheduler/preemption.py`.

Across tenants the order is fair (`workers/scheduler/fair_share.py`, on unless `fair_share.enabled`
is False): the waiting and swapped queues serve the tenant with the smallest virtual token counter
first, the victim comes from the running tenant with the largest, and the policy orders each
tenant's own requests (priority within a tenant, fairness across tenants). With one tenant the
order is the policy's alone. A tenant with nothing running here, served no more than those that
run, has its prompts computed in a step of their own (`FairShareConfig.newcomer_steps`; never two
in a row), so that its first token does not wait for a whole step of another tenant's decodes.

A paused sequence (its client stopped reading) is skipped in every queue: it keeps its blocks
and its place, does not count against `max_num_seqs` (it is in no batch), and is the first
victim when blocks run short.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pagedserve.workers.engine.request import Request, RequestStatus
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.stats import SchedulerCounters
from pagedserve.workers.scheduler.fair_share import (
    FairShareConfig,
    VirtualTokenCounters,
    fairest_first,
    tenant_heads,
)
from pagedserve.workers.scheduler.policy import PreemptionMode, SchedulingPolicy
from pagedserve.workers.scheduler.preemption import SchedulerPreemption
from pagedserve.workers.scheduler.victims import (
    alone_in_the_pool,
    fair_victim,
    paused_victim,
    running_victim,
    slot_claim,
)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    max_waiting: int | None = None  # new requests queued at most; None: unbounded
    fair_share: FairShareConfig = field(default_factory=FairShareConfig)
    max_loras: int | None = None  # LoRA adapters running at once (one step's device slots)

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in SchedulingPolicy.registry:
            raise ValueError(f"policy must be one of {sorted(SchedulingPolicy.registry)}")
        object.__setattr__(self, "preemption_mode", PreemptionMode.of(self.preemption_mode))


@dataclass
class SchedulerOutput:
    """One step's plan: tokens per sequence and the block moves to do before the forward."""

    scheduled: dict[Request, int] = field(default_factory=dict)
    copies: dict[Request, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    moved: list[tuple[Request, list[int]]] = field(default_factory=list)  # victim, its blocks
    # Sequences whose group needs more blocks than the whole pool, with nothing else left to
    # preempt: preempting the group would only bring it back to the same wall (a wide beam
    # search in a small pool). Already out of the queues, blocks freed; the engine ends their
    # groups with an error.
    unfittable: list[Request] = field(default_factory=list)
    # Admitted from the waiting queue in this step: each counts its prefix hit as computed,
    # and a hit may be on blocks this step's forward fills (another sequence's, scheduled
    # earlier in the step). Until the forward ran, none of them has KV to carry away.
    admitted: list[Request] = field(default_factory=list)
    # A newcomer step (`FairShareConfig.newcomer_steps`): only these tenants' waiting requests
    # are admitted, and no sequence that was running takes part. None: an ordinary step.
    newcomers: frozenset[str] | None = None
    budget: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())

    def all_copies(self) -> list[tuple[int, int]]:
        return [pair for pairs in self.copies.values() for pair in pairs]


class Scheduler(SchedulerPreemption):
    """Owns the waiting, running and swapped queues of one engine, and its counters.

    Args:
        config: batch limits, chunking, policy and preemption mode.
        kv: the block manager; the scheduler is its only caller during a step.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.policy = SchedulingPolicy.registry[config.policy]()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.counters = SchedulerCounters()
        # Kept with fairness off too: the per-tenant service is reported either way.
        self.tenants = VirtualTokenCounters(config.fair_share)
        self._newcomer_step_last = False  # newcomer steps never come two in a row

    # ---------------------------------------------------------------- queues
    def _insert(self, queue: list[Request], request: Request) -> None:
        bisect.insort(queue, request, key=self.policy.key)

    def add(self, request: Request) -> None:
        """A sequence new to this scheduler waits for admission."""
        self.tenants.arrive(request)
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._insert(self.waiting, request)

    def add_running(self, request: Request) -> None:
        """A sequence new to this scheduler joins the batch with its blocks (a branch forked
        from a running sequence, a moved request whose KV came with it)."""
        self.tenants.arrive(request)
        request.status = RequestStatus.RUNNING
        self._insert(self.running, request)

    def waiting_full(self, num_outside: int = 0) -> bool:
        """Whether a new request must be refused. Preempted sequences re-enter `waiting`
        regardless: they are in flight already, and refusing them would lose their work.
        `num_outside`: new requests that wait outside the queue (for their grammar)."""
        limit = self.config.max_waiting
        return limit is not None and len(self.waiting) + num_outside >= limit

    @property
    def num_active(self) -> int:
        """Running sequences that take part in batches (paused ones do not)."""
        return sum(not r.paused for r in self.running)

    @property
    def fair(self) -> bool:
        return self.config.fair_share.enabled

    @property
    def _fair_tenants(self) -> VirtualTokenCounters | None:
        """The counters victims are chosen by; None with fair share off (`victims.py`)."""
        return self.tenants if self.fair else None

    def _admissible(self, queue: list[Request], step: SchedulerOutput) -> Iterator[Request]:
        """`queue` without paused sequences and those preempted in this step: a victim
        re-admitted in the step that preempted it would take back the place it gave up, and
        the request it gave it up for would preempt it again, forever. Nor one whose LoRA
        adapter would be one more than `max_loras` among the running (it waits for a slot)."""
        preempted, only = step.preempted, step.newcomers
        fits = self._adapter_gate()
        return (
            r
            for r in queue
            if not r.paused
            and r not in preempted
            and fits(r.lora_key)
            and (only is None or r.tenant in only)
        )

    def _adapter_gate(self) -> Callable[[str | None], bool]:
        """Whether a request of a LoRA adapter may join the running set now (the base always
        may): its adapter runs already, or fewer than `max_loras` do."""
        limit = self.config.max_loras
        if limit is None:
            return lambda key: True
        running = {r.lora_key for r in self.running} - {None}
        return lambda key: key is None or key in running or len(running) < limit

    def _next_of(self, queue: list[Request], step: SchedulerOutput) -> Request | None:
        """The next sequence of `queue` to bring in: the policy's first, or (fair) the first
        of the least-served tenant."""
        candidates = self._admissible(queue, step)
        return fairest_first(candidates, self.tenants) if self.fair else next(candidates, None)

    def _claim_slots(self, step: SchedulerOutput) -> Request | None:
        """Every slot is taken: the waiting request fair share lets take the places of running
        sequences (`victims.slot_claim`), with those sequences preempted; None if none may."""
        if not self.fair:
            return None
        heads = tenant_heads(self._admissible(self.waiting, step), self.tenants)
        claim = slot_claim(heads, self.running, self.tenants, self.config.max_num_seqs)
        if claim is None:
            return None
        request, victims = claim
        for victim in victims:
            self._preempt(victim, step)
        return request

    def finish(self, request: Request) -> None:
        """Take a sequence out of whichever queue holds it and free its blocks at once."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
                self.tenants.leave(request)
                break
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        step = SchedulerOutput(budget=self.config.max_num_batched_tokens)
        step.newcomers = self._newcomer_tenants()
        if step.newcomers is not None:
            self._admit_waiting(step)
            if step.scheduled:
                self.counters.newcomer_steps += 1
            else:  # no room for them: an ordinary step
                step.newcomers = None
        if step.newcomers is None:
            self._schedule_all(step)
        self._newcomer_step_last = step.newcomers is not None
        for request, num_new in step.scheduled.items():
            self.tenants.charge(request, num_new)
            if request.is_prefilling:
                self.counters.prefill_tokens += num_new
        return step

    def _newcomer_tenants(self) -> frozenset[str] | None:
        """The tenants this step is for alone (`FairShareConfig.newcomer_steps`): those with
        requests waiting, nothing running or swapped out here, and served no more than any
        tenant that runs. None: an ordinary step (no such tenant, nothing running to keep
        their prompts apart from, the feature off, or the last step was one)."""
        share = self.config.fair_share
        if not (share.enabled and share.newcomer_steps) or self._newcomer_step_last:
            return None
        running = {r.tenant for r in self.running if not r.paused}
        if not running:
            return None
        held = {r.tenant for r in self.running} | {r.tenant for r in self.swapped}
        least = min(self.tenants.counter(tenant) for tenant in running)
        newcomers = frozenset(
            r.tenant
            for r in self.waiting
            if not r.paused and r.tenant not in held and self.tenants.counter(r.tenant) <= least
        )
        return newcomers or None

    def _schedule_all(self, step: SchedulerOutput) -> None:
        """An ordinary step: the running sequences, then swapped-out ones, then waiting ones."""
        # Decodes before prefill chunks; the sort is stable so policy order holds within each.
        for request in sorted(self.running, key=lambda r: r.is_prefilling):
            if step.budget == 0:
                break
            # A beam with every token computed waits for its group's step
            # (`workers/beam/groups.py`);
            # one of a group dropped earlier in this loop (`unfittable`) is gone.
            held = request.num_tokens_to_compute == 0 or request in step.unfittable
            if request.status is RequestStatus.RUNNING and not request.paused and not held:
                self._schedule_running(request, step)
        if not step.preempted:
            self._swap_in(step)
            self._admit_waiting(step)

    def _schedule_running(self, request: Request, step: SchedulerOutput) -> None:
        num_new = min(request.num_tokens_to_compute, step.budget)
        # Draft tokens ride along only after the whole known rest, and only as far as the
        # budget goes; they never cost a preemption: without room they are dropped first.
        fits = num_new == request.num_tokens_to_compute
        del request.draft_token_ids[max(0, step.budget - num_new) if fits else 0 :]
        while True:
            num_drafts = len(request.draft_token_ids)
            allocation = self.kv.allocate_slots(request, num_new, num_draft_tokens=num_drafts)
            if allocation is not None:
                break
            if num_drafts:
                request.draft_token_ids.clear()
                continue
            victim = running_victim(self.running, self._fair_tenants)
            if alone_in_the_pool(request, victim, self.running):
                self._drop_unfittable(victim.preempted_with(), step)
                return
            self._preempt(victim, step)
            if request.status is not RequestStatus.RUNNING:  # it yielded (or its group did)
                return
        num_new += num_drafts
        step.scheduled[request] = num_new
        step.budget -= num_new
        if allocation.copies:
            step.copies[request] = allocation.copies

    def _swap_in(self, step: SchedulerOutput) -> None:
        """Bring swapped-out sequences back while they fit; a beam search's as one group."""
        while self.num_active < self.config.max_num_seqs:
            request = self._next_of(self.swapped, step)
            if request is None:
                return
            group = [r for r in self.swapped if r.beam is not None and r.beam is request.beam]
            group = group or [request]
            if len(group) > 1 and self.num_active + len(group) > self.config.max_num_seqs:
                return
            moves = self.kv.swap_in_group(group)
            if moves is None:
                return
            step.swap_in.extend(moves)
            for member in group:
                self.swapped.remove(member)
                member.status = RequestStatus.RUNNING
                self._insert(self.running, member)
            self.counters.swapped_in += len(group)

    def _admit_waiting(self, step: SchedulerOutput) -> None:
        while step.budget > 0:
            request = self._next_of(self.waiting, step)
            if request is None:
                return
            if self.num_active + request.group_size > self.config.max_num_seqs:
                request = self._claim_slots(step)
                if request is None:
                    return
            computed = self.kv.get_computed_blocks(request)
            num_new = len(request.all_token_ids) - computed.num_tokens
            if num_new > step.budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = step.budget
            allocation = self.kv.allocate_slots(request, num_new, computed)
            if allocation is None:
                victim = paused_victim(self.running) or fair_victim(
                    request, self.running, self._fair_tenants
                )
                if victim is None:
                    return
                self._preempt(victim, step)  # a paused sequence yields its blocks, then retry
                continue
            self.waiting.remove(request)
            self._start(request, computed.num_tokens)
            step.admitted.append(request)
            step.scheduled[request] = num_new
            step.budget -= num_new
            if allocation.copies:
                step.copies[request] = allocation.copies

    def _start(self, request: Request, num_cached_tokens: int) -> None:
        request.num_computed_tokens = num_cached_tokens
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = time.monotonic()
            request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self._insert(self.running, request)


__all__ = [
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
]
