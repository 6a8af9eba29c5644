"""The cluster on a multi-node Ray cluster: routing, pull, resync, worker failure; no leaks."""

import asyncio
import random
import time

import pytest
from support.cluster import cluster_config, greedy, run_request, start_router

from pagedserve.cluster.worker_group import stop_worker_group

pytestmark = pytest.mark.usefixtures("ray_cluster")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def shared_router(ray_cluster):
    config = cluster_config("t-shared", num_workers=2, pull_min_blocks=1)
    core = asyncio.run(start_router(config))
    yield core
    stop_worker_group(config)


def run(coro):
    return asyncio.run(coro)


def test_shared_prefix_requests_land_on_the_holder(shared_router):
    core = shared_router
    system = prompt(1, 64)

    async def main():
        _, first = await run_request(core, system + prompt(2, 5), greedy(4))
        holder = first[0].worker_id
        landed = []
        for user in range(4):
            _, final = await run_request(core, system + prompt(10 + user, 7), greedy(4))
            landed.append((final[0].worker_id, final[0].usage.cached_tokens))
        return holder, landed

    holder, landed = run(main())
    assert all(worker == holder for worker, _ in landed)
    assert all(cached >= 64 for _, cached in landed)


def test_pulled_prefix_gives_the_recomputed_output(shared_router):
    core = shared_router
    system = prompt(3, 80)
    suffix = prompt(4, 6)

    async def main():
        tokens_here, final = await run_request(core, system + suffix, greedy(10))
        holder = core.workers[final[0].worker_id]
        other = next(w for w in core.workers.values() if w is not holder)
        # Make the holder look busy so the router picks the other worker and pulls.
        holder.begin(10_000_000)
        try:
            before = core.counters.pulls
            tokens_there, final2 = await run_request(core, system + suffix, greedy(10))
        finally:
            holder.end(10_000_000)
        return tokens_here, tokens_there, final2[0], other.worker_id, before

    here, there, final2, other_id, pulls_before = run(main())
    assert final2.worker_id == other_id
    assert core.counters.pulls == pulls_before + 1
    assert final2.usage.cached_tokens >= 72
    assert there == here


def test_lost_event_batch_is_detected_and_resynced(shared_router):
    core = shared_router

    async def main():
        worker = next(iter(core.workers.values()))
        await worker.handle.chaos_drop_next_event_batch.remote()
        for seed in (20, 21, 22):
            await run_request(core, prompt(seed, 40), greedy(3))
        deadline = time.monotonic() + 10
        while True:
            snapshots = {}
            for w in core.workers.values():
                held = set((await w.handle.kv_snapshot.remote()).block_hashes)
                indexed = await core.index.snapshot_of.remote(w.worker_id)
                snapshots[w.worker_id] = (held, set(indexed))
            if all(held == indexed for held, indexed in snapshots.values()):
                break
            assert time.monotonic() < deadline, "index never agreed with the pools"
            await asyncio.sleep(0.2)
        stats = await core.index.stats.remote()
        dropped = (await worker.handle.stats.remote()).event_batches_dropped
        return stats, dropped

    stats, dropped = run(main())
    assert dropped == 1
    assert stats.gaps_detected + stats.resyncs >= 1
