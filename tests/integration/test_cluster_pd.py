"""Prefill/decode disaggregation in a real cluster: 1 prefill + 1 decode worker (tiny-llama).

A request is prefilled on the prefill worker, its first token streamed from there, and its KV
handed to the decode worker by object ref (the `move` path), which streams on. Greedy outputs
equal HF's and the run-alone engine's, for plain prompts, shared prefixes and `n > 1`; the
decode worker imported the KV (its scheduler prefilled nothing) unless the transfer failed,
in which case it recomputed with the same output. A prefill worker killed mid-prefill and a
decode worker killed mid-stream both end in a replay with the output unchanged. Every test
ends with the shared leak check (pools, index, router in-flight).

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import dataclasses
import random

import pytest
import ray
from support.cluster import (
    TEST_MODEL,
    assert_cluster_clean,
    cluster_config,
    greedy,
    run_request,
    start_router,
)
from support.engine import load
from support.wait import RESTART_DEADLINE_S, until

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.role import WorkerRole

# A small step budget: a 40-token prompt takes 3 prefill steps, so a fault can strike inside
# a prefill (the engine stopped after its first chunk).
BUDGET = 16
CONFIG = cluster_config(
    "t-pd",
    num_workers=2,
    prefill_workers=1,
    decode_workers=1,
    engine={"max_num_batched_tokens": BUDGET},
)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def pd_cluster(ray_cluster):
    yield CONFIG
    stop_worker_group(CONFIG)


@pytest.fixture(scope="module")
def run_alone():
    """The same engine as the workers', alone in this process: outputs of a request run
    without any handoff."""
    engine = CONFIG.engine
    llm = LLM(
        loaded_model=load(TEST_MODEL),
        block_size=engine.block_size,
        num_kv_blocks=engine.num_kv_blocks,
        attention_backend=engine.attention_backend,
    )

    def run(token_ids, params):
        out = llm.generate([token_ids], params)[0]
        return {c.index: c.token_ids for c in out.outputs}

    return run


def by_role(core) -> tuple:
    """(the prefill worker's state, the decode worker's)."""
    roles = {w.info.role: w for w in core.workers.values()}
    return roles[WorkerRole.PREFILL], roles[WorkerRole.DECODE]


async def stats(worker):
    return await worker.handle.stats.remote()


async def held_nothing(worker) -> bool:
    return (await stats(worker)).kv_held == 0


async def until_alive(core, worker) -> None:
    """Ray restarts a killed worker (same name, same role); wait for the router to see it."""
    await until(lambda: worker.alive, f"{worker.worker_id} to restart", RESTART_DEADLINE_S)


def test_outputs_equal_hf_and_run_alone_and_the_kv_is_handed_over(
    pd_cluster, hf_reference, run_alone
):
    plain = prompt(1, 30)
    system = prompt(2, 32)  # 4 full blocks of 8: shared by the next two prompts
    shared = [system + prompt(3, 5), system + prompt(4, 7)]
    sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=11, n=3, ignore_eos=True)

    async def main():
        core = await start_router(pd_cluster)
        prefill, decode = by_role(core)
        assert {prefill.info.role, decode.info.role} == {WorkerRole.PREFILL, WorkerRole.DECODE}
        p0, d0 = await stats(prefill), await stats(decode)
        out = {"plain": await run_request(core, plain, greedy(16))}
        p1, d1 = await stats(prefill), await stats(decode)
        out["shared"] = [await run_request(core, p, greedy(12)) for p in shared]
        p2 = await stats(prefill)
        out["n2"] = await run_request(core, plain, dataclasses.replace(greedy(9), n=2))
        out["n3"] = await run_request(core, shared[0], sampled)
        d3 = await stats(decode)
        # A failed transfer (the KV ref lost): the decode side recomputes it.
        await decode.handle.chaos_fail_next_kv_fetch.remote(1)
        out["lost"] = await run_request(core, prompt(5, 26), greedy(14))
        d4 = await stats(decode)
        counters = core.counters
        # The prefill worker held each handed-off KV object until the decode worker had it.
        await until(
            lambda: held_nothing(prefill), "the prefill worker to release the KV it handed off"
        )
        await assert_cluster_clean(core)
        await core.close()
        return out, (p0, p1, p2), (d0, d1, d3, d4), counters, decode.worker_id

    out, (p0, p1, p2), (d0, d1, d3, d4), counters, decode_id = asyncio.run(main())
    tokens, finals = out["plain"]
    assert tokens[0] == hf_reference.greedy(plain, 16) == run_alone(plain, greedy(16))[0]
    assert finals[0].worker_id == decode_id  # the stream ended on the decode worker
    # Handed over, not recomputed: one handoff out of the prefill worker, adopted with its KV
    # by the decode worker, whose scheduler prefilled nothing.
    assert p1.scheduler.prefill_handoffs - p0.scheduler.prefill_handoffs == 1
    assert (d1.adopted_with_kv - d0.adopted_with_kv, d1.adopted_recomputed) == (1, 0)
    assert d1.scheduler.prefill_tokens == d0.scheduler.prefill_tokens
    assert d1.num_steps > d0.num_steps
    # Shared prefixes: equal outputs, and the second hit the prefix the first left cached on
    # the prefill worker (its full blocks stay there after the handoff).
    for p, (tokens, _) in zip(shared, out["shared"], strict=True):
        assert tokens[0] == hf_reference.greedy(p, 12) == run_alone(p, greedy(12))[0]
    assert p2.kv.prefix_hits_tokens - p1.kv.prefix_hits_tokens >= len(system)
    # n > 1: every branch handed off and continued as run alone.
    tokens, _ = out["n2"]
    assert tokens == {0: hf_reference.greedy(plain, 9), 1: hf_reference.greedy(plain, 9)}
    tokens, _ = out["n3"]
    assert tokens == run_alone(shared[0], sampled)
    assert d3.adopted_with_kv - d1.adopted_with_kv == 2 + 2 + 3
    assert d3.scheduler.prefill_tokens == d0.scheduler.prefill_tokens
    # The lost transfer: recomputed on the decode side, the same output.
    tokens, _ = out["lost"]
    assert tokens[0] == hf_reference.greedy(prompt(5, 26), 14)
    assert d4.adopted_recomputed - d3.adopted_recomputed == 1
    assert d4.scheduler.prefill_tokens > d3.scheduler.prefill_tokens
    assert counters.pd_handoffs == 1 + 2 + 2 + 3 + 1 and counters.moves == 0
    assert counters.pd_fallbacks == 0 and counters.replays == 0


def test_a_prefill_worker_killed_mid_prefill_replays_with_the_same_output(pd_cluster, hf_reference):
    long_prompt = prompt(6, 40)  # 3 steps of prefill at BUDGET tokens a step

    async def main():
        core = await start_router(pd_cluster)
        prefill, decode = by_role(core)
        before = (await stats(prefill)).scheduler.prefill_tokens
        await prefill.handle.chaos_stall.remote(True, after_steps=1)  # one chunk, then stop
        run = asyncio.ensure_future(run_request(core, long_prompt, greedy(12)))

        async def stopped_mid_prefill():
            s = await stats(prefill)
            return s.scheduler.prefill_tokens - before == BUDGET and s.num_running == 1

        await until(stopped_mid_prefill, "the prefill worker to stop inside the prefill")
        ray.kill(prefill.handle, no_restart=False)
        tokens, finals = await run
        replays, fallbacks = core.counters.replays, core.counters.pd_fallbacks
        await until_alive(core, prefill)
        await assert_cluster_clean(core)
        await core.close()
        return tokens[0], finals[0].worker_id, decode.worker_id, replays, fallbacks

    tokens, last_worker, decode_id, replays, fallbacks = asyncio.run(main())
    assert tokens == hf_reference.greedy(long_prompt, 12)
    # Replayed on the one worker left (the decode worker: a fallback, no prefill worker up).
    assert replays == 1 and fallbacks >= 1 and last_worker == decode_id


def test_a_decode_worker_killed_mid_stream_replays_with_the_same_output(pd_cluster, hf_reference):
    steps = 3  # of a 40-token answer: the decode worker stops long before its end
    request_prompt = prompt(7, 20)

    async def main():
        core = await start_router(pd_cluster)
        prefill, decode = by_role(core)
        await decode.handle.chaos_stall.remote(True, after_steps=steps)
        streamed: list[int] = []
        killed = False
        request = GenerateRequest(params=greedy(40), prompt_token_ids=request_prompt)
        async for delta in core.generate(request):
            streamed.extend(delta.token_ids)
            if not killed and delta.worker_id == decode.worker_id and delta.token_ids:
                assert len(streamed) <= 1 + steps  # mid-stream, by construction
                ray.kill(decode.handle, no_restart=False)
                killed = True
        counters = dataclasses.replace(core.counters)
        await until_alive(core, decode)
        # Restarted by Ray with its role: the next request is handed to it again.
        after, finals = await run_request(core, request_prompt, greedy(12))
        await assert_cluster_clean(core)
        await core.close()
        return streamed, killed, counters, after[0], finals[0].worker_id, decode.worker_id

    streamed, killed, counters, after, last_worker, decode_id = asyncio.run(main())
    assert killed and streamed == hf_reference.greedy(request_prompt, 40)
    # Handed over once, then replayed (on the prefill worker, the one left) after the kill.
    assert counters.pd_handoffs == 1 and counters.replays == 1
    assert after == streamed[:12] and last_worker == decode_id
