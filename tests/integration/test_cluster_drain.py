"""Graceful drain: the router stops sending to a draining worker first; the worker finishes
what fits in its grace period and hands the rest back (the router replays it on a peer), so no
in-flight request is dropped and every output equals the request run alone.

No clock decides who finishes: every stream is held unread (its request paused on the worker,
see `max_buffered_deltas`) until the worker is draining; then the ones meant to finish are
read to their end, and the one meant to be handed back stays unread, so it cannot finish
within any grace period.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio

from support.cluster import PIN, cluster_config, greedy, run_request, start_router
from support.wait import until

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.protocol.requests import GenerateRequest

MAX_TOKENS = 40  # more than a held stream's buffers take: it pauses before its end
GRACE_S = 10.0  # ample for a resumed stream's last ~30 tokens; the held one never ends in it


async def read_rest(stream, head) -> list[int]:
    tokens = list(head.token_ids)
    async for delta in stream:
        tokens.extend(delta.token_ids)
    return tokens


def test_drain_drops_no_in_flight_request(ray_cluster):
    config = cluster_config(
        "t-drain", num_workers=2, enable_push=False, enable_pull=False, max_buffered_deltas=4
    )
    prompts = [[(11 * i + j) % 200 + 1 for j in range(10)] for i in range(3)]

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(MAX_TOKENS)))[0][0] for p in prompts]
        victim, peer = core.workers.values()
        peer.begin(PIN)  # every stream starts on the victim
        streams, heads = [], []
        for i, p in enumerate(prompts):
            request = GenerateRequest(greedy(MAX_TOKENS), prompt_token_ids=p, request_id=f"d{i}")
            streams.append(core.generate(request))
            heads.append(await anext(streams[-1]))  # streaming on the victim; then unread
        peer.end(PIN)

        async def all_paused() -> bool:
            return (await victim.handle.stats.remote()).num_paused == len(prompts)

        await until(all_paused, "every unread stream to pause")
        drain = asyncio.create_task(core.drain_worker(victim.worker_id, grace_s=GRACE_S))

        async def draining() -> bool:
            return (await victim.handle.stats.remote()).draining

        await until(draining, "the victim to drain")
        # Two are read to their end within the grace period; the third stays unread.
        finished = await asyncio.gather(*(read_rest(streams[i], heads[i]) for i in range(2)))
        drained = await drain
        handed_back = await read_rest(streams[2], heads[2])  # replayed on the peer
        after, finals = await run_request(core, prompts[0], greedy(4))
        stats = await core.cluster_stats()
        await core.close()
        return alone, [*finished, handed_back], drained, finals, stats, victim.worker_id

    try:
        alone, outputs, drained, finals, stats, victim = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert outputs == alone  # none dropped, none changed
    assert (drained.finished, drained.handed_off) == (2, 1)
    assert stats.router.drain_handoffs == 1 and stats.router.replays == 1
    assert stats.router.workers_drained == 1
    assert stats.workers[victim].stats.draining and finals[0].worker_id != victim
