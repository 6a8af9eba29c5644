"""What a worker streams back per step: token deltas, and the final usage and timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.workers.logprobs import TokenLogprob
from pagedserve.workers.outputs import RequestMetrics, RequestOutput


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class StreamDelta:
    """New tokens of one branch since the last delta; the last one carries finish and usage."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    metrics: RequestMetrics | None = None
    worker_id: str | None = None
    error: str | None = None
    handoff: Any = None  # with finish_reason "moved": the package a peer continues from
    # With SamplingParams.logprobs: one per token of `token_ids`. With prompt_logprobs: one per
    # prompt token (the first None), on the branch's first delta.
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class DeltaTracker:
    """Turns an engine's cumulative outputs into deltas, per branch."""

    sent_tokens: dict[int, int] = field(default_factory=dict)
    sent_text: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def deltas(self, output: RequestOutput, worker_id: str | None = None) -> list[StreamDelta]:
        deltas = []
        for completion in output.outputs:
            index = completion.index
            if index in self.finished:
                continue
            n_tokens = self.sent_tokens.get(index, 0)
            n_text = self.sent_text.get(index, 0)
            new_ids = completion.token_ids[n_tokens:]
            new_text = completion.text[n_text:]
            if not new_ids and not new_text and completion.finish_reason is None:
                continue
            self.sent_tokens[index] = len(completion.token_ids)
            self.sent_text[index] = len(completion.text)
            delta = StreamDelta(output.request_id, index, new_ids, new_text, worker_id=worker_id)
            if completion.logprobs is not None:
                delta.logprobs = completion.logprobs[n_tokens : len(completion.token_ids)]
            if n_tokens == 0 and n_text == 0:
                delta.prompt_logprobs = output.prompt_logprobs
            if completion.finish_reason is not None:
                self.finished.add(index)
                delta.finish_reason = completion.finish_reason
                delta.stop_reason = completion.stop_reason
                delta.usage = Usage(
                    len(output.prompt_token_ids),
                    len(completion.token_ids),
                    output.num_cached_tokens,
                )
                delta.metrics = output.metrics
                delta.error = output.error
                delta.handoff = output.handoff
            deltas.append(delta)
        return deltas
