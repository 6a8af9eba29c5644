"""What the engine hands back, in two shapes.

``Engine.step()`` returns deltas, as vLLM's delta outputs do: per request it touched, per branch,
only what is new since the last step. Only the outermost layer that needs a whole answer adds
them up::

    Engine.step() ─► RequestDelta ─┬─► WorkerCore: StreamDelta per branch ─► router ─► API collector
                                   └─► LLM.generate: OutputBuilder ─► RequestOutput (whole)

- `CompletionDelta` / `RequestDelta`: one step's news. A branch's last delta carries its finish
  reason, stop reason, usage and metrics; no delta repeats a token or a character.
- `CompletionOutput` / `RequestOutput`: a whole request, as `LLM.generate` returns it.
- `Usage` and `RequestMetrics` (in `workers/protocol/stream.py`: they cross to the router in
  every last `StreamDelta`): the token counts and timings of one branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.workers.protocol.stream import RequestMetrics, Usage

if TYPE_CHECKING:
    from pagedserve.workers.protocol.handoff import RequestHandoff
    from pagedserve.workers.protocol.stream import TokenLogprob


@dataclass(frozen=True)
class CompletionDelta:
    """What one branch (index < n) produced since its last delta.

    `text` is only final text: the detokenizer holds back a tail that may still become a stop
    string or finish a split UTF-8 character, so `token_ids` may arrive before their text. The
    branch's last delta has `finish_reason` set and carries `usage` and `metrics`.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    metrics: RequestMetrics | None = None
    # With `SamplingParams.logprobs`: one per token of `token_ids`. With `prompt_logprobs`: one
    # per prompt token (the first None), on the branch's first delta only.
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An embedding request's (`SamplingParams.pooling`) vector, on its last delta.
    embedding: list[float] | None = None
    # A beam search's hypothesis: the sum of its tokens' log-probabilities (its only delta).
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    completions: list[CompletionDelta]
    finished: bool
    handoffs: dict[int, RequestHandoff] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One whole branch of a request (index < n): its text and token ids."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # One per token of `token_ids` when `SamplingParams.logprobs` asked for them.
    logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (`pooling`)
    cumulative_logprob: float | None = None  # a beam search's hypothesis: its summed logprob

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
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
    """Adds one request's deltas up into a whole `RequestOutput` (the offline API's shape).

    Owns the branches' token ids and text pieces so far; text is joined once, in `build`.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._tokens: dict[int, list[int]] = {}
        self._texts: dict[int, list[str]] = {}
        self._ends: dict[int, CompletionDelta] = {}
        self._logprobs: dict[int, list[TokenLogprob | None]] = {}
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self._metrics: RequestMetrics | None = None
        self._last: RequestDelta | None = None

    def add(self, delta: RequestDelta) -> None:
        self._last = delta
        for completion in delta.completions:
            index = completion.index
            self._tokens.setdefault(index, []).extend(completion.token_ids)
            self._texts.setdefault(index, []).append(completion.text)
            if completion.logprobs is not None:
                self._logprobs.setdefault(index, []).extend(completion.logprobs)
            if completion.prompt_logprobs is not None:
                self._prompt_logprobs = completion.prompt_logprobs
            if completion.finished:
                self._ends[index] = completion
                # The last branch to finish saw the whole request's metrics (e2e set).
                self._metrics = completion.metrics or self._metrics

    def build(self) -> RequestOutput:
        """The request as the deltas so far tell it (whole once its last delta was added)."""
        last = self._last
        assert last is not None, "no delta was added"
        outputs = [
            CompletionOutput(
                index,
                "".join(self._texts[index]),
                self._tokens[index],
                None if (end := self._ends.get(index)) is None else end.finish_reason,
                None if end is None else end.stop_reason,
                self._logprobs.get(index),
                None if end is None else end.embedding,
                None if end is None else end.cumulative_logprob,
            )
            for index in sorted(self._tokens)
        ]
        usage = next((e.usage for e in self._ends.values() if e.usage is not None), None)
        return RequestOutput(
            request_id=last.request_id,
            prompt=last.prompt,
            prompt_token_ids=last.prompt_token_ids,
            outputs=outputs,
            finished=last.finished,
            num_cached_tokens=0 if usage is None else usage.cached_tokens,
            metrics=self._metrics or RequestMetrics(),
            handoffs=last.handoffs,
            prompt_logprobs=self._prompt_logprobs,
        )
