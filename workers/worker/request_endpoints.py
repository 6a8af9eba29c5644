"""The request endpoints of a worker's core: admit a request, stream its messages, pause,
abort, drain.

`WorkerRequests` is the part of `WorkerCore` (`workers/worker/core.py`) that callers send
requests through. Two ways out for a request's messages, one registry of open streams
(`StreamTable`, `workers/worker/streams.py`):

    router ── submit(WorkerRequest) ──► admitted (or refused: RequestRejected, Overloaded,
                                        Draining); its messages go to its owner's channel
    router ◄── channel(owner) ───────── one StepBatch per engine step: every StreamDelta,
                                        RequestMoved, RequestFailed of that owner's requests
    router ── set_paused / abort ─────► its buffer of the request filled up / drained; cancel
    caller ◄── generate / adopt ─────── one request's messages alone, through its own
                                        bounded buffer (callers without a channel)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedserve.workers.protocol.errors import Draining, HandedOff, Overloaded, RequestRejected
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stats import DrainResult
from pagedserve.workers.protocol.stream import RequestFailed, RequestMoved, StepBatch, StreamDelta
from pagedserve.workers.telemetry.request_trace import RequestTrace, RequestTraces
from pagedserve.workers.worker.stream import DeltaBuffer, ends_branch
from pagedserve.workers.worker.streams import StreamTable

if TYPE_CHECKING:
    from pagedserve.workers.worker.fault_injection import StepFaults

logger = logging.getLogger(__name__)


class WorkerRequests:
    """The request endpoints `WorkerCore` inherits. Owns nothing of its own: the streams are
    the core's `StreamTable`, and every change to the engine goes through `_on_engine` (or
    `_on_engine_soon`), so no step runs meanwhile. What it uses of the core is declared
    below."""

    engine: Any
    worker_id: str
    traces: RequestTraces
    max_buffered_deltas: int
    draining: bool
    _streams: StreamTable
    _wakeup: asyncio.Event
    faults: StepFaults | None
    start: Callable[[], None]
    _on_engine: Callable[[Callable[[], Any]], Any]
    _on_engine_soon: Callable[[Callable[[], Any]], None]
    _dispatch: Callable[..., None]
    _publish_events: Callable[[], None]

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: str = "",
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        trace_context: dict[str, str] | None = None,
        owner_id: str | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas until every branch finished. Raises `RequestRejected`.

        Leaving the iteration early (cancellation, a closed stream) aborts the request and
        frees its blocks. `trace_context` (a W3C carrier) parents this request's spans.
        `owner_id` ties the request to that owner's lease (None: no lease).
        """
        add = functools.partial(
            self.engine.add_request,
            request_id,
            prompt,
            params,
            priority=priority,
            tenant=tenant,
            cache_salt=cache_salt,
            timeout_s=timeout_s,
            lora=lora,
        )
        trace = self.traces.open(request_id, trace_context, params)
        async for delta in self._stream(request_id, params.n, add, trace, owner_id):
            yield delta

    async def adopt(
        self,
        handoff: RequestHandoff,
        trace_context: dict[str, str] | None = None,
        owner_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Continue a request a peer handed off; streams only the tokens it generates here (and
        text the peer held back): the engine counts the handoff's output as reported.
        `owner_id` as in `generate`."""
        trace = self._open_adopt_trace(handoff, trace_context)
        start = functools.partial(self.engine.adopt, handoff)
        async for delta in self._stream(handoff.request_id, 1, start, trace, owner_id):
            yield delta

    def _open_adopt_trace(self, handoff: RequestHandoff, trace_context) -> RequestTrace:
        trace = self.traces.open(handoff.request_id, trace_context, handoff.params, "worker.adopt")
        if handoff.timings is not None:
            trace.elapsed_ns = int(handoff.timings.elapsed_s * 1e9)
        return trace

    async def submit(self, request: WorkerRequest) -> None:
        """Admit a request whose messages go out through its owner's channel (`channel`).

        Returns once the engine took it; raises what `generate` would raise before its first
        delta (`RequestRejected`, `Overloaded`, `Draining`). A moved request
        (`request.handoff`) must carry its KV already (the actor fetched it).
        """
        if request.owner_id is None:
            raise RequestRejected("a submitted request needs its owner_id (its channel)")
        if request.handoff is not None:
            handoff = request.handoff
            trace = self._open_adopt_trace(handoff, request.trace_context)
            add = functools.partial(self.engine.adopt, handoff)
        else:
            trace = self.traces.open(request.request_id, request.trace_context, request.params)
            add = functools.partial(
                self.engine.add_request,
                request.request_id,
                request.prompt,
                request.params,
                priority=request.priority,
                tenant=request.tenant,
                cache_salt=request.cache_salt,
                timeout_s=request.timeout_s,
                lora=request.lora,
            )
        await self._admit(request.request_id, request.num_branches, add, trace, request.owner_id)

    async def channel(self, owner_id: str) -> AsyncIterator[StepBatch]:
        """Stream every message of `owner_id`'s requests here, one `StepBatch` per engine step
        (all that waits, when the reader lags; an empty one as a heartbeat).

        A newer `channel` call of the same owner supersedes this one (it ends, nothing
        aborted). Any other end (the caller died, or closed the call) aborts every request of
        that owner here at once: nobody reads them any more.
        """
        self.start()
        channel = self._streams.channel(owner_id)
        reader = channel.attach()
        try:
            while (batch := await channel.next_batch(reader)) is not None:
                yield batch
        finally:
            if channel.detach(reader):
                orphans = self._streams.close_channel(channel)
                if orphans:
                    logger.warning(
                        "owner %s closed its channel; aborting its %d requests",
                        owner_id,
                        len(orphans),
                    )
                    self._on_engine_soon(functools.partial(self._abort_all, orphans))

    def set_paused(self, request_id: str, paused: bool, seq: int) -> None:
        """Pause (or resume) a request whose reader is the router's buffer: it fell behind
        (or caught up). `seq` numbers the router's calls for this request: one older than the
        last applied came late and is ignored. An unknown request is ignored too."""
        stream = self._streams.get(request_id)
        if stream is None or seq <= stream.flow_seq:
            return
        stream.flow_seq = seq
        change = self.engine.pause if paused else self.engine.resume
        self._on_engine_soon(functools.partial(change, request_id))
        if not paused:
            self._wakeup.set()

    async def _admit(
        self,
        request_id: str,
        num_branches: int,
        add: Callable[[], None],
        trace: RequestTrace,
        owner_id: str | None,
        buffer: DeltaBuffer | None = None,
    ) -> None:
        """Register the request's stream and add it to the engine. Raises the refusals."""
        self.start()
        if self.draining:
            raise Draining(f"worker {self.worker_id} is draining", retry_after_s=0.0)
        if self.faults is not None and self.faults.take_refusal():
            raise Overloaded(f"worker {self.worker_id} refused on purpose (fault injection)")
        stream = self._streams.open(request_id, owner_id, num_branches, trace, buffer)
        try:
            await self._on_engine(add)
        except BaseException:  # refused by the engine, or the caller left while it was added
            self._streams.close(stream, aborted=True)
            await asyncio.shield(self._abort_quietly(request_id))
            raise
        self._streams.admitted(stream)
        self._wakeup.set()

    async def _stream(
        self,
        request_id: str,
        num_branches: int,
        add: Callable[[], None],
        trace: RequestTrace,
        owner_id: str | None,
    ) -> AsyncIterator[StreamDelta | RequestMoved]:
        buffer = DeltaBuffer(self.max_buffered_deltas)
        await self._admit(request_id, num_branches, add, trace, owner_id, buffer)
        stream = self._streams.get(request_id)
        remaining = num_branches
        try:
            while remaining:
                message = await buffer.get_coalesced()  # what waits of one branch, as one
                if isinstance(message, RequestFailed):  # `drain` ran out of grace: replay
                    raise message.error
                if ends_branch(message):
                    remaining -= 1
                elif buffer.drained():
                    await self._resume(request_id, buffer)
                yield message
        finally:
            # Left before its end (cancelled, a closed stream): nobody reads it any more.
            # (Closed already: a drain cut it off, and aborted it.)
            closed = stream is not None and self._streams.close(stream, aborted=bool(remaining))
            if closed and remaining:
                await asyncio.shield(self._abort_quietly(request_id))

    async def _resume(self, request_id: str, buffer: DeltaBuffer) -> None:
        buffer.paused = False
        await self._on_engine(functools.partial(self.engine.resume, request_id))
        self._wakeup.set()

    async def _abort_quietly(self, request_id: str) -> None:
        await self._on_engine(functools.partial(self._abort_all, [request_id]))

    def _abort_all(self, request_ids: list[str]) -> None:
        """Abort requests whose streams are closed already (nothing is sent for them)."""
        for request_id in request_ids:
            self.engine.abort(request_id)
        self._publish_events()

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with finish_reason "abort". False if unknown."""
        delta = await self._on_engine(lambda: self.engine.abort(request_id))
        if delta is None:
            return False
        self._dispatch(delta)
        self._publish_events()
        return True

    async def drain(self, grace_s: float) -> DrainResult:
        """Stop admitting, let open streams finish for up to `grace_s`, then end the rest with
        `HandedOff` (their blocks are freed; the router replays them on a peer).

        Returns:
            How many streams finished within the grace period and how many were handed off.
        """
        self.draining = True
        open_at_start = len(self._streams)
        end = time.monotonic() + grace_s
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.02)
        cut_off = self._streams.cut_off(
            lambda: HandedOff(f"worker {self.worker_id} drained before this request ended")
        )
        await self._on_engine(functools.partial(self._abort_all, cut_off))
        return DrainResult(finished=open_at_start - len(cut_off), handed_off=len(cut_off))
