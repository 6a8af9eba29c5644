"""What the engine hands back, and the one place its deltas are added up.

``Engine.step()`` returns deltas, as vLLM's delta outputs do: per request it touched, per branch,
only what is new since the last step. Only the outermost layer that needs a whole answer adds
them up, and every such layer uses the one accumulator here::

    Engine.step() ─► RequestDelta(StreamDelta per branch) ─┬─► worker ─► router ─► front end
                                                            │     CompletionCollector (API)
                                                            └─► LLM.generate: OutputBuilder
                                                                  (a CompletionCollector inside)
                                                                  ─► RequestOutput (whole)

- `RequestDelta`: one request's news from one step, its branches' `StreamDelta`s
  (`workers/protocol/stream.py`: the same objects cross to the router, no copy).
- `CompletionCollector`: the one accumulator of a request's deltas, for the offline API, the
  gRPC and the HTTP front ends alike; `CompletionOutput` is one whole branch as it returns it.
- `RequestOutput` / `OutputBuilder`: a whole request, as `LLM.generate` returns it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.workers.protocol.stream import (
    FinishReason,
    RequestMetrics,
    StreamDelta,
    TokenLogprob,
    Usage,
)

if TYPE_CHECKING:
    from pagedserve.workers.protocol.handoff import RequestHandoff


@dataclass(frozen=True)
class RequestDelta:
    """One request's news from one step: the branches that changed.

    `prompt` and `prompt_token_ids` are the engine's own (shared, never copied per step; do not
    change them). `handoffs` has, by branch index, each branch that moved to a peer (finish
    reason `moved`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[StreamDelta]
    finished: bool
    handoffs: dict[int, RequestHandoff] = field(default_factory=dict)


@dataclass(frozen=True)
class CompletionOutput:
    """One whole branch of a request (index < n), added up from its deltas.

    Attributes:
        index: the branch (after `CompletionCollector.keep_best`: its rank, best first).
        text: its whole text.
        token_ids: its tokens.
        finish_reason: None while it runs.
        stop_reason: the stop string or token id that ended it, if one did.
        logprobs: one per token of `token_ids` when `SamplingParams.logprobs` asked for them.
        embedding: an embedding request's vector (`pooling`).
        cumulative_logprob: a beam search's hypothesis: the engine's sum of its logprobs.
        usage: the branch's token counts (once finished).
        metrics: the request's timings as its last delta told them.
        error: why the engine failed it (finish reason `error`).
        prompt_logprobs: one per prompt token (the first None) when asked for.

    Two outputs are equal when their answers are (`usage` and `metrics` are not compared).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None
    cumulative_logprob: float | None = None
    # How it was computed, not what it answered: not compared (a cache hit changes usage).
    usage: Usage | None = field(default=None, compare=False)
    metrics: RequestMetrics | None = field(default=None, compare=False)
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def logprob_sum(self) -> float:
        """What `best_of` ranks by: the beam's own sum, else its tokens' logprobs summed (0
        without them)."""
        if self.cumulative_logprob is not None:
            return self.cumulative_logprob
        return sum(item.logprob for item in self.logprobs or () if item is not None)


@dataclass
class _Branch:
    """What one branch's deltas add up to so far; its text is kept as pieces and joined when
    read, so adding a delta never copies the text so far."""

    text_pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    end: StreamDelta | None = None  # its last delta, once it came

    def output(self, index: int) -> CompletionOutput:
        end = self.end
        return CompletionOutput(
            index,
            "".join(self.text_pieces),
            self.token_ids,
            None if end is None else end.finish_reason,
            None if end is None else end.stop_reason,
            self.logprobs,
            None if end is None else end.embedding,
            None if end is None else end.cumulative_logprob,
            None if end is None else end.usage,
            None if end is None else end.metrics,
            None if end is None else end.error,
            self.prompt_logprobs,
        )


class CompletionCollector:
    """The one accumulator of a request's stream (offline, gRPC and HTTP alike): each branch's
    end (finish, usage, metrics, error), and its text, token ids and log-probabilities unless
    `keep_output` is off (a stream that only needs the totals). Owns the request's usage
    (through `Usage.of_request`).

    Args:
        keep_output: put whole completions together (a unary response needs them).
        request_id: the request's id until a delta names it.
    """

    def __init__(self, keep_output: bool = True, request_id: str = "") -> None:
        self.keep_output = keep_output
        self.request_id = request_id
        self.worker_id = ""
        self.metrics: RequestMetrics | None = None  # the last finished branch's (e2e set)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._branches: dict[int, _Branch] = {}
        self._best: list[CompletionOutput] | None = None  # `keep_best`'s pick

    def add(self, delta: StreamDelta) -> None:
        self.request_id = delta.request_id or self.request_id
        self.worker_id = delta.worker_id or self.worker_id
        branch = self._branches.get(delta.index)
        if branch is None:
            branch = self._branches[delta.index] = _Branch()
        if self.keep_output:
            branch.text_pieces.append(delta.text)
            branch.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                if branch.logprobs is None:
                    branch.logprobs = []
                branch.logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs is not None and branch.prompt_logprobs is None:
                branch.prompt_logprobs = list(delta.prompt_logprobs)
                self.prompt_logprobs = self.prompt_logprobs or branch.prompt_logprobs
        if delta.finish_reason is not None:
            branch.end = delta
            self.metrics = delta.metrics or self.metrics

    @property
    def num_branches(self) -> int:
        return len(self._branches)

    @property
    def completions(self) -> list[CompletionOutput]:
        """The branches, in order (after `keep_best`: the ones it kept, best first)."""
        if self._best is not None:
            return self._best
        return [self._branches[i].output(i) for i in sorted(self._branches)]

    def keep_best(self, n: int) -> None:
        """Keep the `n` branches of highest cumulative log-probability of their tokens (ties:
        the lower branch), renumbered 0..n-1 best first: `best_of`. `usage` still counts every
        branch, since every one was generated."""
        ranked = sorted(self.completions, key=lambda c: (-c.logprob_sum, c.index))
        self._best = [dataclasses.replace(c, index=i) for i, c in enumerate(ranked[:n])]

    def usage(self) -> Usage:
        """The request's usage: prompt and cached tokens once, completion tokens summed over
        the branches that finished."""
        ends = (self._branches[i].end for i in sorted(self._branches))
        return Usage.of_request(end.usage for end in ends if end is not None and end.usage)


@dataclass(frozen=True)
class RequestOutput:
    """A whole request, as the offline API returns it: every branch's output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    handoffs: dict[int, RequestHandoff] = field(default_factory=dict)  # branches that moved
    # One per prompt token (the first None) when `SamplingParams.prompt_logprobs` asked.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class OutputBuilder:
    """Adds one request's engine deltas up into a whole `RequestOutput` (the offline API's
    shape): its branches through a `CompletionCollector`, the request's prompt and handoffs
    from its last delta."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._collector = CompletionCollector()
        self._last: RequestDelta | None = None

    def add(self, delta: RequestDelta) -> None:
        self._last = delta
        for completion in delta.completions:
            self._collector.add(completion)

    def build(self) -> RequestOutput:
        """The request as the deltas so far tell it (whole once its last delta was added)."""
        last = self._last
        assert last is not None, "no delta was added"
        collector = self._collector
        outputs = collector.completions
        ends = [c.usage for c in outputs if c.usage is not None]
        return RequestOutput(
            request_id=last.request_id,
            prompt=last.prompt,
            prompt_token_ids=last.prompt_token_ids,
            outputs=outputs,
            finished=last.finished,
            num_cached_tokens=ends[0].cached_tokens if ends else 0,
            metrics=collector.metrics or RequestMetrics(),
            handoffs=last.handoffs,
            prompt_logprobs=collector.prompt_logprobs,
        )
