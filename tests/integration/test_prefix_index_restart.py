"""A prefix index killed and restarted by Ray resyncs from every live worker at once: with no
request sent, its entries come back equal to the workers' cached blocks, the router's prefix
view resets from the new feed epoch to the same, and routing finds cached prefixes again.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import random
import time

import ray
from support.cluster import cluster_config, greedy, run_request, start_router, view_mirrors

from pagedserve.cluster.pool.group import stop_worker_group

DEADLINE_S = 60.0


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


async def index_agrees(core) -> bool:
    """Whether the index holds exactly each worker's cached blocks (and some at all)."""
    agree = []
    for worker_id, worker in core.workers.items():
        snapshot = await worker.handle.kv_snapshot.remote()
        indexed = await core.index.snapshot_of.remote(worker_id)
        agree.append(bool(snapshot.block_hashes) and indexed == set(snapshot.block_hashes))
    return all(agree)


def test_a_restarted_index_resyncs_from_every_worker_without_new_requests(ray_cluster):
    config = cluster_config("t-index-restart", num_workers=2)
    prompts = [prompt(seed, 40) for seed in range(6)]

    async def main():
        core = await start_router(config)
        await asyncio.gather(*(run_request(core, p, greedy(4)) for p in prompts))
        # Both workers must hold something, or the check below proves little.
        for worker in core.workers.values():
            if not (await worker.handle.kv_snapshot.remote()).block_hashes:
                await run_request(core, prompts[0], greedy(4), cache_salt=worker.worker_id)
        await wait_for(lambda: index_agrees(core), "the index to mirror the pools")
        before = await core.index.stats.remote()
        epoch, resets = core.view.epoch, core.view.resets
        ray.kill(core.index, no_restart=False)
        # No request from here on: only the restarted index's own resync can refill it.
        await wait_for(lambda: index_agrees(core), "the restarted index to resync")
        await wait_for(lambda: view_reset(core, epoch), "the router's view to reset and follow")
        assert core.view.resets > resets
        after = await core.index.stats.remote()
        # Every worker's entries came back from a snapshot (no request was sent). Most come
        # from the restart's own resync; a worker whose publish was in flight when the index
        # died registers again meanwhile, and then its resync may come by that path instead.
        assert after.startup_resyncs >= 1 and after.resyncs >= 2
        assert after.entries == before.entries and after.snapshot_failures == 0
        hits = core.counters.prefix_hits
        await run_request(core, prompts[0], greedy(4))
        assert core.counters.prefix_hits == hits + 1
        await core.close()

    try:
        asyncio.run(main())
    finally:
        stop_worker_group(config)


async def view_reset(core, old_epoch: str | None) -> bool:
    """Whether the view follows a new feed epoch and mirrors every worker's pool again."""
    return core.view.epoch not in (None, old_epoch) and await view_mirrors(core)


async def wait_for(condition, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while True:
        try:
            if await condition():
                return
        except ray.exceptions.RayActorError:  # the index is restarting
            pass
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
