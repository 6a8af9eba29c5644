"""How a victim yields its blocks: the scheduler's preemption modes, carried out.

`SchedulerPreemption` is a part of `Scheduler` (it moves sequences between the scheduler's
queues and this step's plan); it lives here so that workers/scheduler/scheduler.py keeps to
the queues and the step. Who yields is chosen in `workers/scheduler/victims.py`. A victim, with
the sequences that yield with it (a beam search's live beams, as one), leaves the running
queue and this step's plan, then:

    recompute   blocks freed; it waits again, its output so far part of its prompt
    swap        blocks copied to CPU swap slots (their shared blocks once); it waits swapped
    move        blocks freed for a peer worker to copy out first (P/D and migration); it
                leaves this worker (`SchedulerOutput.moved`)

A victim admitted in the step that preempts it always recomputes (its prefix hit may be on
a block that step's forward fills, after a swap-out or hand-off would have copied it), and a
sequence admitted with a hit on blocks a victim was to fill in the step yields with it.

A group that cannot fit even alone in the pool is dropped instead (`SchedulerOutput.unfittable`),
and a sequence handed to a peer after its prefill leaves the same way a moved one does
(`release_for_handoff`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.workers.engine.request import Request, RequestStatus
from pagedserve.workers.scheduler.policy import PreemptionMode

if TYPE_CHECKING:
    from pagedserve.workers.kv.manager import KVCacheManager
    from pagedserve.workers.protocol.stats import SchedulerCounters
    from pagedserve.workers.scheduler.fair_share import VirtualTokenCounters
    from pagedserve.workers.scheduler.scheduler import SchedulerConfig, SchedulerOutput


class SchedulerPreemption:
    """`Scheduler`'s preemption methods (see the module docstring); they put sequences back
    in the queues with the scheduler's own `_insert` and `_requeue`."""

    config: SchedulerConfig
    kv: KVCacheManager
    running: list[Request]
    swapped: list[Request]
    counters: SchedulerCounters
    tenants: VirtualTokenCounters

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
        if any(request in step.admitted for request in group):
            # Admitted in this step: the KV its table counts as computed may be a prefix hit
            # on blocks this step's forward fills, and a swap-out or hand-off copies before
            # it. It loses nothing by recomputing: that prefix is all it had.
            mode = PreemptionMode.RECOMPUTE
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
        first_unfilled = victim.num_computed_tokens // self.kv.block_size
        unfilled = set(self.kv.get_block_ids(victim.request_id)[first_unfilled:])
        self.kv.rollback_slots(victim.request_id, victim.num_computed_tokens)
        self._undo_hits_on(unfilled, step)
        return {dst: src for src, dst in copies}

    def _undo_hits_on(self, unfilled: set[int], step: SchedulerOutput) -> None:
        """A sequence admitted earlier in this step with a prefix hit on blocks a victim was
        to fill in it (`unfilled`) would read KV nobody writes: it yields too (recompute; it
        had nothing but that hit), and so, in turn, do those that hit its own blocks."""
        for request in list(step.admitted):
            if request not in self.running:  # yielded already (recompute: no blocks left)
                continue
            num_hit = request.num_computed_tokens // self.kv.block_size
            if unfilled.intersection(self.kv.get_block_ids(request.request_id)[:num_hit]):
                self._preempt(request, step)
