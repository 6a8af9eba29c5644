"""Speculative decoding on a 2-worker cluster: a request preempted mid-speculation moves to
the peer with its KV and goes on speculating there; outputs equal the request run alone and
HF's own greedy decode, and both workers report acceptance in their stats."""

import asyncio
import random

import pytest
from support.cluster import PIN, cluster_config, greedy, run_request, start_router

from pagedserve.cluster.api.grpc.convert import stats_to_proto
from pagedserve.cluster.pool.group import stop_worker_group

pytestmark = pytest.mark.usefixtures("ray_cluster")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


async def worker_stats(core):
    return {wid: await w.handle.stats.remote() for wid, w in core.workers.items()}


def test_a_request_moved_mid_speculation_keeps_its_output(hf_reference):
    config = cluster_config(
        "t-spec-move",
        num_workers=2,
        enable_push=False,
        enable_pull=False,
        engine={
            "num_kv_blocks": 20,
            "preemption_mode": "move",
            "watermark": 0.0,
            "enable_prefix_caching": False,
            # The target drafting for itself: every draft is accepted, so speculation runs
            # on every step of both workers, before and after the move.
            "speculative": {"method": "draft", "num_tokens": 3, "draft_model": "tiny-llama"},
        },
    )
    # As in test_cluster_migration: two of 30 + 100 tokens cannot both stay in 20 blocks of
    # 8, one alone fits, so exactly one moves while both speculate.
    pair = [prompt(300 + i, 30) for i in range(2)]

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(100)))[0][0] for p in pair]
        _, target = core.workers.values()
        before, moves = await worker_stats(core), core.counters.moves
        target.begin(PIN)
        try:
            results = await asyncio.gather(*(run_request(core, p, greedy(100)) for p in pair))
        finally:
            target.end(PIN)
        after = await worker_stats(core)
        cluster = await core.cluster_stats()
        return alone, results, before, after, core.counters.moves - moves, cluster

    try:
        alone, results, before, after, moves, cluster = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert moves == 1
    assert [tokens[0] for tokens, _ in results] == alone
    assert alone == [hf_reference.greedy(p, 100) for p in pair]
    assert len({final[0].worker_id for _, final in results}) == 2  # one ended on the peer
    for wid, stats in after.items():  # both verified drafts in the pinned run, all accepted
        verified = stats.spec.num_verified - before[wid].spec.num_verified
        drafts = stats.spec.num_draft_tokens - before[wid].spec.num_draft_tokens
        accepted = stats.spec.num_accepted_tokens - before[wid].spec.num_accepted_tokens
        assert verified > 0 and drafts == accepted > 0, (wid, stats.spec)
    message = stats_to_proto(cluster)  # what GetStats answers
    assert message.spec.num_draft_tokens == sum(s.spec.num_draft_tokens for s in after.values())
    assert message.spec.acceptance_rate == 1.0
