"""Requests for driving a `Scheduler` alone on a script (no model, no engine)."""

from __future__ import annotations

from pagedserve.workers.engine.request import Request
from pagedserve.workers.protocol.sampling import SamplingParams


def scripted_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    arrival_order: int,
    priority: int = 0,
    tenant: str = "",
) -> Request:
    """A request of `prompt_len` prompt tokens (1, 2, ...) that generates exactly `max_tokens`."""
    return Request(
        request_id=request_id,
        group_id=request_id,
        branch_index=0,
        prompt_len=prompt_len,
        all_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        cache_extra_keys=(),
        priority=priority,
        tenant=tenant,
        arrival_order=arrival_order,
    )
