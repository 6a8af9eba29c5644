"""What a worker streams back per step: token deltas, the final usage and timings, and the
bounded buffer a stream's deltas wait in until its reader takes them."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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


DEFAULT_MAX_BUFFERED_DELTAS = 64


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
        self.paused = False
        self._deltas: deque[StreamDelta | None] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._deltas)

    def put(self, delta: StreamDelta | None) -> None:
        self._deltas.append(delta)
        self._ready.set()

    def full(self) -> bool:
        return len(self._deltas) >= self.capacity

    def drained(self) -> bool:
        """Paused and read down to the low-water mark: time to resume."""
        return self.paused and len(self._deltas) <= self.low_water

    async def get(self) -> StreamDelta | None:
        while not self._deltas:
            self._ready.clear()
            await self._ready.wait()
        return self._deltas.popleft()
