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
import time

import pytest
from support.cluster import (
    PIN,
    assert_cluster_clean,
    cluster_config,
    greedy,
    run_request,
    start_router,
)
from support.wait import RESTART_DEADLINE_S

from pagedserve.cluster.router_types import GenerateRequest
from pagedserve.cluster.worker_group import stop_worker_group

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


def test_tp_workers_serve_and_move_kv_rank_by_rank(hf_reference):
    config = cluster_config(
        "t-tp-move",
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
    # 30 + 100 tokens need 17 blocks each: both cannot stay in a pool of 20, so one moves.
    pair = [prompt(300 + i, 30) for i in range(2)]

    async def main():
        core = await start_router(config)
        infos = [await w.handle.describe.remote() for w in core.workers.values()]
        alone = [(await run_request(core, p, greedy(100)))[0][0] for p in pair]
        source, target = core.workers.values()
        before = await target.handle.stats.remote()
        target.begin(PIN)
        try:
            results = await asyncio.gather(*(run_request(core, p, greedy(100)) for p in pair))
        finally:
            target.end(PIN)
        after = await target.handle.stats.remote()
        moves = core.counters.moves
        await assert_cluster_clean(core)
        await core.close()
        return infos, alone, [tokens[0] for tokens, _ in results], before, after, moves

    try:
        infos, alone, together, before, after, moves = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert all(len(info.rank_pids) == 1 for info in infos)
    assert alone == [hf_reference.greedy(p, 100) for p in pair] == together
    assert moves == 1 and after.scheduler.moved == before.scheduler.moved
    assert (after.adopted_with_kv, after.adopted_recomputed) == (
        before.adopted_with_kv + 1,
        before.adopted_recomputed,
    )
    assert after.scheduler.prefill_tokens == before.scheduler.prefill_tokens, "KV recomputed"


def test_a_rank_killed_mid_stream_takes_its_group_down_and_the_request_replays(hf_reference):
    config = cluster_config("t-tp-kill", num_workers=2, engine=TP)
    long_prompt = prompt(30, 24)

    async def main():
        core = await start_router(config)
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
        deadline = time.monotonic() + RESTART_DEADLINE_S
        while not victim.alive:
            assert time.monotonic() < deadline, "the group never came back"
            await asyncio.sleep(0.2)
        again = await victim.handle.describe.remote()
        replays = core.counters.replays
        await core.close()
        return reference[0], streamed, replays, again

    try:
        reference, streamed, replays, again = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert reference == hf_reference.greedy(long_prompt, 60)
    assert streamed == reference and replays == 1
    assert len(again.rank_pids) == 1  # restarted whole, with a new rank 1
