"""Backpressure: full queues refuse at once with `Overloaded` (a retry hint), never hang, and
the requests admitted still finish as they would alone; nothing leaks.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import dataclasses

from support.cluster import cluster_config, greedy, run_request, start_router
from support.wait import until

from pagedserve.cluster.api.errors import as_api_error
from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.errors import Overloaded
from pagedserve.workers.protocol.requests import GenerateRequest

HOLD_TOKENS = 1000  # 1000 steps: the holder is aborted as soon as the burst is answered


async def outcome(core, token_ids, params):
    try:
        tokens, _ = await run_request(core, token_ids, params)
    except Overloaded as error:
        return error
    return tokens[0]


async def hold(core, token_ids, first_token: asyncio.Event) -> str:
    """Stream a request that only ends when aborted; set `first_token` once it runs."""
    request = GenerateRequest(
        params=greedy(HOLD_TOKENS), prompt_token_ids=token_ids, request_id="holder"
    )
    async for delta in core.generate(request):
        first_token.set()
        if delta.finish_reason is not None:
            return delta.finish_reason
    raise AssertionError("the holder's stream ended without a finish reason")


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
    holder_prompt, burst_prompts = prompts[0], prompts[1:]

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(20)))[0][0] for p in burst_prompts]
        # The holder takes the worker's one slot until it is aborted, so the burst meets
        # queues exactly this full however fast the machine is.
        running = asyncio.Event()
        holder = asyncio.create_task(hold(core, holder_prompt, running))
        await within(running.wait(), 120)
        burst = [asyncio.create_task(outcome(core, p, greedy(20))) for p in burst_prompts]
        (worker,) = core.workers.values()

        async def answered() -> bool:  # each refused at once, or queued behind the holder
            queued = (await worker.handle.stats.remote()).num_waiting
            return sum(task.done() for task in burst) + queued == len(burst)

        await until(answered, "every request of the burst to be refused or queued")
        assert not holder.done(), "the holder ended before the burst was answered"
        await core.abort("holder")
        results = await within(asyncio.gather(*burst), 120)
        holder_end = await holder
        stats = await core.cluster_stats()
        await core.close()
        return alone, results, holder_end, stats

    try:
        alone, results, holder_end, stats = asyncio.run(main())
    finally:
        stop_worker_group(config)
    refused = [r for r in results if isinstance(r, Exception)]
    # The holder plus 9 at once: the router streams 6 at most (refuses 4); of the 5 it admits
    # the worker queues 2 behind the holder and refuses 3.
    assert stats.router.refused_router == 4 and stats.router.refused_worker == 3
    assert len(refused) == 7 and holder_end == "abort"
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
