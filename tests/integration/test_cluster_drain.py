"""Graceful drain: the router stops sending to a draining worker first; the worker finishes
what fits in its grace period and hands the rest back (the router replays it on a peer), so no
in-flight request is dropped and every output equals the request run alone.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio

from support.cluster import cluster_config, greedy, run_request, start_router

from pagedserve.cluster.worker_group import stop_worker_group


def test_drain_drops_no_in_flight_request(ray_cluster):
    config = cluster_config("t-drain", num_workers=2, enable_push=False, enable_pull=False)
    prompts = [[(11 * i + j) % 200 + 1 for j in range(10)] for i in range(8)]
    lengths = [4, 80] * 4  # short ones finish within the grace period, long ones cannot

    async def main():
        core = await start_router(config)
        alone = [
            (await run_request(core, p, greedy(n)))[0][0]
            for p, n in zip(prompts, lengths, strict=True)
        ]
        tasks = [
            asyncio.create_task(run_request(core, p, greedy(n)))
            for p, n in zip(prompts, lengths, strict=True)
        ]
        victim = next(iter(core.workers))
        while core.workers[victim].inflight < 2:
            await asyncio.sleep(0.01)
        drained = await core.drain_worker(victim, grace_s=0.3)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        after, finals = await run_request(core, prompts[0], greedy(4))
        stats = await core.cluster_stats()
        await core.close()
        return alone, [r[0][0] for r in results], drained, finals, stats, victim

    try:
        alone, outputs, drained, finals, stats, victim = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert outputs == alone  # none dropped, none changed
    assert drained.finished + drained.handed_off >= 2 and drained.handed_off >= 1
    assert stats.router.drain_handoffs == drained.handed_off
    assert stats.router.workers_drained == 1
    assert stats.workers[victim].stats.draining and finals[0].worker_id != victim
