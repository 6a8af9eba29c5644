"""What the engine hands back: per-request outputs in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.workers.logprobs import TokenLogprob


@dataclass
class RequestMetrics:
    """Per-request timings in seconds, measured on the worker's monotonic clock."""

    queue_time: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One branch of a request (index < n): text and token ids so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # One per token of `token_ids` when `SamplingParams.logprobs` asked for them.
    logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: every branch's output so far (cumulative)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    handoff: Any = None  # a RequestHandoff when the request moved to a peer
    # One per prompt token (the first None) when `SamplingParams.prompt_logprobs` asked.
    prompt_logprobs: list[TokenLogprob | None] | None = None
