"""A real Worker actor and owner leases: a request whose owner never renews is aborted by the
worker (pool clean), one whose owner renews (via `stats(owner_id)`) lives past the lease; and
before any lease: an owner that dies has its channel closed by Ray, and its requests end at
once; the same through a channel's lane, which carries every batch, numbered."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from pagedserve.cluster.router.lane_server import LaneServer
from pagedserve.workers.deadline import within
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.worker.actor import Worker

LEASE_S = 10.0  # generous: renewals on a loaded machine must never lapse it
DEADLINE_S = 120.0
PARAMS = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(ray_cluster):
    config = EngineConfig(block_size=8, num_kv_blocks=64, attention_backend="torch")
    handle = (
        ray.remote(Worker)
        .options(max_concurrency=64)
        .remote("w0", config, lease_timeout_s=LEASE_S, max_buffered_deltas=4)
    )
    ray.get(handle.ready.remote())
    yield handle
    ray.kill(handle, no_restart=True)


async def read(stream) -> list:
    return [await ref async for ref in stream]


async def wait_for(condition, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not await condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_an_orphan_is_aborted_and_a_renewed_request_lives_on(worker):
    async def renew_like_a_router(stop: asyncio.Event) -> None:
        while not stop.is_set():  # the router's stats poll, much more often than the lease
            await worker.stats.remote("router-alive")
            await asyncio.sleep(LEASE_S / 20)

    async def main():
        stop = asyncio.Event()
        renewing = asyncio.create_task(renew_like_a_router(stop))
        orphan = worker.generate.remote(
            WorkerRequest.fresh("orphan", list(range(20)), PARAMS, owner_id="router-gone")
        )
        kept = worker.generate.remote(
            WorkerRequest.fresh("kept", list(range(30, 50)), PARAMS, owner_id="router-alive")
        )
        # Neither stream is read, so both pause; the orphan's owner never renews.
        await wait_for(lambda: _stat(worker, "lease_expired", 1), "the orphan's lease to expire")
        kept_deltas = await within(read(kept), DEADLINE_S)
        orphan_deltas = await within(read(orphan), DEADLINE_S)
        stop.set()
        await renewing
        return orphan_deltas, kept_deltas, await worker.check_pool.remote()

    orphan, kept, pool = asyncio.run(main())
    assert orphan[-1].finish_reason == "abort"
    assert kept[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in kept) == PARAMS.max_tokens
    assert pool.clean and pool.error is None
    stats = ray.get(worker.stats.remote())
    assert stats.lease_expired == 1 and stats.num_streams == 0


async def _stat(worker, key: str, value) -> bool:
    return getattr(await worker.stats.remote(), key) == value


@ray.remote
class ChannelReader:
    """Stands for a router: submits a request and reads its worker's channel (through a lane
    of its own, with `lane`) until killed."""

    async def read(self, worker, request: WorkerRequest, lane: bool = False) -> None:
        address = inbox = None
        if lane:
            server = LaneServer("127.0.0.1")
            await server.start()
            address, inbox = server.expect()
        channel = worker.channel.remote(request.owner_id, address)
        await worker.submit.remote(request)
        received = []
        while inbox is not None and (batch := await inbox.batches.get()) is not None:
            received.append(batch)
        async for ref in channel:
            received.append(await ref)


@pytest.mark.parametrize("lane", [False, True], ids=["ray-call", "lane"])
def test_a_dead_owner_s_channel_closes_and_its_requests_end_at_once(worker, lane):
    """Through Ray alone, Ray closes the channel call at its next batch; through a lane, the
    router's process takes its end of the lane with it."""
    long = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)  # the whole pool
    owner = f"router-dead-{'lane' if lane else 'ray'}"
    request = WorkerRequest.fresh(owner, list(range(20)), long, owner_id=owner)

    async def main():
        before = await worker.stats.remote()
        reader = ChannelReader.remote()
        reader.read.remote(worker, request, lane)
        await wait_for(lambda: _stat(worker, "num_streams", 1), "the request to stream")
        ray.kill(reader)  # the router dies
        await wait_for(lambda: _stat(worker, "num_streams", 0), "the request to end")
        return before, await worker.stats.remote(), await worker.check_pool.remote()

    before, after, pool = asyncio.run(main())
    assert after.lease_expired == before.lease_expired  # not by the lease: by the channel
    assert after.num_steps - before.num_steps < long.max_tokens  # aborted, not finished
    assert pool.clean and pool.error is None


def test_a_lane_carries_every_batch_numbered_and_its_close_ends_the_channel(worker):
    """`workers/protocol/lane.py`: with a lane, the channel's batches come through it in order
    (1, 2, ...) and none through Ray; the router closing its lane ends the channel call."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    request = WorkerRequest.fresh("laned", list(range(20)), params, owner_id="router-lane")

    async def main():
        server = LaneServer("127.0.0.1")
        await server.start()
        lane, inbox = server.expect()
        channel = worker.channel.remote(request.owner_id, lane)
        through_ray = asyncio.ensure_future(read(channel))
        await worker.submit.remote(request)
        batches = []
        while not any(d.finish_reason for b in batches for d in b.messages):
            batches.append(await within(inbox.batches.get(), DEADLINE_S))
        inbox.close()  # the router is done with this channel
        return batches, await within(through_ray, DEADLINE_S)

    batches, ray_items = asyncio.run(main())
    assert ray_items == []
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    tokens = [t for b in batches for d in b.messages for t in d.token_ids]
    assert len(tokens) == params.max_tokens
    assert ray.get(worker.check_pool.remote()).clean
