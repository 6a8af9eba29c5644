"""The streams a worker holds open: one per admitted request, until its last branch ends.

`StreamTable` is `WorkerCore`'s one registry of them (request id → `OpenStream`), whichever way
a request's messages leave the worker:

- through its owner's channel (`WorkerCore.submit`, read by `WorkerCore.channel`): the
  router's path. A step's messages of all of one owner's requests go out as one `StepBatch`;
  the router buffers each request and asks for a pause (`WorkerCore.set_paused`) when its
  reader falls behind.
- through its own bounded buffer (`WorkerCore.generate` / `adopt`): one stream per request,
  for callers without a channel (benchmarks, tests). The worker pauses the request itself
  when the buffer fills.

A stream is closed in one place, `StreamTable.close` (its lease detached, its trace ended):
a channel's once the message that ends its last branch is handed to the channel (finished,
aborted, failed, moved); one with its own reader once that reader took its last message or
left (until then its buffer holds what `WorkerCore.buffered_deltas` counts, and a drain waits
for it); any when a drain cuts it off or (a channel's) when its owner's channel closes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pagedserve.workers.engine.outputs import RequestDelta
from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.stream import RequestFailed, StreamMessage
from pagedserve.workers.telemetry.request_trace import RequestTrace, RequestTraces
from pagedserve.workers.worker.lease import LeaseTable
from pagedserve.workers.worker.stream import DeltaBuffer, OwnerChannel, ends_branch, stream_deltas


@dataclass(eq=False)
class OpenStream:
    """One admitted request on this worker until its last branch ends: where its messages go
    (`buffer`, read by its own caller; or `channel`, its owner's), how many of its branches
    are still open, its trace, and the number of the last pause or resume its router sent
    (`flow_seq`: a late, older one is ignored)."""

    request_id: str
    owner_id: str | None
    remaining: int
    trace: RequestTrace
    buffer: DeltaBuffer | None = None
    channel: OwnerChannel | None = None
    flow_seq: int = 0

    def put(self, message: StreamMessage) -> None:
        if self.buffer is not None:
            self.buffer.put(message)
        else:
            self.channel.put(message)
        if ends_branch(message):
            self.remaining -= 1


class StreamTable:
    """Owns a worker's open streams (request id → `OpenStream`) and its owners' channels
    (owner id → `OwnerChannel`); ties each stream to its owner's lease while it is open.

    Args:
        worker_id: this worker (named in every message).
        leases: the worker's owner leases (a stream is attached once admitted).
        traces: the worker's request traces (a stream's ends when it closes).
    """

    def __init__(self, worker_id: str, leases: LeaseTable, traces: RequestTraces) -> None:
        self.worker_id = worker_id
        self.leases = leases
        self.traces = traces
        self._streams: dict[str, OpenStream] = {}
        self._channels: dict[str, OwnerChannel] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __iter__(self) -> Iterator[str]:
        return iter(self._streams)

    def get(self, request_id: str) -> OpenStream | None:
        return self._streams.get(request_id)

    # ---------------------------------------------------------------- streams
    def open(
        self,
        request_id: str,
        owner_id: str | None,
        num_branches: int,
        trace: RequestTrace,
        buffer: DeltaBuffer | None = None,
    ) -> OpenStream:
        """Register a request about to be admitted; its messages go to `buffer`, or (None) to
        its owner's channel. Raises `RequestRejected` for an id already in flight."""
        if request_id in self._streams:
            # Typed (INVALID_ARGUMENT at the front ends, not INTERNAL): two router replicas
            # can each admit a request under one id, and the second must be refused by name.
            raise RequestRejected(f"request_id {request_id!r} is already in flight")
        channel = None
        if buffer is None:
            if owner_id is None:
                raise RequestRejected("a request streamed through a channel needs its owner_id")
            channel = self.channel(owner_id)
        stream = OpenStream(request_id, owner_id, num_branches, trace, buffer, channel)
        self._streams[request_id] = stream
        return stream

    def admitted(self, stream: OpenStream) -> None:
        """The engine took the request: its owner's lease keeps it alive from now on."""
        self.leases.attach(stream.request_id, stream.owner_id)

    def deliver(self, delta: RequestDelta, error: str | None = None) -> OpenStream | None:
        """Hand an engine delta to its stream, one message per branch it touched (`error` on
        each branch's last); close a channel's stream once its last branch ended. Returns the
        stream (None: nobody streams that request any more)."""
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return None
        for message in stream_deltas(delta, error):
            stream.put(message)
            stream.trace.on_delta(message)
        if not stream.remaining and stream.channel is not None:
            self.close(stream, aborted=False)
        return stream

    def close(self, stream: OpenStream, aborted: bool) -> bool:
        """Forget a stream (its lease and trace with it). False if it was closed already."""
        if self._streams.get(stream.request_id) is not stream:
            return False
        del self._streams[stream.request_id]
        self.leases.detach(stream.request_id)
        self.traces.close(stream.trace, aborted)
        return True

    def cut_off(self, error: Callable[[], RequestRejected]) -> list[str]:
        """End every open stream with `RequestFailed(error())` (a drain's grace ran out) and
        close it. Returns their request ids, which the engine must abort."""
        ended = list(self._streams.values())
        for stream in ended:
            stream.put(RequestFailed(stream.request_id, error()))
            self.close(stream, aborted=True)
        return [stream.request_id for stream in ended]

    # --------------------------------------------------------------- channels
    def channel(self, owner_id: str) -> OwnerChannel:
        """The owner's channel, made on first use (by its reader, or by a submit that came
        first: its messages wait for the reader)."""
        channel = self._channels.get(owner_id)
        if channel is None:
            channel = self._channels[owner_id] = OwnerChannel(owner_id, self.worker_id)
        return channel

    def close_channel(self, channel: OwnerChannel) -> list[str]:
        """The owner stopped reading (its router died, or closed the call): close every stream
        of that channel and forget the channel. Returns the request ids the engine must
        abort."""
        if self._channels.get(channel.owner_id) is channel:
            del self._channels[channel.owner_id]
        orphans = [s for s in self._streams.values() if s.channel is channel]
        for stream in orphans:
            self.close(stream, aborted=True)
        return [stream.request_id for stream in orphans]

    def beat(self) -> None:
        """A heartbeat round over the channels (`OwnerChannel.beat`); a channel with neither a
        reader nor a stream (a submit's, refused or aborted before its reader came) goes."""
        in_use = {id(s.channel) for s in self._streams.values() if s.channel is not None}
        for owner_id, channel in list(self._channels.items()):
            if not channel.has_reader and id(channel) not in in_use:
                del self._channels[owner_id]
            else:
                channel.beat()
