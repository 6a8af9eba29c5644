"""How a worker streams back per step: an engine delta made into stream messages (the
messages themselves, `StreamDelta`, `RequestMoved`, `RequestFailed` and the `StepBatch` that
carries them, are in `workers/protocol/stream.py`), the channel that collects one owner's
messages, and the bounded buffer a stream's messages wait in until its reader takes them.

    engine step ─► RequestDelta ─► stream_deltas ─► StreamDelta | RequestMoved (per branch)
        ├─► OwnerChannel (its owner's requests) ─► StepBatch, one per step ─► the router
        └─► DeltaBuffer (one request's own reader, `WorkerCore.generate`)

The router reads each batch into one `DeltaBuffer` per request (`cluster/router/worker_channel.py`),
so the bounded buffer and its coalescing are the same on both sides of a channel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import deque

from pagedserve.workers.engine.outputs import RequestDelta
from pagedserve.workers.protocol.stream import (
    FinishReason,
    RequestMoved,
    StepBatch,
    StreamDelta,
    StreamMessage,
)


def stream_deltas(
    delta: RequestDelta, error: str | None = None
) -> list[StreamDelta | RequestMoved]:
    """One engine delta as stream messages, one per branch it touched: the engine's own
    `StreamDelta`s, passed on as they are (no copy on the per-token path). `error` goes on each
    branch's last delta (a copy, once per failed branch); a branch that moved to a peer ends
    with the control message `RequestMoved` instead."""
    return [
        RequestMoved(c.request_id, c.index, c.worker_id or "", delta.handoffs[c.index])
        if c.finish_reason is FinishReason.MOVED
        else dataclasses.replace(c, error=error)
        if error is not None and c.finished
        else c
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
        embedding=then.embedding,
        cumulative_logprob=then.cumulative_logprob,
    )


def ends_branch(message: StreamMessage) -> bool:
    """Whether a message is the last of its branch on this worker (finished, or moved on)."""
    return isinstance(message, RequestMoved) or (
        isinstance(message, StreamDelta) and message.finish_reason is not None
    )


class OwnerChannel:
    """Owns the messages of one owner's requests on a worker that are not sent yet, and which
    reader (the owner's open `WorkerCore.channel` call) sends them.

    The step loop puts every message of a step before any reader runs again, so a reader that
    keeps up sends one batch per step; one that lags (Ray holds it at its `yield`) sends all
    that waits as one batch. A newer reader of the same owner supersedes the one before it,
    which then ends without aborting anything (the owner reopened its channel).

    Args:
        owner_id: the owner (a router replica's id).
        worker_id: the worker, named in every batch.
    """

    def __init__(self, owner_id: str, worker_id: str) -> None:
        self.owner_id = owner_id
        self.worker_id = worker_id
        self._pending: list[StreamMessage] = []
        self._ready = asyncio.Event()
        self._numbers = itertools.count(1)
        self._reader = 0  # the current reader's number; 0: none
        self._beat_due = False
        self._sent = False  # a batch went out since the last heartbeat round

    def put(self, message: StreamMessage) -> None:
        self._pending.append(message)
        self._ready.set()

    @property
    def has_reader(self) -> bool:
        return self._reader != 0

    def attach(self) -> int:
        """A new reader: returns its number; the one before it (if any) ends at its next wait."""
        self._reader = next(self._numbers)
        self._ready.set()
        return self._reader

    def detach(self, reader: int) -> bool:
        """`reader` ended. Returns whether it was the current one (not superseded): then the
        owner stopped reading, and its requests here have nobody to stream to."""
        if reader != self._reader:
            return False
        self._reader = 0
        return True

    def beat(self) -> None:
        """A heartbeat round: a reader that sent nothing since the last round sends an empty
        batch. Ray tells a generator that its caller died only at a `yield`, so without it a
        dead owner's idle channel would never end."""
        if not self._sent:
            self._beat_due = True
            self._ready.set()
        self._sent = False

    async def next_batch(self, reader: int) -> StepBatch | None:
        """What waits, as one batch, once something does; None once `reader` is superseded."""
        while reader == self._reader:
            if self._pending or self._beat_due:
                batch = StepBatch(self.worker_id, tuple(self._pending))
                self._pending = []
                self._beat_due = False
                self._sent = True
                return batch
            self._ready.clear()
            await self._ready.wait()
        return None


DEFAULT_MAX_BUFFERED_DELTAS = 64
# Messages a stream may run ahead of its reader beyond its buffer: Ray's generator
# backpressure on `Worker.generate`, and on the router's side what the Serve stream above it
# takes before it stops reading. One number for both, so coalescing can bound what they carry.
RUN_AHEAD_MESSAGES = 8


class DeltaBuffer:
    """Owns one stream's messages not yet taken by its reader, and whether it asked for a
    pause.

    Its request is paused once `full()` (the engine stops decoding it, so nothing but a final
    delta can arrive: at most `capacity` deltas plus one step's worth wait here) and resumed
    once the reader has drained the buffer to `low_water`. On a worker the buffer of a
    `WorkerCore.generate` stream pauses the engine itself; on the router the buffer of each
    request read from a channel asks its worker to (`cluster/router/worker_channel.py`). A
    `RequestFailed` entry ends the stream with its error (a drain's cut-off).

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
        self._deltas: deque[StreamMessage] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._deltas)

    def put(self, delta: StreamMessage) -> None:
        self._deltas.append(delta)
        self._ready.set()

    def full(self) -> bool:
        return len(self._deltas) >= self.capacity

    def drained(self) -> bool:
        """Paused and read down to the low-water mark: time to resume."""
        return self.paused and len(self._deltas) <= self.low_water

    async def get(self) -> StreamMessage:
        while not self._deltas:
            self._ready.clear()
            await self._ready.wait()
        return self._deltas.popleft()

    async def get_coalesced(self) -> StreamMessage:
        """The next message: every delta of the same branch waiting in a row, merged into one
        (`merge_deltas`), so a reader that fell behind by k steps gets one message, not k.
        A `RequestMoved`, a `RequestFailed`, another branch's delta or a finished delta ends
        the run. `WorkerCore.generate` streams and the router's channel streams read their
        buffer this way.

        So the messages a stream may run ahead of its reader (`RUN_AHEAD_MESSAGES`, 8) can
        carry a whole answer: a test that means to cut a stream mid-way must stop the engine
        first (`FaultInjectingWorker.chaos_stall` with `after_steps`), not count on a kill
        landing before the tokens went out. Branches of one request (n > 1) interleave in the
        buffer, so each step's deltas of different branches stay separate messages.

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
