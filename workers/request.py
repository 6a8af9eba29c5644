"""One sequence the engine generates: its tokens, progress, sampling state and timings.

A user request with `n > 1` becomes `n` sequences (branches) that share the prompt's blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from pagedserve.workers.detokenizer import IncrementalDetokenizer
from pagedserve.workers.logprobs import TokenLogprob
from pagedserve.workers.sampling_params import SamplingParams
from pagedserve.workers.stop_checker import FinishReason


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class SequenceTimings:
    """Monotonic timestamps (seconds) of one sequence's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.inter_token_latencies.append(now - self.last_token)
        self.last_token = now


@dataclass(eq=False)
class Request:
    """One sequence: prompt, output so far, KV progress and the state its sampler needs.

    `all_token_ids` is prompt + output; `num_computed_tokens` of them have KV in the pool.
    """

    request_id: str
    group_id: str
    branch_index: int
    prompt_len: int
    all_token_ids: list[int]
    params: SamplingParams
    cache_extra_keys: tuple[str, ...]
    priority: int = 0
    arrival_order: int = 0
    deadline: float | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    timings: SequenceTimings = field(default_factory=lambda: SequenceTimings(time.monotonic()))
    # Branches that will fork from this one once its prompt is computed (n > 1).
    pending_branches: list[Request] = field(default_factory=list)
    # Whether preemption may hand this sequence to a peer (single-branch requests only).
    movable: bool = False
    # Log-probabilities, when `params.logprobs` / `params.prompt_logprobs` ask for them: one per
    # output token sampled here, and one per prompt token from the second on (collected by the
    # branch that computes the prompt).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.prompt_len

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.all_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities asked for and not all collected yet (by branch 0, which
        computes the prompt; the other branches fork its blocks)."""
        wanted = self.params.prompt_logprobs is not None and self.branch_index == 0
        return wanted and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def skip_prefix_cache(self) -> bool:
        """A cached prompt position is never computed, so it would have no logits to score."""
        return self.wants_prompt_logprobs
