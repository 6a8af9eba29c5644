"""The router's side of the workers' channels: one message per engine step per worker.

Each worker streams everything this router sent it through one `Worker.channel(router_id)`
call, opened on first use: a `StepBatch` per engine step with every message of this router's
requests there. `WorkerChannels` keeps one `WorkerChannel` per worker, whose reader task
demultiplexes the batches into one `RequestStream` per request leg; `RouterCore._stream`
reads its leg from there:

    RouterCore._stream ─► WorkerChannels.open ─► RequestStream (registered first: the
        worker's messages for it may come before its submit returns)
    RequestStream.submit ─► Worker.submit ─► admitted, or refused (raised by `next`)
    Worker.channel ─StepBatch─► WorkerChannel._read ─► RequestStream.put ─► its DeltaBuffer
    RouterCore._stream ◄── RequestStream.next ◄── (a branch's waiting deltas merged, as on a
        worker: `DeltaBuffer.get_coalesced`)

Backpressure: a request's buffer holds `max_buffered_deltas` messages unread before the
router asks its worker to pause the request (`Worker.set_paused`: it keeps its blocks and is
the first to be preempted), and resumes it once its reader drained the buffer to half. Cancel:
a leg closed before its end is aborted on its worker (`Worker.abort`), once its submit went
through. Loss: a worker that dies ends its channel with one of `WORKER_LOST_ERRORS`, raised in
each of its streams; one the liveness poll judges hung (stalled, or unanswering) has its
streams ended from there (`worker_hung`), so no read needs a timer of its own. A channel that
ended, or whose worker restarted (a new epoch), is opened anew for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import ray

from pagedserve.cluster.router.lane_server import LaneInbox, lane_server
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.errors import NoWorkerAvailable, RequestRejected, WorkerLost
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.stream import (
    RequestFailed,
    RequestMoved,
    StepBatch,
    StreamDelta,
    StreamMessage,
)
from pagedserve.workers.ray_internals import detached_context, detached_task
from pagedserve.workers.worker.stream import DeltaBuffer

logger = logging.getLogger(__name__)

# How long the end of a lane's channel waits for what its worker sent through the lane before
# it ended the call (the worker flushes its lane first, so it is there at once).
LANE_END_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _Ended:
    """Put in a request's buffer by the router itself: its stream ends raising `error` (a
    refused submit, the channel lost, the worker hung)."""

    error: BaseException


class RequestStream:
    """Owns one request leg's messages from its worker that its reader has not taken yet (a
    bounded `DeltaBuffer`), its admission (the `Worker.submit` call) and the pauses it asked
    the worker for.

    Args:
        channel: the worker's channel it is read from.
        request_id: the leg's id on the worker.
        capacity: messages buffered unread before the worker is asked to pause the request.
    """

    def __init__(self, channel: WorkerChannel, request_id: str, capacity: int) -> None:
        self.channel = channel
        self.request_id = request_id
        self.buffer = DeltaBuffer(capacity)
        self.refused = False  # the submit was refused: nothing of ours runs on the worker
        self._admission: asyncio.Future | None = None
        self._flow_seq = 0  # numbers this leg's pause and resume calls, in the order sent

    def submit(self, request: WorkerRequest) -> None:
        """Send the request to the worker; a refusal or a loss is what `next` raises."""
        self._admission = asyncio.ensure_future(self._submit(request))

    async def _submit(self, request: WorkerRequest) -> None:
        try:
            await self.channel.worker.handle.submit.remote(request)
        except RequestRejected as error:  # Overloaded and Draining too: nothing to cancel
            self.refused = True
            self.buffer.put(_Ended(error))
        except Exception as error:  # the worker lost, or its own failure
            self.buffer.put(_Ended(error))

    def put(self, message: StreamMessage) -> None:
        """A message from the channel. Past `capacity` unread, pause the request there."""
        buffer = self.buffer
        buffer.put(message)
        if (
            not buffer.paused
            and buffer.full()
            and isinstance(message, StreamDelta)
            and message.finish_reason is None
        ):
            buffer.paused = True
            self._flow(paused=True)

    def end(self, error: BaseException) -> None:
        """End the stream: its reader raises `error` after what it has not read yet."""
        self.buffer.put(_Ended(error))

    async def next(self) -> StreamDelta | RequestMoved:
        """The next message (a branch's waiting deltas as one); raises the stream's error."""
        message = await self.buffer.get_coalesced()
        if isinstance(message, (_Ended, RequestFailed)):
            raise message.error
        if self.buffer.drained():
            self.buffer.paused = False
            self._flow(paused=False)
        return message

    def _flow(self, paused: bool) -> None:
        # Not awaited: the reader must not wait on the worker. Numbered, so that the worker
        # can tell a late pause from the resume sent after it.
        self._flow_seq += 1
        self.channel.worker.handle.set_paused.remote(self.request_id, paused, self._flow_seq)

    def close(self, open_on_worker: bool) -> None:
        """The leg is over for its reader. `open_on_worker` (it left before the leg's end):
        abort it on the worker, once its submit went through; a refused submit left nothing
        there, and an abort by its id could end another replica's request of that id."""
        self.channel.forget(self)
        if not open_on_worker or self.refused:
            return
        admission = self._admission
        if admission is not None and not admission.done():
            admission.add_done_callback(lambda _: self.refused or self._abort())
        else:
            self._abort()

    def _abort(self) -> None:
        # Sent while the channel still reads this incarnation of the worker, whether or not
        # the liveness poll holds it alive: one dropped for a late stats answer (a loaded
        # machine) still runs the request, to its end without this. A channel that ended
        # (the worker died, or restarted) has nothing of this leg left to abort.
        channel = self.channel
        if not channel.serves(channel.worker):
            return
        # Sent outside the request's Ray context: it is often being cancelled right now.
        ref = detached_context().run(channel.worker.handle.abort.remote, self.request_id)
        detached_task(_settled(ref, channel.worker.worker_id))


class WorkerChannel:
    """Owns this router's channel to one worker: the task that reads its batches and hands
    each message to its request's stream, and those streams (request id → `RequestStream`).

    Args:
        worker: the router's state of the worker (its handle, epoch and liveness).
        owner_id: this router's id: the worker keys the channel and the leases by it.
        capacity: each request buffer's `max_buffered_deltas`.
    """

    def __init__(self, worker: WorkerState, owner_id: str, capacity: int) -> None:
        self.worker = worker
        self.owner_id = owner_id
        self.capacity = capacity
        self.epoch = _epoch(worker)
        self.streams: dict[str, RequestStream] = {}
        # Opened by some request, read for all: one request's cancel must not end it.
        self._reader = detached_task(self._read())

    def serves(self, worker: WorkerState) -> bool:
        """Whether a new request can be read from here: its reader runs, on this event loop,
        for the worker's current incarnation."""
        reader = self._reader
        same_loop = reader.get_loop() is asyncio.get_running_loop()
        return same_loop and not reader.done() and self.epoch == _epoch(worker)

    def open(self, request_id: str) -> RequestStream:
        stream = RequestStream(self, request_id, self.capacity)
        self.streams[request_id] = stream
        return stream

    def forget(self, stream: RequestStream) -> None:
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]

    def end_streams(self, error: BaseException) -> None:
        """End every stream read from here with `error` (each one closes itself)."""
        for stream in list(self.streams.values()):
            stream.end(error)

    def close(self, error: BaseException) -> None:
        """Stop reading and end the streams still open here. A channel whose event loop is
        gone is left as it is: its reader and every stream read from it went with it."""
        if self._reader.get_loop() is not asyncio.get_running_loop():
            return
        self._reader.cancel()
        self.end_streams(error)

    async def _read(self) -> None:
        server = await lane_server()
        lane, inbox = server.expect() if server is not None else (None, None)
        call = self.worker.handle.channel.remote(self.owner_id, lane)
        in_order = _InOrder(self.streams)
        lane_reader = detached_task(_read_lane(inbox, in_order)) if inbox is not None else None
        try:
            async for ref in call:
                in_order.put(await ref)
            if inbox is not None and inbox.attached:  # what the worker sent before its end
                with contextlib.suppress(TimeoutError):
                    await within(asyncio.shield(lane_reader), LANE_END_TIMEOUT_S)
            ended: BaseException = WorkerLost(f"worker {self.worker.worker_id} ended its channel")
        except WORKER_LOST_ERRORS as error:
            logger.warning("channel to worker %s lost: %s", self.worker.worker_id, error)
            ended = error
        except asyncio.CancelledError:
            # The worker aborts what this router still has there once the call is closed.
            if isinstance(call, ray.ObjectRefGenerator):  # not a unit test's fake handle
                ray.cancel(call)
            raise
        except Exception as error:  # a channel that failed otherwise: its streams cannot go on
            logger.exception("channel to worker %s failed", self.worker.worker_id)
            ended = WorkerLost(f"worker {self.worker.worker_id}'s channel failed: {error}")
        finally:
            if inbox is not None:
                lane_reader.cancel()
                inbox.close()
                server.forget(lane)
        self.end_streams(ended)


class _InOrder:
    """Hands a channel's batches to their requests' streams in the worker's order: a numbered
    batch (one of a lane's channel: through the lane, or through Ray when it holds object
    references) waits for those before it; an unnumbered one goes at once."""

    def __init__(self, streams: dict[str, RequestStream]) -> None:
        self.streams = streams
        self.next_seq = 1
        self.waiting: dict[int, StepBatch] = {}

    def put(self, batch: StepBatch) -> None:
        if batch.seq == 0:
            self._hand_out(batch)
            return
        self.waiting[batch.seq] = batch
        while (ready := self.waiting.pop(self.next_seq, None)) is not None:
            self._hand_out(ready)
            self.next_seq += 1

    def _hand_out(self, batch: StepBatch) -> None:
        for message in batch.messages:
            stream = self.streams.get(message.request_id)
            if stream is not None:  # None: a leg that ended (an abort's last delta)
                stream.put(message)


async def _read_lane(inbox: LaneInbox, in_order: _InOrder) -> None:
    while (batch := await inbox.batches.get()) is not None:
        in_order.put(batch)


class WorkerChannels:
    """Owns this router's `WorkerChannel` to each worker: opened on first use, and opened anew
    when the one before ended, its worker restarted (a new epoch), or it ran on another event
    loop (a caller may drive a router from one `asyncio.run` after another).

    Args:
        owner_id: this router's id.
        capacity: each request buffer's `max_buffered_deltas`.
    """

    def __init__(self, owner_id: str, capacity: int) -> None:
        self.owner_id = owner_id
        self.capacity = capacity
        self._channels: dict[str, WorkerChannel] = {}

    def open(self, worker: WorkerState, request_id: str) -> RequestStream:
        """A stream for a leg about to be submitted to `worker`, registered on its channel."""
        channel = self._channels.get(worker.worker_id)
        if channel is None or not channel.serves(worker):
            if channel is not None:  # what is left on it belongs to a gone incarnation
                channel.close(WorkerLost(f"worker {worker.worker_id} restarted"))
            channel = WorkerChannel(worker, self.owner_id, self.capacity)
            self._channels[worker.worker_id] = channel
        return channel.open(request_id)

    def worker_hung(self, worker: WorkerState) -> None:
        """The liveness poll judged `worker` hung: end its streams as lost (they replay)."""
        channel = self._channels.get(worker.worker_id)
        if channel is not None and channel.streams:
            state = "stalled" if worker.stalled else "unanswering"
            channel.end_streams(WorkerLost(f"worker {worker.worker_id} {state} mid-stream"))

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close(NoWorkerAvailable("the router closed"))
        self._channels.clear()


async def _settled(ref: object, worker_id: str) -> None:
    """Await an abort sent without waiting for it, so that a dead worker's failure is read
    (not reported by Ray as unhandled): a lost worker has nothing left to abort."""
    try:
        await ref  # type: ignore[misc]
    except WORKER_LOST_ERRORS:
        logger.debug("abort to lost worker %s not delivered", worker_id)
    except Exception:
        logger.exception("abort on worker %s failed", worker_id)


def _epoch(worker: WorkerState) -> str | None:
    return worker.info.epoch if worker.info is not None else None
