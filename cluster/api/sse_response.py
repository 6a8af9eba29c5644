"""Server-sent events that stop being produced while nobody reads them.

A streamed HTTP response travels through Serve's proxy: our event generator → Serve's replica
queue of the response's messages → the proxy (Ray generator backpressure: `grpc_streams`) →
uvicorn's write buffer (64 KiB; past it uvicorn waits for the socket to drain) → the proxy's
socket → the client. Served by the Router replica itself (`api.direct_ingress`, what
`pagedserve serve` does), the generator writes to uvicorn's write buffer in the replica, with no
queue or Ray hop between. Two of these hops have no useful bound of their own:

- Serve's replica queue has none: an unread stream would be generated to its end into the
  replica's memory, holding its worker's compute and blocks meanwhile. `PacedStreamingResponse`
  waits, before each message, until that queue holds fewer than `max_queued`
  (`ray_internals.room_in_http_response`).
- The kernel grows a socket's send buffer up to `net.ipv4.tcp_wmem`'s maximum (4 MiB by
  default): ~20,000 events of a token each, and uvicorn's write buffer holds 64 KiB more.
  `limit_send_buffers` (run in the process whose uvicorn serves HTTP) fixes both of each HTTP
  connection at `SEND_BUFFER_BYTES`: plenty for token streams, while a large non-streamed body
  goes out at about twice that per round trip (1.6 MB/s at 20 ms: a 640 KB answer of 64
  choices, 0.4 s).

Then the event generator is not pulled, the router's buffer of the request fills, and the
router pauses the request on its worker as for an unread gRPC stream
(`cluster/router/worker_channel.py`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from pagedserve.workers.ray_internals import room_in_http_response

# Messages of one response Serve's replica may hold before the proxy takes them (each is one
# event: a chunk of a token or a few).
MAX_QUEUED_MESSAGES = 16
# Each HTTP connection's socket send buffer in the proxy (the kernel doubles what is set), and
# uvicorn's write buffer of it (the transport's high-water mark).
SEND_BUFFER_BYTES = 16 * 1024
SEND_BUFFER_ENV = "PAGEDSERVE_HTTP_SEND_BUFFER_BYTES"


class PacedStreamingResponse(StreamingResponse):
    """A `text/event-stream` response whose events wait for room in the replica's queue."""

    def __init__(self, events: AsyncIterable[str], max_queued: int = MAX_QUEUED_MESSAGES) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.max_queued = max_queued

    async def stream_response(self, send: Send) -> None:
        async def paced(message: Message) -> None:
            await room_in_http_response(self.max_queued)
            await send(message)

        try:
            await super().stream_response(paced)
        finally:
            # A client gone mid-stream cancels this (Starlette's task group) while the events
            # wait at a `yield`; Starlette leaves them to the garbage collector, which closes
            # them (and aborts the request on its worker) whenever a collection finds them.
            # Closed here, shielded from that cancellation, the abort goes out now.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def limit_send_buffers() -> None:
    """Make every HTTP connection uvicorn accepts in this process (the proxy, or a Router
    replica serving HTTP itself) from now on keep a fixed socket send buffer and write
    buffer: `SEND_BUFFER_ENV` bytes, else `SEND_BUFFER_BYTES` (0: the kernel's own, growing,
    and uvicorn's 64 KiB). Idempotent."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    size = int(os.environ.get(SEND_BUFFER_ENV, SEND_BUFFER_BYTES))
    for protocol in (h11_impl.H11Protocol, httptools_impl.HttpToolsProtocol):
        if size > 0 and not getattr(protocol, "_pagedserve_send_buffer", False):
            protocol.connection_made = _with_send_buffer(protocol.connection_made, size)
            protocol._pagedserve_send_buffer = True


def _with_send_buffer(connection_made: Any, size: int) -> Any:
    def with_send_buffer(self: Any, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        transport.set_write_buffer_limits(high=size)
        connection_made(self, transport)

    return with_send_buffer
