"""Continuous batching: which sequences run this step, with how many tokens, and who yields.

Every step the scheduler hands out a token budget. Running sequences go first — decodes before
prefill chunks, so a long prompt cannot starve requests that are already streaming — then
swapped-out sequences come back, then waiting ones are admitted. When the pool cannot supply a
block, the lowest-ranked running sequence is preempted (recompute, swap or move) until it can:
under `priority` the highest value, then the latest arrival, as vLLM v1 picks. A waiting
request never preempts a sequence that runs (vLLM v0's priority policy did; v1 does not),
only a paused one (below) — or, with fair share, one of another tenant served more than its
own by more than the request will cost (`workers/scheduler/fair_share.py`).

Across tenants the order is fair (`workers/scheduler/fair_share.py`, on unless `fair_share.enabled`
is False): the waiting and swapped queues serve the tenant with the smallest virtual token counter
first, the victim comes from the running tenant with the largest, and the policy orders each
tenant's own requests (priority within a tenant, fairness across tenants). With one tenant the
order is the policy's alone.

A paused sequence (its client stopped reading) is skipped in every queue: it keeps its blocks
and its place, does not count against `max_num_seqs` (it is in no batch), and is the first
victim when blocks run short, for a running sequence or a waiting one alike, since it is the
one sequence that loses no progress to waiting.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from pagedserve.workers.engine.request import Request, RequestStatus
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.stats import SchedulerCounters
from pagedserve.workers.scheduler.fair_share import (
    FairShareConfig,
    VirtualTokenCounters,
    fairest_first,
    most_served_last,
    tenant_heads,
)
from pagedserve.workers.scheduler.policy import PreemptionMode, SchedulingPolicy


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
    budget: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())

    def all_copies(self) -> list[tuple[int, int]]:
        return [pair for pairs in self.copies.values() for pair in pairs]


class Scheduler:
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

    def _victim(self) -> Request:
        """The running sequence to preempt: the lowest-ranked paused one, else the lowest
        (fair: the lowest-ranked of the most-served tenant)."""
        paused = self._paused_victim()
        if paused is not None:
            return paused
        victim = most_served_last(self.running, self.tenants) if self.fair else None
        return victim if victim is not None else self.running[-1]

    def _fair_victim(self, request: Request, exclude: Sequence[Request] = ()) -> Request | None:
        """The running sequence `request` may take the place of (fair share), if any, of
        those not in `exclude` (victims already chosen for it)."""
        if not self.fair:
            return None
        active = [r for r in self.running if not r.paused and r not in exclude]
        victim = most_served_last(active, self.tenants)
        running = Counter(r.tenant for r in active)
        if victim is None or not self.tenants.may_preempt_for(request, victim, running):
            return None
        return victim

    def _admissible(self, queue: list[Request], step: SchedulerOutput) -> Iterator[Request]:
        """`queue` without paused sequences and those preempted in this step: a victim
        re-admitted in the step that preempted it would take back the place it gave up, and
        the request it gave it up for would preempt it again, forever. Nor one whose LoRA
        adapter would be one more than `max_loras` among the running (it waits for a slot)."""
        preempted = step.preempted
        fits = self._adapter_gate()
        return (r for r in queue if not r.paused and r not in preempted and fits(r.lora_key))

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
        """Every slot is taken: the first waiting request, tenant by tenant from the least
        served, that fair share lets take the places of running sequences, with those
        sequences preempted; None if there is none. (The least-served tenant's request may
        not be the one: tied with a flood that runs here, the flood's next request may not
        preempt its own tenant, while a tenant with nothing running may.)"""
        if not self.fair:
            return None
        for request in tenant_heads(self._admissible(self.waiting, step), self.tenants):
            victims: list[Request] = []
            while self.num_active - len(victims) + request.group_size > self.config.max_num_seqs:
                victim = self._fair_victim(request, exclude=victims)
                if victim is None:
                    break
                victims.append(victim)
            else:
                for victim in victims:
                    self._preempt(victim, step)
                return request
        return None

    def _paused_victim(self) -> Request | None:
        return next((r for r in reversed(self.running) if r.paused), None)

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
        for request, num_new in step.scheduled.items():
            self.tenants.charge(request, num_new)
            if request.is_prefilling:
                self.counters.prefill_tokens += num_new
        return step

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
            victim = self._victim()
            if self._alone_in_the_pool(request, victim):
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

    def _alone_in_the_pool(self, request: Request, victim: Request) -> bool:
        """Whether `request` needs a block with only its own group running (and `victim` in
        it): a single sequence always fits (intake checks prompt + max_tokens against the
        pool), a beam group of diverged beams may not."""
        group = victim.preempted_with()
        return len(group) > 1 and request in group and all(r in group for r in self.running)

    def _drop_unfittable(self, group: list[Request], step: SchedulerOutput) -> None:
        """Take a group that cannot fit even alone out of this step and of the queues, its
        blocks freed; the engine ends it (`SchedulerOutput.unfittable`)."""
        for request in group:
            if request in self.running:
                self.running.remove(request)
                self.tenants.leave(request)
            self._unschedule(request, step)
            self.kv.free(request.request_id)
            step.unfittable.append(request)

    def _preempt(self, victim: Request, step: SchedulerOutput) -> None:
        """Preempt `victim` and the sequences that yield with it: a beam search's live beams
        go as one, all swapped out (their shared blocks once) or all recomputed. A group split
        between the swap area and the waiting queue could never run again: its swapped beams
        would hold their blocks waiting for the recomputed ones."""
        group = [request for request in victim.preempted_with() if request in self.running]
        unwritten: dict[int, int] = {}
        for request in group:
            unwritten |= self._yield(request, step)
        mode = self.config.preemption_mode
        if mode is PreemptionMode.MOVE and group == [victim] and victim.movable:
            # The blocks are freed now; the engine copies their KV out before this step's
            # forward can write into them.
            block_ids = [unwritten.get(b, b) for b in self._release(victim)]
            step.moved.append((victim, block_ids))
            self.counters.moved += 1
            return
        if mode is PreemptionMode.SWAP:
            moves = self.kv.swap_out_group([request.request_id for request in group])
            if moves is not None:
                step.swap_out.extend((unwritten.get(block, block), slot) for block, slot in moves)
                for request in group:
                    request.status = RequestStatus.SWAPPED
                    self._insert(self.swapped, request)
                self.counters.swapped_out += len(group)
                return
        for request in group:  # recompute: the sequence re-enters with its output as prompt
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            self._requeue(request)
        self.counters.recomputed += len(group)

    def _yield(self, victim: Request, step: SchedulerOutput) -> dict[int, int]:
        """Take `victim` out of the running queue and this step's plan; returns its unwritten
        copies (see `_unschedule`)."""
        self.running.remove(victim)
        # Its KV as of the start of this step is all that exists: a sequence scheduled earlier
        # in this step (decodes go first, so a low-ranked one can be) leaves the forward.
        unwritten = self._unschedule(victim, step)
        victim.draft_token_ids.clear()  # their slots went with the rollback
        step.preempted.append(victim)
        victim.timings.num_preemptions += 1
        return unwritten

    def release_for_handoff(self, request: Request) -> list[int]:
        """Take a running sequence out to hand it to a peer (P/D, after its prefill), between
        steps. Its blocks are freed (the full ones stay cached); returns the ids of those
        holding its computed KV, for the engine to copy out before anything writes there."""
        self.running.remove(request)
        self.counters.prefill_handoffs += 1
        return self._release(request)

    def _release(self, request: Request) -> list[int]:
        """Free a leaving sequence's blocks; the ids of those with its computed KV."""
        num_blocks = -(-request.num_computed_tokens // self.kv.block_size)
        block_ids = self.kv.get_block_ids(request.request_id)[:num_blocks]
        self.kv.free(request.request_id)
        self.tenants.leave(request)
        request.status = RequestStatus.FINISHED
        return block_ids

    def _unschedule(self, victim: Request, step: SchedulerOutput) -> dict[int, int]:
        """Undo the victim's place in this step's plan, if it had one.

        Returns:
            {private copy: shared source} for the victim's copy-on-write copies that the plan
            no longer performs. The private block holds nothing yet, so whoever saves the
            victim's KV (swap-out, hand-off) must read the source instead. That is safe: the
            engine saves KV before any copy, swap-in or forward of this step writes a block.
        """
        num_scheduled = step.scheduled.pop(victim, 0)
        copies = step.copies.pop(victim, ())
        if not num_scheduled:
            return {}
        step.budget += num_scheduled
        self.kv.rollback_slots(victim.request_id, victim.num_computed_tokens)
        return {dst: src for src, dst in copies}

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
                victim = self._paused_victim() or self._fair_victim(request)
                if victim is None:
                    return
                self._preempt(victim, step)  # a paused sequence yields its blocks, then retry
                continue
            self.waiting.remove(request)
            self._start(request, computed.num_tokens)
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
