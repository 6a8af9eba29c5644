"""Two router replicas over one worker group: each routes on its own prefix view, fed by the
index's change feed, either can abort a request the other streams, and either answers stats
for both (counters summed through the index actor, load from the workers' reports).

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

from pagedserve.cluster.api.grpc.convert import stats_to_proto
from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.protocol.requests import GenerateRequest

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
        # Syncs its view from the feed's dump in `start`.
        late = await start_router(cluster_config("t-replicas", num_workers=2))
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


def test_stats_through_either_router_are_cluster_wide_and_load_counts_once(replicas):
    """Requests sent through `a` show in the counters `b` answers GetStats with, and in `b`'s
    view of the worker's load (from the worker's report); `a` counts its own request once."""
    a, b = replicas

    def routed(*cores) -> int:
        return sum(sum(core.counters.routed.values()) for core in cores)

    async def main():
        request = GenerateRequest(
            params=greedy(LONG), prompt_token_ids=prompt(9, 20), request_id="w"
        )
        stream = a.generate(request)
        head = await anext(stream)

        async def read_on() -> list:  # kept running: a request held unread pauses
            return [delta async for delta in stream]

        reading = asyncio.ensure_future(read_on())
        seen_by_a, seen_by_b = a.workers[head.worker_id], b.workers[head.worker_id]

        # The fixture's loop ran the routers' poll loops: poll here, as each loop would.
        async def reported_to_a() -> bool:  # a's poll came back naming its request
            await a.liveness.poll(seen_by_a)
            return "w" in seen_by_a.stats.owned_requests

        async def seen_by_b_too() -> bool:
            await b.liveness.poll(seen_by_b)
            return seen_by_b.load().num_requests >= 1

        await until(reported_to_a, "a's report of the worker to name its request")
        load_a = seen_by_a.load()
        await until(seen_by_b_too, "b to see a's request there")
        load_b = seen_by_b.load()

        async def cluster_wide():
            stats = await b.cluster_stats()
            cluster = stats.cluster
            done = sum(cluster.counters.routed.values()) >= routed(a, b)
            return done and cluster.inflight.get(head.worker_id) == 1 and stats

        stats = await until(cluster_wide, "b's stats to count what a routed")
        assert await a.abort("w")
        await reading
        return load_a, load_b, stats, head.worker_id

    load_a, load_b, stats, worker_id = asyncio.run(main())
    # a's request is in the worker's report: a adds nothing on top of it (counted once) ...
    assert (load_a.inflight, load_a.unreported) == (1, 0)
    assert load_a.num_requests == load_a.num_running + load_a.num_waiting >= 1
    # ... and b, which sent nothing there, sees it all the same.
    assert (load_b.inflight, load_b.unreported) == (0, 0) and load_b.num_requests >= 1
    assert len(stats.cluster.replicas) >= 2
    message = stats_to_proto(stats)  # what GetStats answers through b
    assert sum(v for k, v in message.router_counters.items() if k.startswith("routed.kv")) >= 1
    assert {w.worker_id: w.inflight for w in message.workers}[worker_id] == 1
