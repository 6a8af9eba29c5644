"""Moving a running request to a peer worker with its KV, instead of preempting it.

When the pool runs short in `move` mode, the scheduler picks a victim as usual; the engine packs
the victim's state (tokens, progress, sampler state) and the KV of its computed positions into a
`RequestHandoff`, frees its blocks, and ends it here with finish reason `moved`. The router hands
the package to a peer, whose engine adopts it: it takes blocks, writes the KV back and continues
decoding where the request stopped, so the client's stream goes on without a gap or a repeat.
If the peer has no room it recomputes the KV from the tokens instead; the output is the same.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.workers.kv.memory import blocks_needed
from pagedserve.workers.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedserve.workers.engine.request import Request, RequestGroup


class HandoffReason(enum.Enum):
    """Why a sequence left its worker: what the router counts and traces it as."""

    PREEMPTED = "preempted"  # a `move` preemption (or a replay: the router's own handoff)
    PREFILLED = "prefilled"  # P/D: its prefill is done on a prefill worker


@dataclass(frozen=True)
class HandoffTimings:
    """A sequence's timings at its handoff, as seconds after its arrival (monotonic clocks
    are per process), so the adopter's metrics count from the request's real arrival: the
    TTFT stays the one the client saw from the source, and the transfer shows up in the next
    inter-token latency instead of vanishing."""

    elapsed_s: float  # arrival → handoff
    first_scheduled_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    inter_token_latencies: tuple[float, ...] = ()

    @classmethod
    def of(cls, timings, now: float) -> HandoffTimings:
        """Of a `SequenceTimings` at `now`."""

        def since(t: float | None) -> float | None:
            return None if t is None else t - timings.arrival

        return cls(
            now - timings.arrival,
            since(timings.first_scheduled),
            since(timings.first_token),
            since(timings.last_token),
            tuple(timings.inter_token_latencies),
        )

    def restore(self, timings, now: float) -> None:
        """Set a `SequenceTimings` as if the sequence had run here since its arrival."""
        arrival = now - self.elapsed_s

        def at(offset: float | None) -> float | None:
            return None if offset is None else arrival + offset

        timings.arrival = arrival
        timings.first_scheduled = at(self.first_scheduled_s)
        timings.first_token = at(self.first_token_s)
        timings.last_token = at(self.last_token_s)
        timings.inter_token_latencies = list(self.inter_token_latencies)


@dataclass
class RequestHandoff:
    """Everything a peer needs to continue one sequence (one branch of a request)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    priority: int
    cache_extra_keys: tuple[str, ...]
    block_size: int
    # [L, 2, M, B, Hkv, D] on the CPU, M = ceil(num_computed / B); None: recompute. Between
    # workers an ObjectRef to it (`workers/transfer/handoff_ref.py`): the router handles only the
    # ref.
    packed_kv: Any
    generator_state: torch.Tensor | None
    num_preemptions: int
    deadline_remaining_s: float | None
    emitted_text_chars: int  # text already streamed to the client
    source_worker: str | None = None  # set by the source worker when it hands the KV by ref
    reason: HandoffReason = HandoffReason.PREEMPTED
    # The source worker's actor handle while it holds the KV object for the target
    # (`workers/transfer/handoff_ref.py`, `HeldKV`); the target releases that hold once it fetched.
    kv_owner: Any = None
    timings: HandoffTimings | None = None  # None: a replay (the router's): timed from adoption
    tenant: str = ""  # who sent it: the adopting scheduler shares fairly by it too

    @classmethod
    def replay(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        emitted_text_chars: int,
        params: SamplingParams,
        *,
        priority: int,
        tenant: str = "",
        cache_extra_keys: tuple[str, ...],
        block_size: int,
        deadline_remaining_s: float | None,
    ) -> RequestHandoff:
        """A handoff without KV, for a sequence whose worker was lost: the adopting peer
        recomputes its KV (or hits its prefix cache) and continues the output and its text
        where the client's stream stopped (`emitted_text_chars` of it were streamed)."""
        return cls(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            num_computed_tokens=0,
            params=params,
            priority=priority,
            cache_extra_keys=cache_extra_keys,
            block_size=block_size,
            packed_kv=None,
            generator_state=None,
            num_preemptions=0,
            deadline_remaining_s=deadline_remaining_s,
            emitted_text_chars=emitted_text_chars,
            tenant=tenant,
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def check_compatible(self, block_size: int, model_name: str) -> None:
        """A handoff only fits a pool with the same block size and model."""
        if block_size != self.block_size:
            raise ValueError(f"handoff block size {self.block_size} != this pool's {block_size}")
        if self.cache_extra_keys[:1] != (model_name,):
            raise ValueError(f"handoff is for model {self.cache_extra_keys[:1]}, not {model_name}")
        if self.packed_kv is not None:
            expected = blocks_needed(self.num_computed_tokens, self.block_size)
            if self.packed_kv.shape[2] != expected:
                raise ValueError(
                    f"handoff carries {self.packed_kv.shape[2]} blocks for "
                    f"{self.num_computed_tokens} computed tokens (expected {expected})"
                )


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
