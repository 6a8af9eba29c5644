"""A request leaving its worker for a peer: everything the peer needs to continue one branch
where it stopped (tokens, progress, sampler state, what the client already has, and its KV or
a reference to it), why it left, and its timings so far.

The engine packs it (`workers/transfer/handoff.py`, `pack_handoff`), the source worker puts its
KV in the object store (`workers/transfer/handoff_ref.py`), the router forwards it in
`WorkerRequest.moved`, and the adopting engine takes it back in (`adopt_kv`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.workers.kv.memory import blocks_needed
from pagedserve.workers.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


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


@dataclass(frozen=True)
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
