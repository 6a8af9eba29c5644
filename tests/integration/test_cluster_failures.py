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
def test_worker_killed_mid_stream(ray_cluster, hf_reference, mode):
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
    assert reference == hf_reference.greedy(long_prompt, 60)
    if mode == "replay":
        assert error is None and streamed == reference
    else:
        assert isinstance(error, NoWorkerAvailable) and streamed == reference[: len(streamed)]


def test_a_stalled_worker_s_streams_replay_on_a_peer(ray_cluster, hf_reference):
    """A worker that stays alive and answers but whose engine takes no step (a hung step):
    its stream is not left waiting. The router judges it stalled, replays the request on the
    peer (the same greedy tokens), and routes to it again once it steps again."""
    config = cluster_config("t-stall", num_workers=2, stall_timeout_s=3.0)
    long_prompt = prompt(31, 24)

    async def main():
        core = await start_router(config)
        reference, _ = await run_request(core, long_prompt, greedy(60))
        streamed: list[int] = []
        victim = None
        request = GenerateRequest(params=greedy(60), prompt_token_ids=long_prompt)
        async for delta in core.generate(request):
            streamed.extend(delta.token_ids)
            if victim is None and len(streamed) >= 5:
                victim = core.workers[delta.worker_id]
                await victim.handle.chaos_stall.remote(True)
        stalled_seen = core.counters.workers_stalled
        assert victim is not None and victim.alive and not victim.routable
        await victim.handle.chaos_stall.remote(False)
        deadline = time.monotonic() + 60  # a failsafe: it steps again within milliseconds
        while victim.stalled:
            assert time.monotonic() < deadline, "the released worker never rejoined routing"
            await asyncio.sleep(0.1)
        await assert_cluster_clean(core)
        replays = core.counters.replays
        await core.close()
        return reference[0], streamed, stalled_seen, replays

    try:
        reference, streamed, stalled_seen, replays = run(main())
    finally:
        stop_worker_group(config)
    assert stalled_seen == 1 and replays == 1
    assert streamed == reference == hf_reference.greedy(long_prompt, 60)


def test_a_refused_replay_leg_tries_the_next_worker(ray_cluster, hf_reference):
    """A worker dies mid-stream; the peer its replay goes to first refuses it (a full queue,
    `Overloaded`): the replay goes on to the next worker instead of ending the request."""
    config = cluster_config("t-refused-leg", num_workers=3)
    long_prompt = prompt(32, 24)

    async def main():
        core = await start_router(config)
        reference, _ = await run_request(core, long_prompt, greedy(60))
        streamed: list[int] = []
        finals = []
        victim = busy = None
        request = GenerateRequest(params=greedy(60), prompt_token_ids=long_prompt)
        async for delta in core.generate(request):
            streamed.extend(delta.token_ids)
            if delta.finish_reason is not None:
                finals.append(delta)
            if victim is None and len(streamed) >= 5:
                victim = core.workers[delta.worker_id]
                refusing, busy = sorted(
                    (w for w in core.workers.values() if w is not victim),
                    key=lambda w: w.worker_id,
                )
                # The replay is routed to `refusing` first (`busy` looks loaded), which
                # refuses it once; then only `busy` is left to take it.
                busy.begin(10_000_000)
                await refusing.handle.chaos_refuse_next.remote(1)
                ray.kill(victim.handle, no_restart=False)
        busy.end(10_000_000)
        await assert_cluster_clean(core)
        retried, replays = core.counters.legs_retried, core.counters.replays
        await core.close()
        return reference[0], streamed, finals, busy.worker_id, retried, replays

    try:
        reference, streamed, finals, busy_id, retried, replays = run(main())
    finally:
        stop_worker_group(config)
    assert replays == 1 and retried == 1
    assert finals[0].worker_id == busy_id and streamed == reference
    assert reference == hf_reference.greedy(long_prompt, 60)
