"""Helpers for cluster tests: a multi-node Ray cluster, worker groups and leak checks."""

from __future__ import annotations

import asyncio
import time

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.router import RouterCore
from pagedserve.cluster.router_types import GenerateRequest
from pagedserve.cluster.worker_group import start_worker_group
from pagedserve.workers.engine_config import EngineConfig
from pagedserve.workers.sampling_params import SamplingParams

WORKER_RESOURCE = "pagedserve_test_worker"
TEST_MODEL = "tiny-llama"


def cluster_config(
    name: str, num_workers: int = 2, engine: dict | None = None, **overrides
) -> ClusterConfig:
    engine_options = {
        "model": TEST_MODEL,  # explicit: the default model is the real (slower) SmolLM2
        "block_size": 8,
        "num_kv_blocks": 192,
        "attention_backend": "torch",
        **(engine or {}),
    }
    engine = EngineConfig(**engine_options)
    return ClusterConfig(
        engine=engine,
        num_workers=num_workers,
        name=name,
        worker_num_cpus=0.5,
        worker_resources={WORKER_RESOURCE: 1.0},
        stats_interval_s=0.2,
        rpc_timeout_s=10.0,
        **overrides,
    )


async def start_router(config: ClusterConfig) -> RouterCore:
    index, workers = start_worker_group(config)
    core = RouterCore(config, index, workers)
    await core.start()
    return core


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def run_request(core: RouterCore, token_ids: list[int], params: SamplingParams, **kwargs):
    """Returns (token ids per branch, final deltas)."""
    tokens: dict[int, list[int]] = {}
    finals = {}
    request = GenerateRequest(params=params, prompt_token_ids=token_ids, **kwargs)
    async for delta in core.generate(request):
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
        if delta.finish_reason is not None:
            finals[delta.index] = delta
    return tokens, finals


async def assert_pools_clean(core: RouterCore, deadline_s: float = 10.0) -> None:
    """Every alive worker: no request left, every block free or cached, invariants hold."""
    end = time.monotonic() + deadline_s
    for worker in core.workers.values():
        if not worker.alive:
            continue
        while True:
            result = await worker.handle.check_pool.remote()
            if result.clean:
                break
            assert time.monotonic() < end, f"{worker.worker_id} pool not clean: {result}"
            await asyncio.sleep(0.1)
