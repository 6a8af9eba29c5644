"""Tensor-parallel workers (k = 2: rank 0 in the worker actor, rank 1 its child process, gloo
between them) in the real cluster: they serve through the router with HF's greedy tokens, a
preempted request moves between two of them with its KV imported rank by rank (the receiver
prefills nothing), and a rank killed mid-stream takes its whole group down: the request replays
on the peer with the same tokens, the group's processes are gone, the worker restarts whole and
nothing leaks.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import os
import random

import pytest
from support.cluster import (
    PIN,
    assert_cluster_clean,
    cluster_config,
    greedy,
    run_request,
    start_router,
)
from support.wait import RESTART_DEADLINE_S, until

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.protocol.requests import GenerateRequest

pytestmark = pytest.mark.usefixtures("ray_cluster")

TP = {"tensor_parallel_size": 2}
STEPS_BEFORE_FAULT = 5


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tp_workers_serve_move_kv_rank_by_rank_and_fail_whole(hf_reference):
    """One cluster of two TP=2 workers (a cluster start saved): first a move between them,
    then a rank killed mid-stream."""
    config = cluster_config(
        "t-tp",
        num_workers=2,
        enable_push=False,
        enable_pull=False,
        engine={
            **TP,
            "num_kv_blocks": 20,
            "preemption_mode": "move",
            "watermark": 0.0,
            "enable_prefix_caching": False,
        },
    )

    async def main():
        core = await start_router(config)
        moved = await move_between_groups(core)
        killed = await kill_a_rank_mid_stream(core)
        await core.close()
        return moved, killed

    try:
        moved, killed = asyncio.run(main())
    finally:
        stop_worker_group(config)
    infos, pair, alone, together, before, after, moves = moved
    assert all(len(info.rank_pids) == 1 for info in infos)
    assert alone == [hf_reference.greedy(p, 100) for p in pair] == together
    assert moves == 1 and after.scheduler.moved == before.scheduler.moved
    assert (after.adopted_with_kv, after.adopted_recomputed) == (
        before.adopted_with_kv + 1,
        before.adopted_recomputed,
    )
    assert after.scheduler.prefill_tokens == before.scheduler.prefill_tokens, "KV recomputed"
    long_prompt, reference, streamed, replays, again = killed
    assert reference == hf_reference.greedy(long_prompt, 60)
    assert streamed == reference and replays == 1
    assert len(again.rank_pids) == 1  # restarted whole, with a new rank 1


async def move_between_groups(core):
    """Two requests that cannot both stay in one pool of 20 blocks (30 + 100 tokens: 17 blocks
    each) run on one worker (the other looks full): one moves, with its KV."""
    pair = [prompt(300 + i, 30) for i in range(2)]
    infos = [await w.handle.describe.remote() for w in core.workers.values()]
    alone = [(await run_request(core, p, greedy(100)))[0][0] for p in pair]
    _, target = core.workers.values()
    before = await target.handle.stats.remote()
    target.begin(PIN)
    try:
        results = await asyncio.gather(*(run_request(core, p, greedy(100)) for p in pair))
    finally:
        target.end(PIN)
    after = await target.handle.stats.remote()
    await assert_cluster_clean(core)
    together = [tokens[0] for tokens, _ in results]
    return infos, pair, alone, together, before, after, core.counters.moves


async def kill_a_rank_mid_stream(core):
    """Rank 1 of the worker streaming a request is killed (its engine stopped after a few
    steps, so the stream is open): the group goes down whole, the request replays on the
    peer, the worker restarts with a new group."""
    long_prompt = prompt(30, 24)
    reference, _ = await run_request(core, long_prompt, greedy(60))
    victim, *peers = sorted(core.workers.values(), key=lambda w: w.worker_id)
    info = await victim.handle.describe.remote()
    (rank_pid,) = info.rank_pids
    for peer in peers:
        peer.begin(PIN)
    await victim.handle.chaos_stall.remote(True, after_steps=STEPS_BEFORE_FAULT)
    streamed: list[int] = []
    killed = False
    try:
        request = GenerateRequest(params=greedy(60), prompt_token_ids=long_prompt)
        async for delta in core.generate(request):
            streamed.extend(delta.token_ids)
            if not killed and streamed:
                assert delta.worker_id == victim.worker_id
                os.kill(rank_pid, 9)  # rank 1 only; rank 0 (the actor) must follow
                killed = True
    finally:
        for peer in peers:
            peer.end(PIN)
    assert not alive(rank_pid) and not alive(info.pid)
    await assert_cluster_clean(core)
    await until(lambda: victim.alive, "the group to come back", RESTART_DEADLINE_S)
    again = await victim.handle.describe.remote()
    return long_prompt, reference[0], streamed, core.counters.replays, again
