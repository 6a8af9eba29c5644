"""What a worker streams back to its caller, per branch of a request: token deltas (the last
one with its finish reason, usage and timings), the control messages that end a branch
otherwise (`RequestMoved`: continue on a peer; `RequestFailed`: raise this error), and the
batch that carries one engine step's messages of one owner's requests.

    engine ─► StreamDelta (one per branch it touched, in a RequestDelta) ─► worker
    worker ─► StepBatch(StreamDelta | RequestMoved | RequestFailed, ...) ─► router
    router ─► StreamDelta (the client's request id and branch index) ─► front end

`StreamDelta` is the one delta shape, built once by the engine and passed on as it is: the
router makes a copy (`dataclasses.replace`) only where a field must differ (a tenant-scoped id,
a moved branch's index). `finish_reason` is a `FinishReason` all the way; the front ends spell
it as its string value at the edge (`str(reason)`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.handoff import RequestHandoff


class FinishReason(StrEnum):
    """Why a sequence ended; the values (also `str()`) are what the API reports."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"  # the client cancelled
    TIMEOUT = "timeout"  # the request's deadline passed
    ERROR = "error"  # the engine failed the request
    MOVED = "moved"  # handed to a peer worker with its KV; the stream continues there


@dataclass(frozen=True)
class Usage:
    """Token counts: of one branch (prompt and cached tokens are the request's, completion
    tokens the branch's own), or added up with `of_request` / `total`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @staticmethod
    def of_request(branches: Iterable[Usage]) -> Usage:
        """One request's usage from its branches': prompt and cached tokens once (the branches
        share the prompt), completion tokens summed."""
        branches = list(branches)
        if not branches:
            return Usage(0, 0, 0)
        first = branches[0]
        completion = sum(u.completion_tokens for u in branches)
        return Usage(first.prompt_tokens, completion, first.cached_tokens)

    @staticmethod
    def total(requests: Iterable[Usage]) -> Usage:
        """Several requests' usage (e.g. a batch of prompts): every count summed."""
        requests = list(requests)
        return Usage(
            sum(u.prompt_tokens for u in requests),
            sum(u.completion_tokens for u in requests),
            sum(u.cached_tokens for u in requests),
        )


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings in seconds, measured on the worker's monotonic clock."""

    queue_time: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    inter_token_latencies: tuple[float, ...] = ()
    num_preemptions: int = 0
    # Speculative decoding (0 when off): verify steps, drafts they checked, drafts accepted.
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class TopLogprob(NamedTuple):
    """One of the most likely tokens of a position."""

    token_id: int
    logprob: float
    token: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability and rank, and the top alternatives.

    Attributes:
        token_id: the sampled (or prompt) token.
        logprob: its log-probability.
        rank: 1 for the most likely token of the position.
        token: its text.
        top: the ``k`` most likely tokens, best first (ties: lower id).
    """

    token_id: int
    logprob: float
    rank: int
    token: str = ""
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one branch since its last delta; the last one carries finish and usage.

    The engine builds it (`workers/engine/request.py`), the worker sends it, the router
    forwards it, the front ends read it: one shape from the step to the client. Its lists are
    the builder's and are never changed after (frozen: no field is reassigned).

    `text` is only final text: the detokenizer holds back a tail that may still become a stop
    string or finish a split UTF-8 character, so `token_ids` may arrive before their text.

    Attributes:
        request_id: the request (the worker's tenant-scoped id; the client's from the router).
        index: the branch (< n).
        token_ids: the branch's new tokens.
        text: their final text.
        finish_reason: set on the branch's last delta.
        stop_reason: the stop string or token id that ended it, if one did.
        usage: the branch's token counts (last delta).
        metrics: the request's timings (last delta).
        worker_id: the worker that produced it.
        error: why the engine failed the request (last delta, finish reason `error`).
        logprobs: with `SamplingParams.logprobs`, one per token of `token_ids`.
        prompt_logprobs: with `prompt_logprobs`, one per prompt token (the first None), on the
            branch's first delta only.
        embedding: an embedding request's vector (`SamplingParams.pooling`), last delta.
        cumulative_logprob: a beam search's hypothesis: the sum of its tokens' logprobs.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    metrics: RequestMetrics | None = None
    worker_id: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMoved:
    """A branch left this worker: continue it on a peer from `handoff` (never shown to the
    client; the router follows it)."""

    request_id: str
    index: int
    worker_id: str
    handoff: RequestHandoff


@dataclass(frozen=True)
class RequestFailed:
    """A request's stream ended with an error instead of its last delta: the reader raises
    `error` (today a drain's cut-off, `HandedOff`: the router replays the request on a peer).

    Attributes:
        request_id: the request whose stream ends.
        error: what its reader raises; a refusal type, so the front ends map it as they map
            the same error raised by `Worker.submit`.
    """

    request_id: str
    error: RequestRejected

    def __post_init__(self) -> None:
        if not isinstance(self.error, RequestRejected):
            raise TypeError(f"RequestFailed carries a RequestRejected, not {self.error!r}")


StreamMessage = StreamDelta | RequestMoved | RequestFailed


_MESSAGE_TYPES = (StreamDelta, RequestMoved, RequestFailed)


@dataclass(frozen=True)
class StepBatch:
    """Every stream message of one owner's requests on one worker since its last batch: one
    engine step's, or a few steps' when the reader lagged. Empty: a heartbeat (so Ray finds
    out, at the `yield`, that the reader is gone).

    Attributes:
        worker_id: the worker that sent it.
        messages: in the order the engine made them (a branch's deltas stay in order).
        seq: its number in a channel with a lane (1, 2, ...; `workers/protocol/lane.py`),
            by which the router orders what came through the lane and through Ray; 0: not
            numbered, sent through Ray alone (which keeps the order).
    """

    worker_id: str
    messages: tuple[StreamMessage, ...] = ()
    seq: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.messages, tuple):
            raise TypeError(f"StepBatch.messages is a tuple, not {type(self.messages).__name__}")
        for message in self.messages:
            if not isinstance(message, _MESSAGE_TYPES):
                raise TypeError(f"not a stream message: {message!r}")
