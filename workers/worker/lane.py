"""The worker's end of a channel's lane (`workers/protocol/lane.py`): connect to the router,
present the token, send numbered batches until the router closes its end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket

from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.lane import LaneAddress, frame
from pagedserve.workers.protocol.stream import StepBatch

logger = logging.getLogger(__name__)

# The TCP handshake completes in the kernel, however busy the router: a few seconds without
# it means a network that drops the connection (a policy), and the channel goes through Ray.
CONNECT_TIMEOUT_S = 3.0


class LaneSender:
    """The worker's end of a lane: sends numbered batches until the router closes it.

    Args:
        reader: the connection's reading side, watched for the router's close.
        writer: its writing side.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._watch = asyncio.ensure_future(reader.read())  # the router never sends: EOF
        self._watch.add_done_callback(_seen)  # a reset is an end too, not an error to log

    @property
    def open(self) -> bool:
        """False once the router closed its end (or its process ended)."""
        return not self._watch.done() and not self._writer.is_closing()

    async def send(self, batch: StepBatch) -> bool:
        """Send `batch`, waiting while the router is behind. False: the lane is gone, and
        so is the reader of this channel."""
        if not self.open:
            return False
        try:
            self._writer.write(frame(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)))
            await self._writer.drain()
        except ConnectionError:
            return False
        return True

    async def close(self) -> None:
        """Flush what was sent, then close (the router reads it all before the end)."""
        self._watch.cancel()
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


def _seen(watch: asyncio.Future) -> None:
    if not watch.cancelled():
        watch.exception()


async def connect(address: LaneAddress, timeout_s: float = CONNECT_TIMEOUT_S) -> LaneSender | None:
    """A lane to the router at `address`, its token sent; None (logged) if it cannot be
    reached, and the channel then sends through Ray alone."""
    try:
        reader, writer = await within(
            asyncio.open_connection(address.host, address.port), timeout_s
        )
    except (OSError, TimeoutError) as error:
        logger.warning(
            "lane to %s:%d not reachable (%s); the channel goes through Ray",
            address.host,
            address.port,
            error,
        )
        return None
    _keep_alive(writer.get_extra_info("socket"))
    writer.write(frame(address.token))
    return LaneSender(reader, writer)


def _keep_alive(sock: socket.socket | None) -> None:
    """Probe an idle connection after 30 s, every 10 s, 3 times: a router whose node vanished
    (no FIN, no RST) is seen gone within ~a minute, and its channel here ends then."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
