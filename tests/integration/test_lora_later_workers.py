"""A LoRA adapter loaded at run time reaches a worker that joins later (`RouterLoras`:
`follow_loras`): on a one-worker pool, the adapter is loaded, the worker is killed for good,
and the pool's replacement, which starts with `lora_modules` only, is given the adapter by the
router from the path the lost worker reported, and serves it with the same greedy output; an
unload then removes it everywhere, and the leak check ends the test."""

import asyncio

import pytest
import ray
from support.cluster import assert_cluster_clean, cluster_config, greedy, run_request, start_router
from support.wait import until

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.cluster.pool.types import MemberState
from pagedserve.workers.protocol.errors import UnknownLora

PROMPT = list(range(30, 45))
MAX_TOKENS = 8


def test_a_replacement_worker_serves_an_adapter_loaded_at_run_time(ray_cluster, lora_adapters):
    adapter = lora_adapters["mlp8"]
    expected = adapter.reference.greedy(PROMPT, MAX_TOKENS)  # HF + PEFT's merged model
    config = cluster_config("t-lora-join", num_workers=1, scale_interval_s=0.1)
    replacement = config.actors.worker_name(1)

    async def main():
        core = await start_router(config)
        await core.load_lora("mlp8", adapter.path)
        before, _ = await run_request(core, PROMPT, greedy(MAX_TOKENS), lora="mlp8")
        (victim,) = core.workers.values()
        ray.kill(victim.handle, no_restart=True)  # dead for good: the pool replaces it

        async def healed():
            stats = await core.membership.pool.stats.remote()
            serving = stats.membership.in_state(MemberState.SERVING)
            state = core.workers.get(replacement)
            return (
                list(serving) == [replacement]
                and state is not None
                and state.routable
                and "mlp8" in core.lora_adapters()
            )

        def explain() -> str:
            return f"workers {sorted(core.workers)}, adapters {core.lora_adapters()}, " + str(
                core.counters.as_dict()
            )

        await until(healed, "the replacement to serve the run-time adapter", explain=explain)
        after, finals = await run_request(core, PROMPT, greedy(MAX_TOKENS), lora="mlp8")
        healed_count = core.counters.lora_healed
        await core.unload_lora("mlp8")
        stats = await core.workers[replacement].handle.stats.remote()
        with pytest.raises(UnknownLora, match="'mlp8'"):
            await run_request(core, PROMPT, greedy(MAX_TOKENS), lora="mlp8")
        await assert_cluster_clean(core)
        known = dict(core.lora_known)
        await core.close()
        return before[0], after[0], finals[0].worker_id, healed_count, stats, known

    try:
        before, after, served_by, healed_count, stats, known = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert before == after == expected
    assert served_by == replacement and healed_count == 1
    assert stats.lora_adapters == () and known == {}  # unloaded everywhere, not given again
