"""Taking a request in: `add_request` (its checks, its branches, a beam search's start, a
grammar's compile off the step) and the requests whose grammar compiled since the last step (a
part of `Engine`, kept apart to keep `workers/engine/engine.py` to the step). The one check
that an id is not already in flight here is `_check_not_in_flight`, which a handed-off request
and a moved beam search pass too (`workers/engine/handoffs.py`, `workers/beam/moves.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from pagedserve.workers.beam.groups import check_beam_request
from pagedserve.workers.engine.request import RequestGroup
from pagedserve.workers.protocol.errors import Overloaded, RequestRejected
from pagedserve.workers.protocol.requests import check_timeout_s
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import FinishReason

_log = logging.getLogger(__name__)


class EngineAdmission:
    """The intake calls of `Engine` (which owns `_groups`, the scheduler, `intake`, `guided`
    and `beams`)."""

    def _check_not_in_flight(self, request_id: str) -> None:
        """Refuse an id this engine runs already; nothing of the running one is touched."""
        if request_id in self._groups:
            raise RequestRejected(f"request_id {request_id!r} is already in flight")

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        tenant: str = "",
        lora: str | None = None,
    ) -> None:
        """Queue a request (of `tenant`: `workers/scheduler/fair_share.py`; on LoRA adapter `lora`:
        `workers/lora/`). Raises `RequestRejected` naming the problem if it can never run."""
        params = params or SamplingParams()
        check_timeout_s(timeout_s)
        self._check_not_in_flight(request_id)
        if self.scheduler.waiting_full(self.guided.num_parked):
            raise Overloaded(f"the engine's waiting queue is full ({self.config.max_waiting})")
        prompt_text, token_ids = self.intake.tokenize(prompt)
        self.intake.check_fits(len(token_ids), params)
        self.intake.check_token_ids(params)
        if params.use_beam_search:
            check_beam_request(params, self.config.max_beam_width, self.proposer is not None)
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        extra_keys = self._request_keys(cache_salt, lora, params.use_beam_search)
        # A beam search starts as one sequence (the prompt) with the group's params (its
        # width is their `n`); its beams fork from it.
        branch_params = (
            [params] if params.use_beam_search else map(params.for_branch, range(params.n))
        )
        branches = [
            self.intake.new_branch(
                request_id, j, token_ids, branch, priority, extra_keys, deadline, now
            )
            for j, branch in enumerate(branch_params)
        ]
        first, *others = branches
        first.pending_branches = others
        # Prompt log-probabilities and a mean's sum so far are this engine's: not moved.
        first.movable = params.n == 1 and params.prompt_logprobs is None and params.pooling is None
        for branch in branches:  # each branch leaves once its first token went out
            branch.hand_off_after_prefill = self.role.hands_off_after_prefill
            branch.tenant = tenant
        group = RequestGroup(request_id, prompt_text, list(token_ids), branches, now, deadline)
        self._groups[request_id] = group
        if params.use_beam_search:
            first.hand_off_after_prefill = False
            max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
            self.beams.start(group, max_tokens, self.loaded.eos_token_ids)
        if params.guided is None:
            self.scheduler.add(first)
            return

        # Queued once its grammar is compiled (`_admit_compiled`): a matcher per branch.
        def start(compiled) -> None:
            for branch in branches:
                self.guided.attach(branch, compiled)
            self.scheduler.add(first)

        self.guided.park(request_id, params.guided, start)

    def _admit_compiled(self, touched: dict[str, RequestGroup]) -> None:
        """Queue the requests whose grammar compiled; fail those whose compile failed. An
        engine with nothing else to do waits here (briefly) for a compile instead of spinning."""
        if not self.guided.num_parked:
            return
        if not self.scheduler.num_active and not self.scheduler.waiting:
            self.guided.wait_for_compile()
        for group_id, message in self.guided.admit_ready():
            group = self._groups.get(group_id)
            if group is not None:
                _log.warning("request %s failed: %s", group_id, message)
                self._end_group(group, FinishReason.ERROR)
                touched[group_id] = group
