"""The cluster on a multi-node Ray cluster: prefix-aware routing, and the index resyncing after
a lost event batch (pull, push and move: test_cluster_migration.py; failures: their own
modules)."""

import asyncio
import random

import pytest
from support.cluster import (
    PIN,
    assert_cluster_clean,
    cluster_config,
    greedy,
    run_request,
    start_router,
    until_view_mirrors,
    view_mirrors,
)
from support.wait import until

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.process.cpu_placement import available_cpus

pytestmark = pytest.mark.usefixtures("ray_cluster")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def shared_router(ray_cluster):
    config = cluster_config("t-shared", num_workers=2)
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
        await until_view_mirrors(core, holder)  # what routing matches against knows it
        landed = []
        for user in range(4):
            _, final = await run_request(core, system + prompt(10 + user, 7), greedy(4))
            landed.append((final[0].worker_id, final[0].usage.cached_tokens))
        return holder, landed

    holder, landed = run(main())
    assert all(worker == holder for worker, _ in landed)
    assert all(cached >= 64 for _, cached in landed)


def test_lost_event_batch_is_detected_and_resynced(shared_router):
    """One batch of KV events lost on the way to the index: the next batch shows the gap, the
    index resyncs from the worker's snapshot (once), and it agrees with the pool again."""
    core = shared_router
    worker, other = core.workers.values()

    async def main():
        other.begin(PIN)  # every request lands on `worker`
        try:
            # The index must know `worker` already (a first publish always resyncs), so that
            # what follows is the lost batch's doing alone.
            await run_request(core, prompt(19, 40), greedy(3))
            await until(lambda: index_agrees(core, worker), "the index to mirror the pool")
            await until(lambda: view_mirrors(core, worker.worker_id), "the view to follow")
            before = await core.index.stats.remote()
            dropped_before = (await worker.handle.stats.remote()).event_batches_dropped
            await worker.handle.chaos_drop_next_event_batch.remote()
            for seed in (20, 21, 22):  # new prefixes: batches after the lost one
                _, final = await run_request(core, prompt(seed, 40), greedy(3))
                assert final[0].worker_id == worker.worker_id
            await until(lambda: index_agrees(core, worker), "the index to resync")
            await until_view_mirrors(core, worker.worker_id)  # and the router's view with it
        finally:
            other.end(PIN)
        after = await core.index.stats.remote()
        dropped = (await worker.handle.stats.remote()).event_batches_dropped - dropped_before
        return before, after, dropped

    before, after, dropped = run(main())
    assert dropped == 1
    assert after.gaps_detected == before.gaps_detected + 1  # the next batch showed the gap
    assert after.resyncs == before.resyncs + 1  # and one snapshot closed it
    assert after.stale_workers == () and after.snapshot_failures == before.snapshot_failures


async def index_agrees(core, worker) -> bool:
    """Whether the index holds exactly the worker's cached blocks (and it holds some)."""
    cached = set((await worker.handle.kv_snapshot.remote()).block_hashes)
    indexed = await core.index.snapshot_of.remote(worker.worker_id)
    return bool(cached) and indexed == cached


def worker_infos(config) -> list:
    """Start the cluster, read each worker's `WorkerInfo` as the router registered it, stop."""

    async def main():
        core = await start_router(config)
        infos = [w.info for w in core.workers.values()]
        await core.close()
        return infos

    try:
        return run(main())
    finally:
        stop_worker_group(config)


def test_worker_threads_set_each_engine_s_torch_threads():
    """`worker_threads` overrides Ray's one-thread-per-reserved-CPU default for the engine."""
    config = cluster_config("t-threads", num_workers=1, worker_threads=2)

    infos = worker_infos(config)
    assert [info.num_threads for info in infos] == [2]


def test_a_worker_sharing_the_cores_runs_on_every_core_while_alone_with_work():
    """`worker_share_cores`: before each step the worker takes its share of its machine's
    cores (each Ray node of this test cluster has a board of its own: one worker on it)."""
    config = cluster_config("t-share", num_workers=1, worker_share_cores=True)

    async def main():
        core = await start_router(config)
        (worker,) = core.workers.values()
        await run_request(core, prompt(3, 20), greedy(4))
        info = await worker.handle.describe.remote()
        await assert_cluster_clean(core)
        await core.close()
        return info

    try:
        info = run(main())
    finally:
        stop_worker_group(config)
    assert info.num_threads == len(available_cpus())


def test_worker_cpus_pin_each_worker_to_its_share_with_a_thread_per_core():
    """`worker_cpus` is split between the workers; each pins its process there and, without
    `worker_threads`, runs one torch thread per core of its share."""
    last = max(available_cpus())
    config = cluster_config("t-pinned", num_workers=1, worker_cpus=str(last))

    infos = worker_infos(config)
    assert [(info.cpus, info.num_threads) for info in infos] == [((last,), 1)]
    assert infos[0].pid > 0
