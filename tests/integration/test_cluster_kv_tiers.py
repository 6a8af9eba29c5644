"""KV tiers in a real cluster: a prefix a worker's device pool evicted is routed back to that
worker and loaded from its host and disk tiers, not prefilled, with greedy output unchanged;
after the worker is killed and restarted by Ray, its disk tier is announced again and hit.

One cluster of two workers, each with a tiny device pool (16 blocks of 8 tokens), a host tier
of two blocks (so spilled blocks are soon demoted to disk) and a disk tier in its own directory.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from support.cluster import TEST_MODEL, cluster_config, greedy, run_request, start_router
from support.engine import load
from support.wait import until

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.kv.block_hash import hash_full_blocks
from pagedserve.workers.kv.memory import kv_bytes_per_token
from pagedserve.workers.protocol.requests import WorkerRequest

BLOCK = 8
PROMPT_A = [(7 * i + 3) % 200 + 1 for i in range(44)]  # 5 full blocks, then 4 tokens
PROMPT_B = [(11 * i + 5) % 200 + 1 for i in range(120)]  # with its output, the whole pool
A_BLOCKS = 5
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiers_cluster(ray_cluster, tmp_path_factory):
    config = cluster_config(
        "tiers",
        num_workers=2,
        engine={
            "block_size": BLOCK,
            "num_kv_blocks": 16,
            "watermark": 0.0,
            "kv_host_tier_bytes": 2 * _bytes_per_block(),
            "kv_disk_tier_dir": str(tmp_path_factory.mktemp("kv-disk")),
            "kv_disk_tier_bytes": 1 << 24,
        },
        enable_push=False,  # the evicted prefix must stay with its worker, in its tiers
        enable_pull=False,
    )
    yield config
    stop_worker_group(config)


def _bytes_per_block() -> int:
    """One block's KV bytes for the test model at BLOCK tokens (as the engine computes it)."""
    loaded = load(TEST_MODEL)
    return BLOCK * kv_bytes_per_token(
        loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, "float32"
    )


def run(coro):
    return asyncio.run(coro)


async def direct(handle, request_id: str, prompt: list[int]) -> list[int]:
    """Serve `prompt` on one worker, bypassing the router (its view still follows the index)."""
    tokens = []
    request = WorkerRequest.fresh(request_id, prompt, greedy(MAX_TOKENS))
    async for ref in handle.generate.remote(request):
        delta = await ref
        assert not delta.error, delta.error
        tokens += delta.token_ids
    return tokens


async def worker_stats(core, worker_id: str):
    return await core.workers[worker_id].handle.stats.remote()


def reported_idle(core, worker_id: str) -> bool:
    """The router's last report of the worker shows no request and no block in use."""
    stats = core.workers[worker_id].stats
    return (
        stats is not None
        and stats.num_running + stats.num_waiting == 0
        and (stats.kv.used_blocks == 0)
    )


def tier_hits(stats, tier: str) -> int:
    usage = stats.tiers.of(tier)
    return 0 if usage is None else usage.hit_blocks


def test_an_evicted_prefix_is_routed_back_and_loaded_from_host_disk_and_after_a_restart(
    tiers_cluster, hf_reference
):
    config = tiers_cluster
    expected = hf_reference.greedy(PROMPT_A, MAX_TOKENS)

    async def main():
        core = await start_router(config)
        owner = config.actors.worker_name(1)  # not the id tie-break's pick: only its cache draws A
        handle = core.workers[owner].handle
        hashes = hash_full_blocks(PROMPT_A, BLOCK, (core.model_name,))[:A_BLOCKS]
        alone = await direct(handle, "a-alone", PROMPT_A)
        await direct(handle, "b", PROMPT_B)  # evicts A from the device into the tiers

        def a_below_device() -> bool:
            tiers = [core.view.tier_of(owner, h) for h in hashes]
            return all(t in ("host", "disk") for t in tiers) and "host" in tiers

        await until(a_below_device, "A's blocks to reach the router's view in host and disk")
        # Routing weighs the owner's last report: one taken while B still ran there (16 blocks
        # in use) sends A to the idle peer, and A's host blocks are never demoted to disk.
        await until(lambda: reported_idle(core, owner), "a report of the owner with B done")
        before = await worker_stats(core, owner)
        tokens, finals = await run_request(core, PROMPT_A, greedy(MAX_TOKENS))
        after = await worker_stats(core, owner)
        first = {
            "tokens": tokens[0],
            "worker": finals[0].worker_id,
            "prefilled": after.scheduler.prefill_tokens - before.scheduler.prefill_tokens,
            "hits": {t: tier_hits(after, t) - tier_hits(before, t) for t in ("host", "disk")},
        }

        # The shutdown path writes the disk tier out; Ray then restarts the worker, which
        # finds its files and announces them (its host tier, in memory, is gone).
        await handle.close.remote()
        ray.kill(handle, no_restart=False)

        def a_on_disk_again() -> bool:
            state = core.workers[owner]
            tiers = [core.view.tier_of(owner, h) for h in hashes]
            return state.alive and tiers == ["disk"] * A_BLOCKS

        def where_a_stands() -> str:
            state = core.workers[owner]
            epoch = state.info.epoch if state.info is not None else None
            tiers = [core.view.tier_of(owner, h) for h in hashes]
            return f"worker alive={state.alive} epoch={epoch}, A's tiers in the view {tiers}"

        await until(
            a_on_disk_again,
            "the restarted worker's disk tier in the router's view",
            explain=where_a_stands,
        )
        before = await worker_stats(core, owner)
        tokens, finals = await run_request(core, PROMPT_A, greedy(MAX_TOKENS))
        after = await worker_stats(core, owner)
        restarted = {
            "tokens": tokens[0],
            "worker": finals[0].worker_id,
            "prefilled": after.scheduler.prefill_tokens - before.scheduler.prefill_tokens,
            "disk_hits": tier_hits(after, "disk") - tier_hits(before, "disk"),
        }
        await core.close()
        return alone, first, restarted

    alone, first, restarted = run(main())
    owner = config.actors.worker_name(1)
    assert alone == expected
    cached_part = A_BLOCKS * BLOCK
    assert first["worker"] == owner and first["tokens"] == expected
    assert first["prefilled"] == len(PROMPT_A) - cached_part  # none of the cached part
    assert first["hits"]["host"] >= 1 and sum(first["hits"].values()) == A_BLOCKS
    assert restarted["worker"] == owner and restarted["tokens"] == expected
    assert restarted["prefilled"] == len(PROMPT_A) - cached_part
    assert restarted["disk_hits"] == A_BLOCKS
