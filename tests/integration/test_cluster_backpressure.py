"""Backpressure: full queues refuse at once with `Overloaded` (a retry hint), never hang, and
the requests admitted still finish as they would alone; nothing leaks.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import dataclasses

from support.cluster import cluster_config, greedy, run_request, start_router

from pagedserve.cluster.api_errors import as_api_error
from pagedserve.cluster.worker_group import stop_worker_group
from pagedserve.workers.errors import Overloaded


async def outcome(core, token_ids, params):
    try:
        tokens, _ = await run_request(core, token_ids, params)
    except Overloaded as error:
        return error
    return tokens[0]


def test_full_queues_refuse_at_once_and_admitted_requests_finish(ray_cluster):
    config = cluster_config(
        "t-backpressure",
        num_workers=1,
        engine={"max_num_seqs": 1},
        max_waiting_per_worker=2,
        max_inflight=6,
        retry_after_s=0.5,
        enable_push=False,
    )
    prompts = [[(7 * i + j) % 200 + 1 for j in range(12)] for i in range(10)]

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(20)))[0][0] for p in prompts]
        results = await asyncio.wait_for(
            asyncio.gather(*(outcome(core, p, greedy(20)) for p in prompts)), 120
        )
        stats = await core.cluster_stats()
        await core.close()
        return alone, results, stats

    try:
        alone, results, stats = asyncio.run(main())
    finally:
        stop_worker_group(config)
    refused = [r for r in results if isinstance(r, Exception)]
    router_refusals = stats.router.refused_router
    worker_refusals = stats.router.refused_worker
    # 10 at once, the router streams 6 at most; the worker runs 1 and queues 2 of the 6.
    assert router_refusals == 4 and worker_refusals == 3 and len(refused) == 7
    for error in refused:
        api_error = as_api_error(error)
        assert api_error.http_status == 429 and api_error.retry_after_header() is not None
    for result, reference in zip(results, alone, strict=True):
        assert isinstance(result, Exception) or result == reference
    assert dataclasses.asdict(stats.limits) == {
        "max_waiting_per_worker": 2,
        "max_inflight": 6,
        "retry_after_s": 0.5,
    }
