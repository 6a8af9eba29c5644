"""A worker killed mid-stream: its requests replay on a peer (or fail, by config), it is
dropped from the index at once, Ray restarts it and it rejoins; survivors leak nothing.

Each fault strikes a stream that cannot have ended: the request is steered to the victim (its
peers look full), whose engine stops after `STEPS_BEFORE_FAULT` steps (`chaos_stall` with
`after_steps`), and the fault comes with the first tokens the client sees. A worker coalesces
what its reader has not taken yet, so without the stop a fault "after 5 tokens" could find
the whole answer already handed over.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import random
import time

import pytest
import ray
from support.cluster import (
    PIN,
    assert_cluster_clean,
    cluster_config,
    greedy,
    run_request,
    start_router,
)
from support.wait import RESTART_DEADLINE_S

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.protocol.errors import NoWorkerAvailable
from pagedserve.workers.protocol.requests import GenerateRequest


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def run(coro):
    return asyncio.run(coro)


STEPS_BEFORE_FAULT = 5  # of a 60-token answer: the victim stops long before its end


async def steer_to_a_stopping_victim(core):
    """(victim, its peers sorted by id): the next request lands on the victim (the peers
    are pinned with `PIN`; the caller ends that), whose engine stops after
    `STEPS_BEFORE_FAULT` steps, so its stream is still open when the fault strikes."""
    victim, *peers = sorted(core.workers.values(), key=lambda w: w.worker_id)
    for peer in peers:
        peer.begin(PIN)
    await victim.handle.chaos_stall.remote(True, after_steps=STEPS_BEFORE_FAULT)
    return victim, peers


@pytest.mark.parametrize("mode", ["replay", "fail"])
def test_worker_killed_mid_stream(ray_cluster, hf_reference, mode):
    config = cluster_config(f"t-kill-{mode}", num_workers=2, on_worker_failure=mode)
    long_prompt = prompt(30, 24)

    async def main():
        core = await start_router(config)
        reference, _ = await run_request(core, long_prompt, greedy(60))
        streamed: list[int] = []
        error = None
        killed = False
        victim, peers = await steer_to_a_stopping_victim(core)
        try:
            request = GenerateRequest(params=greedy(60), prompt_token_ids=long_prompt)
            async for delta in core.generate(request):
                streamed.extend(delta.token_ids)
                if not killed and streamed:
                    assert delta.worker_id == victim.worker_id
                    assert len(streamed) <= STEPS_BEFORE_FAULT  # mid-stream, by construction
                    ray.kill(victim.handle, no_restart=False)
                    killed = True
        except NoWorkerAvailable as exc:
            error = exc
        finally:
            for peer in peers:
                peer.end(PIN)
        assert killed and not victim.alive
        held = await core.index.snapshot_of.remote(victim.worker_id)
        await assert_cluster_clean(core)  # the survivor leaked nothing; the victim restarts
        # Ray restarts the victim; the router notices and routes to it again.
        deadline = time.monotonic() + RESTART_DEADLINE_S
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
        victim, peers = await steer_to_a_stopping_victim(core)
        request = GenerateRequest(params=greedy(60), prompt_token_ids=long_prompt)
        try:
            async for delta in core.generate(request):
                streamed.extend(delta.token_ids)
        finally:
            for peer in peers:
                peer.end(PIN)
        stalled_seen = core.counters.workers_stalled
        assert victim.alive and not victim.routable
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
        killed = False
        # The replay is routed to `refusing` first (`busy` stays pinned), which refuses it
        # once; then only `busy` is left to take it.
        victim, (refusing, busy) = await steer_to_a_stopping_victim(core)
        request = GenerateRequest(params=greedy(60), prompt_token_ids=long_prompt)
        try:
            async for delta in core.generate(request):
                streamed.extend(delta.token_ids)
                if delta.finish_reason is not None:
                    finals.append(delta)
                if not killed and streamed:
                    assert delta.worker_id == victim.worker_id
                    refusing.end(PIN)
                    await refusing.handle.chaos_refuse_next.remote(1)
                    ray.kill(victim.handle, no_restart=False)
                    killed = True
        finally:
            busy.end(PIN)
            if not killed:
                refusing.end(PIN)
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
