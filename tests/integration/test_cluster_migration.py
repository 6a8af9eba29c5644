"""KV moving between workers: a preempted request moves to a peer with its KV, and a worker
under eviction pressure pushes cached prefixes to the emptiest peer. Outputs never change."""

import asyncio
import copy
import random

import pytest
from support.cluster import cluster_config, greedy, run_request, start_router

from pagedserve.cluster.worker_group import stop_worker_group

pytestmark = pytest.mark.usefixtures("ray_cluster")
PIN = 10_000_000  # router-side demand that makes a worker look full, to steer routing


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def test_preempted_request_moves_with_its_kv_and_output_is_unchanged():
    config = cluster_config(
        "t-move",
        num_workers=2,
        enable_push=False,
        enable_pull=False,
        engine={
            "num_kv_blocks": 20,
            "preemption_mode": "move",
            "watermark": 0.0,
            "enable_prefix_caching": False,
        },
    )
    prompts = [prompt(100 + i, 30) for i in range(5)]

    async def main():
        core = await start_router(config)
        reference = [(await run_request(core, p, greedy(30)))[0][0] for p in prompts]
        busy, target = core.workers.values()
        target.begin(PIN)  # everything lands on `busy`, whose pool cannot hold them all
        try:
            results = await asyncio.gather(*(run_request(core, p, greedy(30)) for p in prompts))
        finally:
            target.end(PIN)
        return reference, results, copy.deepcopy(core.counters)

    try:
        reference, results, counters = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert counters.moves >= 1
    assert [tokens[0] for tokens, _ in results] == reference
    assert {final[0].worker_id for _, final in results} == {
        f"{config.name}-worker-0",
        f"{config.name}-worker-1",
    }


def test_pressure_pushes_cached_prefixes_that_later_hit_on_the_receiver():
    config = cluster_config(
        "t-push",
        num_workers=2,
        enable_pull=False,
        push_free_fraction=0.5,
        push_max_chains=8,
        engine={"num_kv_blocks": 32, "watermark": 0.0},
    )
    prefixes = [prompt(200 + i, 48) for i in range(4)]

    async def main():
        core = await start_router(config)
        source, receiver = core.workers.values()
        receiver.begin(PIN)
        try:
            for p in prefixes:  # all on `source`: its pool fills with cached prefixes
                await run_request(core, p + [1, 2, 3], greedy(2))
            for _ in range(100):  # the poll loop pushes while `source` is short of blocks
                if core.counters.pushes:
                    break
                await asyncio.sleep(0.1)
        finally:
            receiver.end(PIN)
        source.begin(PIN)
        try:
            hits = [(await run_request(core, p + [4, 5, 6], greedy(2)))[1][0] for p in prefixes]
        finally:
            source.end(PIN)
        held = await core.index.snapshot_of.remote(receiver.worker_id)
        return copy.deepcopy(core.counters), hits, held, receiver.worker_id

    try:
        counters, hits, held, receiver_id = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert counters.pushes >= 1 and held
    pushed_hits = [d for d in hits if d.worker_id == receiver_id and d.usage.cached_tokens >= 40]
    assert pushed_hits, [(d.worker_id, d.usage) for d in hits]
