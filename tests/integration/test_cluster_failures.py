"""A worker killed mid-stream: its requests replay on a peer (or fail, by config), it is
dropped from the index at once, Ray restarts it and it rejoins; survivors leak nothing.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import random
import time

import pytest
import ray
from support.cluster import assert_cluster_clean, cluster_config, greedy, run_request, start_router

from pagedserve.cluster.router_types import GenerateRequest, NoWorkerAvailable
from pagedserve.cluster.worker_group import stop_worker_group


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("mode", ["replay", "fail"])
def test_worker_killed_mid_stream(ray_cluster, mode):
    config = cluster_config(f"t-kill-{mode}", num_workers=2, on_worker_failure=mode)
    long_prompt = prompt(30, 24)

    async def main():
        core = await start_router(config)
        reference, _ = await run_request(core, long_prompt, greedy(60))
        streamed: list[int] = []
        error = None
        victim = None
        try:
            request = GenerateRequest(params=greedy(60), prompt_token_ids=long_prompt)
            async for delta in core.generate(request):
                streamed.extend(delta.token_ids)
                if victim is None and len(streamed) >= 5:
                    victim = core.workers[delta.worker_id]
                    ray.kill(victim.handle, no_restart=False)
        except NoWorkerAvailable as exc:
            error = exc
        assert victim is not None and not victim.alive
        held = await core.index.snapshot_of.remote(victim.worker_id)
        await assert_cluster_clean(core)  # the survivor leaked nothing; the victim restarts
        # Ray restarts the victim; the router notices and routes to it again.
        deadline = time.monotonic() + 60
        while not victim.alive:
            assert time.monotonic() < deadline, "killed worker never rejoined"
            await asyncio.sleep(0.2)
        await core.close()
        return reference[0], streamed, error, held

    try:
        reference, streamed, error, held_after_death = run(main())
    finally:
        stop_worker_group(config)
    assert not held_after_death  # dropped from the index at once
    if mode == "replay":
        assert error is None and streamed == reference
    else:
        assert isinstance(error, NoWorkerAvailable) and streamed == reference[: len(streamed)]
