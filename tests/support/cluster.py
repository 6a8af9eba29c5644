"""Helpers for cluster tests: a router in this process over a worker group, and requests.

Every router built here is watched by the session's leak check (support/leaks.py): it is
checked after each test and when its worker group stops.
"""

from __future__ import annotations

import asyncio
import time

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.router import RouterCore
from pagedserve.cluster.router_types import GenerateRequest
from pagedserve.cluster.worker_group import start_worker_group
from pagedserve.workers.engine_config import EngineConfig
from pagedserve.workers.sampling_params import SamplingParams
from pagedserve.workers.telemetry import NOOP, TelemetryConfig, Tracing
from support.leaks import DEADLINE_S, cluster_problems, in_process_router

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
    # Test clusters stay at Ray's niceness (15), as before `worker_nice` / `control_nice` came
    # in: a test run on a shared machine must not take the cores from a server's engine.
    overrides.setdefault("worker_nice", None)
    overrides.setdefault("control_nice", None)
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


async def start_router(
    config: ClusterConfig, telemetry: TelemetryConfig | None = None, tracing: Tracing = NOOP
) -> RouterCore:
    """A router in this process over the (new or existing) worker group of `config`, started."""
    index, workers = start_worker_group(config, telemetry)
    core = RouterCore(config, index, workers, tracing)
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


async def assert_cluster_clean(core: RouterCore, deadline_s: float = DEADLINE_S) -> None:
    """The leak check, now, of the cluster behind `core` (see `support.leaks`): its in-flight
    table empty, every worker's pool idle and clean, the index equal to the pools. Waits (the
    event loop runs on meanwhile) up to `deadline_s` for requests still being aborted."""
    end = time.monotonic() + deadline_s
    while problems := cluster_problems(core.config, [in_process_router(core)]):
        assert time.monotonic() < end, "cluster not clean:\n  " + "\n  ".join(problems)
        await asyncio.sleep(0.1)
