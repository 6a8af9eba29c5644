"""What a worker streams back per step: token deltas, the final usage and timings, and the
bounded buffer a stream's deltas wait in until its reader takes them."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from pagedserve.workers.logprobs import TokenLogprob
from pagedserve.workers.outputs import RequestDelta, RequestMetrics, Usage
from pagedserve.workers.stop_checker import FinishReason
from pagedserve.workers.worker_types import RequestMoved


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
    # With SamplingParams.logprobs: one per token of `token_ids`. With prompt_logprobs: one per
    # prompt token (the first None), on the branch's first delta.
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def stream_deltas(
    delta: RequestDelta, worker_id: str = "", error: str | None = None
) -> list[StreamDelta | RequestMoved]:
    """One engine delta as stream messages, one per branch it touched (no accumulation: the
    engine already reports only what is new). `error` goes on each branch's last delta; a
    branch that moved to a peer ends with the control message `RequestMoved` instead."""
    return [
        RequestMoved(delta.request_id, c.index, worker_id, delta.handoffs[c.index])
        if c.finish_reason == FinishReason.MOVED
        else StreamDelta(
            delta.request_id,
            c.index,
            c.token_ids,
            c.text,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            usage=c.usage,
            metrics=c.metrics,
            worker_id=worker_id or None,
            error=error if c.finished else None,
            logprobs=c.logprobs,
            prompt_logprobs=c.prompt_logprobs,
        )
        for c in delta.completions
    ]


def merge_deltas(first: StreamDelta, then: StreamDelta) -> StreamDelta:
    """One message carrying two consecutive deltas of one branch (`first` not finished): the
    tokens, text and log-probabilities of both in order, the end (finish, usage, metrics,
    error) of `then`, the prompt log-probabilities of whichever has them."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return StreamDelta(
        first.request_id,
        first.index,
        first.token_ids + then.token_ids,
        first.text + then.text,
        finish_reason=then.finish_reason,
        stop_reason=then.stop_reason,
        usage=then.usage,
        metrics=then.metrics,
        worker_id=then.worker_id or first.worker_id,
        error=then.error,
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs
        if first.prompt_logprobs is not None
        else then.prompt_logprobs,
    )


DEFAULT_MAX_BUFFERED_DELTAS = 64
# Messages a worker's stream may run ahead of its reader (Ray's generator backpressure on
# `Worker.generate`): one number for both, so coalescing can bound what they carry.
RUN_AHEAD_MESSAGES = 8


class DeltaBuffer:
    """Owns one stream's deltas not yet taken by its reader, and whether it asked for a pause.

    The worker pauses the request once `full()` (the engine stops decoding it, so nothing but
    a final delta can arrive: at most `capacity` deltas plus one step's worth wait here) and
    resumes it once the reader has drained the buffer to `low_water`. A `None` entry is the
    drain's cut-off signal.

    Args:
        capacity: deltas buffered before the request is paused (>= 1).
    """

    def __init__(self, capacity: int = DEFAULT_MAX_BUFFERED_DELTAS) -> None:
        if capacity < 1:
            raise ValueError(f"max_buffered_deltas must be >= 1, got {capacity}")
        self.capacity = capacity
        self.low_water = capacity // 2
        self.max_merged = max(1, capacity // RUN_AHEAD_MESSAGES)
        self.paused = False
        self._deltas: deque[StreamDelta | RequestMoved | None] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._deltas)

    def put(self, delta: StreamDelta | RequestMoved | None) -> None:
        self._deltas.append(delta)
        self._ready.set()

    def full(self) -> bool:
        return len(self._deltas) >= self.capacity

    def drained(self) -> bool:
        """Paused and read down to the low-water mark: time to resume."""
        return self.paused and len(self._deltas) <= self.low_water

    async def get(self) -> StreamDelta | RequestMoved | None:
        while not self._deltas:
            self._ready.clear()
            await self._ready.wait()
        return self._deltas.popleft()

    async def get_coalesced(self) -> StreamDelta | RequestMoved | None:
        """The next message: every delta of the same branch waiting in a row, merged into one
        (`merge_deltas`), so a reader that fell behind by k steps gets one message, not k.
        A `RequestMoved`, a drain's `None`, another branch's delta or a finished delta ends
        the run. `WorkerCore` streams read their buffer this way.

        So the Ray objects a stream may run ahead of its reader
        (`Worker.STREAM_BACKPRESSURE_OBJECTS`, 8) can carry a whole answer: a test that means
        to cut a stream mid-way must stop the engine first (`WorkerCore.chaos_stall` with
        `after_steps`), not count on a kill landing before the tokens went out. Branches of
        one request (n > 1) interleave in the buffer, so each step's deltas of different
        branches stay separate messages.

        A message merges at most `max_merged` deltas (`capacity // RUN_AHEAD_MESSAGES`), so a
        reader that stops reading still pauses its request within about twice `capacity`
        steps (the messages in flight plus a full buffer): unbounded merging let each of the
        messages in flight carry a whole buffer, and an unread 400-token stream ran to its
        end and freed its router slot while its client had read one message."""
        delta = await self.get()
        merged = 1
        while (
            merged < self.max_merged
            and isinstance(delta, StreamDelta)
            and delta.finish_reason is None
            and self._deltas
            and isinstance(self._deltas[0], StreamDelta)
            and self._deltas[0].index == delta.index
        ):
            delta = merge_deltas(delta, self._deltas.popleft())
            merged += 1
        return delta
