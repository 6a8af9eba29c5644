"""The router's end of its channels' lanes (`workers/protocol/lane.py`): one listening socket
per event loop of the router's process, and per channel an inbox its worker's connection fills.

    WorkerChannel._read ─► LaneServer.expect ─► (LaneAddress, LaneInbox) ─► Worker.channel(lane)
    worker connects, sends the token ─► LaneServer._accept ─► LaneInbox.attach ─► batches

A connection whose first frame is not a token this server handed out (and still expects) is
closed unread. The socket listens on the router's node address, as Ray's own do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import secrets
import weakref

from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.lane import TOKEN_BYTES, LaneAddress, read_frame
from pagedserve.workers.protocol.stream import StepBatch

logger = logging.getLogger(__name__)

TOKEN_TIMEOUT_S = 10.0


class LaneInbox:
    """One channel's lane at the router: the batches its worker sent, in the order sent,
    then None once the connection ended. A lane its worker never connected stays empty; the
    channel's end closes it either way (`close`)."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue[StepBatch | None] = asyncio.Queue()
        self._reading: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None

    @property
    def attached(self) -> bool:
        """Whether its worker connected."""
        return self._writer is not None

    def attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._reading = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (payload := await read_frame(reader)) is not None:
                self.batches.put_nowait(pickle.loads(payload))
        except Exception:  # a frame that is no batch: the lane ends, Ray's call goes on
            logger.exception("lane frame unreadable; the channel's lane ends")
        finally:
            self.batches.put_nowait(None)

    def close(self) -> None:
        """Stop reading and close the connection: its worker sees the channel's reader gone."""
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.close()


class LaneServer:
    """Owns one event loop's listening socket and the lanes it still expects (token → inbox).

    Args:
        host: the address to listen on and to hand to workers.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self._expected: dict[bytes, LaneInbox] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def expect(self) -> tuple[LaneAddress, LaneInbox]:
        """A new lane: the address its worker connects to, and its inbox."""
        token = secrets.token_bytes(TOKEN_BYTES)
        inbox = LaneInbox()
        self._expected[token] = inbox
        return LaneAddress(self.host, self.port, token), inbox

    def forget(self, address: LaneAddress) -> None:
        """A lane no longer expected (its channel ended before its worker connected)."""
        self._expected.pop(address.token, None)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        token = None
        with contextlib.suppress(TimeoutError):
            token = await within(read_frame(reader), TOKEN_TIMEOUT_S)
        inbox = self._expected.pop(token, None) if token is not None else None
        if inbox is None:
            writer.close()
            return
        inbox.attach(reader, writer)


# Each event loop's server, as the future of its start (`LaneServer | None`).
_servers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future] = (
    weakref.WeakKeyDictionary()
)


async def lane_server() -> LaneServer | None:
    """This event loop's lane server, started on first use; None (logged once per loop) if
    it cannot listen, and channels then go through Ray alone."""
    loop = asyncio.get_running_loop()
    starting = _servers.get(loop)
    if starting is None:
        starting = _servers[loop] = asyncio.ensure_future(_start(_node_address()))
    return await asyncio.shield(starting)


async def _start(host: str) -> LaneServer | None:
    server = LaneServer(host)
    try:
        await server.start()
    except OSError as error:
        logger.warning("cannot listen for channel lanes (%s); channels go through Ray", error)
        return None
    return server


def _node_address() -> str:
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"
