"""Moving a running request to a peer worker with its KV, instead of preempting it.

When the pool runs short in `move` mode, the scheduler picks a victim as usual; the engine packs
the victim's state (tokens, progress, sampler state) and the KV of its computed positions into a
`RequestHandoff`, frees its blocks, and ends it here with finish reason `moved`. The router hands
the package to a peer, whose engine adopts it: it takes blocks, writes the KV back and continues
decoding where the request stopped, so the client's stream goes on without a gap or a repeat.
If the peer has no room it recomputes the KV from the tokens instead; the output is the same.

The package (`RequestHandoff`, with `HandoffReason` and `HandoffTimings`) is in
`workers/protocol/handoff.py`; here are packing it (`pack_handoff`) and adopting its KV
(`adopt_kv`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pagedserve.workers.kv.memory import blocks_needed
from pagedserve.workers.protocol.handoff import HandoffReason, HandoffTimings, RequestHandoff

if TYPE_CHECKING:
    import torch

    from pagedserve.workers.engine.request import Request, RequestGroup


def pack_handoff(
    group: RequestGroup,
    victim: Request,
    packed: torch.Tensor | None,
    block_size: int,
    reason: HandoffReason,
    now: float,
) -> RequestHandoff:
    """`victim` (a branch of `group`) as a peer needs it to go on: its tokens, progress,
    sampler state, what its client has already been sent, and its KV (`packed`, the blocks of
    its computed positions; None: the peer recomputes)."""
    params = victim.params
    if params.prompt_logprobs is not None:  # they went out with the first token
        params = dataclasses.replace(params, prompt_logprobs=None)
    return RequestHandoff(
        request_id=group.request_id,
        prompt_token_ids=list(group.prompt_token_ids),
        output_token_ids=list(victim.output_token_ids),
        num_computed_tokens=victim.num_computed_tokens if packed is not None else 0,
        params=params,
        priority=victim.priority,
        tenant=victim.tenant,
        cache_extra_keys=victim.cache_extra_keys,
        block_size=block_size,
        packed_kv=packed,
        generator_state=None if victim.generator is None else victim.generator.get_state(),
        num_preemptions=victim.timings.num_preemptions,
        deadline_remaining_s=None if group.deadline is None else group.deadline - now,
        # What the client has: every token (each step reports its own, so none waits here)
        # and the text reported so far; the peer's detokenizer goes on from there.
        emitted_text_chars=(
            victim.detokenizer.num_emitted_chars - len(victim.unreported_text)
            if victim.detokenizer
            else 0
        ),
        reason=reason,
        timings=HandoffTimings.of(victim.timings, now),
    )


def adopt_kv(kv, kv_cache, request, handoff: RequestHandoff) -> bool:
    """Give an adopted request its computed KV: cached prefix blocks here, the rest imported.

    Returns False (nothing changed) when there is no KV to adopt, no room for it, or it comes
    from a pool of another KV dtype (`kv_cache_dtype`: never converted; the sequence
    recomputes it from its tokens).
    """
    if handoff.packed_kv is None or handoff.num_computed_tokens == 0:
        return False
    if handoff.packed_kv.dtype != kv_cache.dtype:
        return False
    hit = kv.get_computed_blocks(request)
    if hit.num_tokens > handoff.num_computed_tokens:
        hit_blocks = handoff.num_computed_tokens // kv.block_size
        hit = type(hit)(
            hit.blocks[:hit_blocks], hit.block_hashes[:hit_blocks], hit_blocks * kv.block_size
        )
    allocation = kv.allocate_slots(request, handoff.num_computed_tokens - hit.num_tokens, hit)
    if allocation is None:
        return False
    first = hit.num_tokens // kv.block_size
    block_ids = kv.get_block_ids(request.request_id)[
        first : blocks_needed(handoff.num_computed_tokens, kv.block_size)
    ]
    if block_ids:
        kv_cache.import_blocks(handoff.packed_kv[:, :, first:], block_ids)
    request.num_computed_tokens = handoff.num_computed_tokens
    request.num_cached_tokens = hit.num_tokens
    return True
