"""A channel's lane over real sockets on this machine: the router's server and inbox, the
worker's sender (`workers/protocol/lane.py`)."""

from __future__ import annotations

import asyncio
import dataclasses

from pagedserve.cluster.router.lane_server import LaneServer
from pagedserve.workers.protocol import lane as lane_protocol
from pagedserve.workers.protocol.lane import LaneAddress, frame
from pagedserve.workers.protocol.stream import StepBatch, StreamDelta
from pagedserve.workers.worker.lane import connect


def batch(seq: int, token: int = 5) -> StepBatch:
    delta = StreamDelta(request_id="r1", index=0, token_ids=[token], text="x")
    return StepBatch("w0", (delta,), seq=seq)


async def started() -> LaneServer:
    server = LaneServer("127.0.0.1")
    await server.start()
    return server


async def drained(queue: asyncio.Queue) -> list:
    got = []
    while (item := await asyncio.wait_for(queue.get(), 10)) is not None:
        got.append(item)
    return got


def test_a_worker_s_batches_arrive_in_order_and_the_lane_ends_with_its_close():
    async def scenario():
        server = await started()
        address, inbox = server.expect()
        sender = await connect(address)
        assert sender is not None
        sent = [batch(seq) for seq in range(1, 6)]
        for b in sent:
            assert await sender.send(b)
        await sender.close()
        assert await drained(inbox.batches) == sent
        assert inbox.attached

    asyncio.run(scenario())


def test_a_connection_without_an_expected_token_is_closed_unread():
    async def scenario():
        server = await started()
        address, inbox = server.expect()
        wrong = dataclasses.replace(address, token=b"\0" * len(address.token))
        intruder = await connect(wrong)
        assert intruder is not None
        await intruder.send(batch(1))
        await asyncio.wait_for(intruder._watch, 10)  # the server closed it
        assert not intruder.open
        assert not await intruder.send(batch(2))
        assert not inbox.attached and inbox.batches.empty()
        # The right token still works once; a lane is handed out to one connection.
        assert (sender := await connect(address)) is not None
        await sender.send(batch(1))
        await sender.close()
        assert await drained(inbox.batches) == [batch(1)]
        again = await connect(address)
        await asyncio.wait_for(again._watch, 10)
        assert not again.open

    asyncio.run(scenario())


def test_the_sender_sees_the_router_close_its_end():
    async def scenario():
        server = await started()
        address, inbox = server.expect()
        sender = await connect(address)
        assert await sender.send(batch(1))
        assert await asyncio.wait_for(inbox.batches.get(), 10) == batch(1)
        inbox.close()  # the router's channel ended
        await asyncio.wait_for(sender._watch, 10)
        assert not sender.open
        assert not await sender.send(batch(2))

    asyncio.run(scenario())


def test_an_oversized_frame_ends_the_lane_unread(monkeypatch):
    monkeypatch.setattr(lane_protocol, "MAX_FRAME_BYTES", 64)  # a token (32 bytes) passes

    async def scenario():
        server = await started()
        address, inbox = server.expect()
        _, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(frame(address.token) + frame(b"y" * 100))
        await writer.drain()
        assert await drained(inbox.batches) == []
        writer.close()

    asyncio.run(scenario())


def test_an_unreachable_lane_is_none_and_the_channel_goes_through_ray():
    async def scenario():
        server = await started()
        port = server.port
        server._server.close()
        await server._server.wait_closed()
        return await connect(LaneAddress("127.0.0.1", port, b"t" * 32), timeout_s=5)

    assert asyncio.run(scenario()) is None
