"""SmolLM2-135M-Instruct on a 2-worker cluster: KV that moves between workers gives HF's ids.

A prefix pulled from a peer, a request moved to a peer with its KV, and a request replayed on a
peer after its worker died each end with exactly the greedy ids of HF transformers run alone.
Workers load the converted checkpoint from the cache (the first real-model test converted it).
"""

import asyncio

import pytest
import ray
from support.cluster import (
    PIN,
    assert_cluster_clean,
    cluster_config,
    greedy,
    run_request,
    start_router,
    until_view_mirrors,
)
from support.real_model import SMOLLM2, prompt_ids
from support.wait import until

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.protocol.requests import GenerateRequest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]
MAX_TOKENS = 12


def real_config(name: str, engine: dict | None = None, **overrides):
    engine = {"model": SMOLLM2, "block_size": 16, "num_kv_blocks": 96, **(engine or {})}
    return cluster_config(name, num_workers=2, engine=engine, **overrides)


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return prompt_ids(smollm2[0])


def test_pulled_prefix_gives_hf_ids(smollm2, prompts):
    _, reference = smollm2
    long, shorter = prompts[1], prompts[2]  # 549 tokens, and a 290-token prefix of it
    config = real_config("t-real-pull", enable_push=False, pull_min_blocks=1)

    async def main():
        core = await start_router(config)
        _, first = await run_request(core, shorter, greedy(MAX_TOKENS))
        holder = core.workers[first[0].worker_id]
        other = next(w for w in core.workers.values() if w is not holder)
        await until_view_mirrors(core, holder.worker_id)  # the pull is decided on the view
        holder.begin(PIN)  # the router picks the other worker, which pulls the prefix
        try:
            tokens, final = await run_request(core, long, greedy(MAX_TOKENS))
        finally:
            holder.end(PIN)
        await assert_cluster_clean(core)
        return tokens[0], final[0], other.worker_id, core.counters.as_dict()

    try:
        tokens, final, other_id, counters = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert final.worker_id == other_id and counters["migrations.pull"] == 1
    assert final.usage.cached_tokens >= 272  # the pulled 17 blocks of the 290-token prefix
    assert tokens == reference.greedy(long, MAX_TOKENS)


def test_moved_request_gives_hf_ids(smollm2, prompts):
    _, reference = smollm2
    chosen = prompts[6:9] + prompts[-4:]  # French, Japanese, emoji, the chats: 23-137 tokens
    engine = {"num_kv_blocks": 14, "preemption_mode": "move", "watermark": 0.0}
    engine["enable_prefix_caching"] = False
    # No stall judgment while `busy` is held still on purpose (below).
    config = real_config(
        "t-real-move", engine, enable_push=False, enable_pull=False, stall_timeout_s=600.0
    )

    async def main():
        core = await start_router(config)
        busy, target = core.workers.values()
        target.begin(PIN)  # everything lands on `busy`, whose 14 blocks cannot hold it all
        # `busy` takes no step until it holds every request: they contend for its pool however
        # fast the machine is (a quick engine had finished the first ones before the last came).
        await busy.handle.chaos_stall.remote(True)
        try:
            # One at a time, each once `busy` holds the one before: the engine then admits them
            # in this order, whatever the machine's speed. (Sent at once they reached it in any
            # order, and in some orders the admitted ones fit to the end: no preemption, no
            # move; the fresh-check caught one such run.)
            calls = []
            for i, p in enumerate(chosen):
                calls.append(asyncio.create_task(run_request(core, p, greedy(MAX_TOKENS))))

                async def holds(count: int = i + 1) -> bool:
                    return (await busy.handle.stats.remote()).num_streams == count

                await until(holds, f"{busy.worker_id} to hold {i + 1} requests")
            await busy.handle.chaos_stall.remote(False)
            results = await asyncio.gather(*calls)
        finally:
            await busy.handle.chaos_stall.remote(False)
            target.end(PIN)
        await assert_cluster_clean(core)
        return results, core.counters.as_dict()

    try:
        results, counters = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert counters.get("migrations.move", 0) >= 1
    assert len({final[0].worker_id for _, final in results}) == 2
    expected = [reference.greedy(p, MAX_TOKENS) for p in chosen]
    assert [tokens[0] for tokens, _ in results] == expected


def test_replayed_request_gives_hf_ids(smollm2, prompts):
    _, reference = smollm2
    prompt = prompts[-3]  # a chat
    config = real_config("t-real-replay", on_worker_failure="replay")

    async def main():
        core = await start_router(config)
        streamed: list[int] = []
        victim = None
        request = GenerateRequest(params=greedy(40), prompt_token_ids=prompt)
        async for delta in core.generate(request):
            streamed.extend(delta.token_ids)
            if victim is None and len(streamed) >= 5:
                victim = core.workers[delta.worker_id]
                ray.kill(victim.handle, no_restart=False)
        await assert_cluster_clean(core)
        await core.close()
        return streamed, victim

    try:
        streamed, victim = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert victim is not None
    assert streamed == reference.greedy(prompt, 40)
