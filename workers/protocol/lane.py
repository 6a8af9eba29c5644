"""A channel's lane: one TCP connection from a worker to a router that carries the channel's
step batches instead of Ray's streaming generator.

Why: at a low load a step carries about one token, and one message through Ray's streaming
generator costs ~1.2 CPU-ms at the router and ~1 at the worker; through one TCP connection,
0.13 and 0.21 (`pagedserve bench ray-hop`; bench/README.md, "What one message costs").

The router listens (`cluster/router/lane_server.py`; the worker's end:
`workers/worker/lane.py`) and hands each `Worker.channel` call a
`LaneAddress` with a token of its own; the worker connects, sends the token, then one frame per
batch. The Ray call stays what the channel's life is: its end is the channel's end, a worker
lost is seen there, and a batch that holds object references (a `RequestMoved`'s KV) still
goes through it, since Ray counts references only in what it carries. Every batch of a lane's
channel is numbered (`StepBatch.seq` from 1) so the router puts both paths back in order. A
worker that cannot connect sends everything through Ray, unnumbered, as before.

Frames: a 4-byte big-endian length, then the bytes. The first frame is the token; the router
unpickles nothing from a connection before it presented a token the router handed out.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

FRAME = struct.Struct("!I")
TOKEN_BYTES = 32
MAX_FRAME_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LaneAddress:
    """Where a worker connects to send one channel's batches, and the token it presents."""

    host: str
    port: int
    token: bytes


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes; None at the end of the stream (or one cut mid-frame)."""
    try:
        (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        if size > MAX_FRAME_BYTES:
            raise ValueError(f"a lane frame of {size} bytes (at most {MAX_FRAME_BYTES})")
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
