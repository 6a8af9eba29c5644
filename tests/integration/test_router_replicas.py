"""Two router replicas over one worker group: each routes on its own prefix view, fed by the
index's change feed, and either can abort a request the other streams.

Own module, with its own worker group: the views of both routers are checked against the
pools by the leak check after every test.
"""

import asyncio
import random

import pytest
import ray
from support.cluster import (
    PIN,
    cluster_config,
    greedy,
    run_request,
    start_router,
    until_view_mirrors,
    view_mirrors,
)
from support.wait import until

from pagedserve.cluster.router_types import GenerateRequest
from pagedserve.cluster.worker_group import stop_worker_group

pytestmark = pytest.mark.usefixtures("ray_cluster")
LONG = 1_000  # decode steps (within the test model's context): it only ends when aborted


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def replicas(ray_cluster):
    config = cluster_config("t-replicas", num_workers=2)

    async def both():
        return await start_router(config), await start_router(config)

    yield asyncio.run(both())
    stop_worker_group(config)


def test_a_request_streamed_by_one_router_is_aborted_through_the_other(replicas):
    a, b = replicas

    async def main():
        request = GenerateRequest(
            params=greedy(LONG), prompt_token_ids=prompt(1, 20), request_id="r1", tenant="acme"
        )
        first_token = asyncio.Event()
        finish = []

        async def stream():
            async for delta in a.generate(request):
                first_token.set()
                if delta.finish_reason is not None:
                    finish.append(delta.finish_reason)

        streaming = asyncio.ensure_future(stream())
        started = asyncio.ensure_future(first_token.wait())
        await asyncio.wait((streaming, started), return_when=asyncio.FIRST_COMPLETED)
        if streaming.done():
            streaming.result()  # it failed before its first token: say why
        assert "acme:r1" not in b.inflight().request_ids
        other_tenant = await b.abort("r1", tenant="other")  # the scoped id differs: no-op
        aborted = await b.abort("r1", tenant="acme")
        await streaming
        return other_tenant, aborted, finish

    other_tenant, aborted, finish = asyncio.run(main())
    assert not other_tenant and aborted and finish == ["abort"]


def test_after_a_lost_event_batch_both_views_equal_the_pools(replicas):
    a, b = replicas
    worker, other = a.workers.values()

    async def main():
        other.begin(PIN)  # every request through `a` lands on `worker`
        try:
            await run_request(a, prompt(2, 40), greedy(3))
            await until(lambda: view_mirrors(a, worker.worker_id), "a's view to follow")
            gaps = (await a.index.stats.remote()).gaps_detected
            await worker.handle.chaos_drop_next_event_batch.remote()
            for seed in (3, 4, 5):  # new prefixes: batches after the lost one
                await run_request(a, prompt(seed, 40), greedy(3))
        finally:
            other.end(PIN)
        for core in (a, b):
            await until_view_mirrors(core, worker.worker_id)
        return gaps, (await a.index.stats.remote()).gaps_detected

    gaps_before, gaps_after = asyncio.run(main())
    assert gaps_after == gaps_before + 1  # the lost batch really was a gap the index resynced


def test_a_router_started_after_the_index_has_entries_gets_them_from_the_dump(replicas):
    a, _ = replicas
    system = prompt(6, 48)

    async def main():
        _, first = await run_request(a, system + [1, 2], greedy(2))
        holder = first[0].worker_id
        await until_view_mirrors(a, holder)
        late = await start_router(a.config)  # syncs its view from the feed's dump in `start`
        try:
            synced = {w: late.view.hashes_of(w) for w in late.workers}
            indexed = {w: await a.index.snapshot_of.remote(w) for w in late.workers}
            resets, applied = late.view.resets, late.view.entries_applied
            hits = late.counters.prefix_hits
            _, final = await run_request(late, system + [3, 4], greedy(2))
            return synced, indexed, resets, applied, late.counters.prefix_hits - hits, final
        finally:
            await late.close()

    synced, indexed, resets, applied, hits, final = asyncio.run(main())
    assert synced == indexed and any(synced.values())
    assert (resets, applied) == (1, 0)  # all of it from the dump, before any request
    assert hits == 1 and final[0].usage.cached_tokens >= 48


def test_a_restarted_index_resets_both_views(replicas):
    a, b = replicas

    async def main():
        await b.start()  # this event loop follows the feed for `b` too
        await run_request(a, prompt(7, 40), greedy(2))
        await until_view_mirrors(a)
        epochs = (a.view.epoch, b.view.epoch)
        resets = (a.view.resets, b.view.resets)
        ray.kill(a.index, no_restart=False)
        for core in (a, b):  # a new feed epoch: each view resets from the new index's dump
            await until(lambda core=core: core.view.epoch not in (None, *epochs), "a reset")
            await until_view_mirrors(core)
        return epochs, resets, (a.view.resets, b.view.resets), a.counters.index_unavailable

    epochs, resets_before, resets_after, _ = asyncio.run(main())
    assert epochs[0] == epochs[1]  # both followed the one index
    assert all(after > before for before, after in zip(resets_before, resets_after, strict=True))
