"""The engine's hand-offs: a sequence leaving for a peer (a `move` preemption, or the end of
its prefill on a P/D prefill worker) and a peer's sequence arriving (`adopt`: moved, handed
off, or replayed after its worker was lost).

`EngineHandoffs` is a part of `Engine` (it reads the engine's pool, scheduler and groups); it
lives here so that engine.py keeps to the step.
"""

from __future__ import annotations

import logging
import time

from pagedserve.workers.engine.request import Request, RequestGroup
from pagedserve.workers.protocol.handoff import HandoffReason, RequestHandoff
from pagedserve.workers.protocol.stream import FinishReason
from pagedserve.workers.transfer.handoff import adopt_kv, pack_handoff

_log = logging.getLogger(__name__)


class EngineHandoffs:
    """`Engine`'s hand-off methods (see the module docstring)."""

    def _hand_off_prefilled(self, touched) -> None:
        """P/D, on a `prefill` engine: every fresh sequence whose first token went out (the
        last step's delta carried it, so TTFT never waits for a transfer) leaves for a decode
        worker, as a `move` preemption does. Its blocks are freed here; the full ones stay
        cached, so a later request with the same prefix hits them on this worker."""
        if not self.role.hands_off_after_prefill:  # no scan of the running queue elsewhere
            return
        ready = [
            r
            for r in self.scheduler.running
            if r.hand_off_after_prefill and r.num_output_tokens and not r.is_prefilling
        ]
        for request in ready:
            block_ids = self.scheduler.release_for_handoff(request)
            self._hand_off(request, block_ids, touched, HandoffReason.PREFILLED)

    def _hand_off(
        self,
        victim: Request,
        block_ids: list[int],
        touched,
        reason: HandoffReason = HandoffReason.PREEMPTED,
    ) -> None:
        """Pack a sequence for a peer (a preempted one, or one whose prefill is done) and end
        it here with finish reason `moved`."""
        group = self._groups[victim.group_id]
        packed = self.kv_cache.export_blocks(block_ids) if block_ids else None
        now = time.monotonic()
        group.handoffs[victim.branch_index] = pack_handoff(
            group, victim, packed, self.kv.block_size, reason, now
        )
        victim.finish_reason = FinishReason.MOVED
        victim.timings.finished = now
        if self.proposer is not None:
            self.proposer.release(victim.request_id)
        touched[group.request_id] = group
        self.num_handoffs += 1

    def adopt(self, handoff: RequestHandoff) -> None:
        """Continue a sequence a peer handed off: reuse cached blocks, write back its KV, go on.

        Without room for its KV the sequence recomputes it from its tokens (same output).
        """
        handoff.check_compatible(self.kv.block_size, self.loaded.name)
        self._check_adoptable(handoff.cache_extra_keys)
        # A replay may carry a request its lost worker never got to check, and a peer's
        # context or pool may be smaller: one that cannot fit here would wait forever.
        self.intake.check_fits(len(handoff.prompt_token_ids), handoff.params)
        self._check_not_in_flight(handoff.request_id)
        now = time.monotonic()
        request = self.intake.adopted_branch(handoff, now)
        self._groups[handoff.request_id] = RequestGroup(
            handoff.request_id,
            None,
            list(handoff.prompt_token_ids),
            [request],
            request.timings.arrival,
            request.deadline,
        )
        if handoff.params.guided is not None:  # its matcher first: replay its output
            self.guided.park(
                request.group_id,
                handoff.params.guided,
                lambda compiled: self._adopt_guided(request, handoff, compiled),
            )
            return
        self._admit_adopted(request, handoff, now)

    def _adopt_guided(self, request: Request, handoff: RequestHandoff, compiled) -> None:
        if not self.guided.attach(request, compiled):
            _log.warning("request %s: its output does not match its grammar", request.group_id)
            self._finish(request, FinishReason.ERROR)
            return
        self._admit_adopted(request, handoff, time.monotonic())

    def _admit_adopted(self, request: Request, handoff: RequestHandoff, now: float) -> None:
        if not adopt_kv(self.kv, self.kv_cache, request, handoff):
            self.scheduler.add(request)  # no KV, or no room for it: recompute from the tokens
            self.num_adopted_recomputed += 1
            return
        self.num_adopted_with_kv += 1
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = now
        self.scheduler.add_running(request)
