"""Helpers for cluster tests: a router in this process over a worker group, and requests.

Every router built here is watched by the session's leak check (support/leaks.py): it is
checked after each test and when its worker group stops.
"""

from __future__ import annotations

import asyncio
import time

from pagedserve.cluster.config import ClusterConfig, nest
from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.group import create_pool
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.telemetry.telemetry import NOOP, TelemetryConfig, Tracing
from support.leaks import DEADLINE_S, cluster_problems, in_process_router
from support.wait import until

WORKER_RESOURCE = "pagedserve_test_worker"
TEST_MODEL = "tiny-llama"
PIN = 10_000_000  # router-side demand that makes a worker look full, to steer routing


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
    # Test clusters stay at the test run's niceness (tests/conftest.py), as before
    # `worker_nice` / `control_nice` came in: a test run on a shared machine must not take the
    # cores from a server's engine.
    overrides.setdefault("worker_nice", None)
    overrides.setdefault("control_nice", None)
    # Failure tests stall, refuse or drop through the workers' fault calls.
    overrides.setdefault("fault_injection", True)
    settings = {
        "num_workers": num_workers,
        "worker_num_cpus": 0.5,
        "worker_resources": {WORKER_RESOURCE: 1.0},
        "stats_interval_s": 0.2,
        "rpc_timeout_s": 10.0,
        **overrides,
    }
    # Overrides are field names, each taken into its section (`ClusterConfig.from_dict`).
    return ClusterConfig.from_dict({"engine": engine, "name": name, **nest(settings)})


async def start_router(
    config: ClusterConfig,
    telemetry: TelemetryConfig | None = None,
    tracing: Tracing = NOOP,
    config_revision: float = 0.0,
) -> RouterCore:
    """A router in this process over the (new or existing) worker group of `config`, started;
    it follows the pool's membership and hands it `config` at `config_revision`, as an app's
    Router replica does (`build_app` creates the actors, the core takes its first workers
    from the pool when it starts)."""
    index, pool = create_pool(config, telemetry)
    core = RouterCore(
        RouterConfig.of(config),
        index,
        {},
        tracing,
        pool=pool,
        pool_config=PoolConfig.of(config),
        config_revision=config_revision,
    )
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
    while problems := cluster_problems(core.membership.config, [in_process_router(core)]):
        assert time.monotonic() < end, "cluster not clean:\n  " + "\n  ".join(problems)
        await asyncio.sleep(0.1)


async def view_mirrors(core: RouterCore, *worker_ids: str) -> bool:
    """Whether the router's prefix view (what routing matches against) holds exactly the
    cached blocks of each of `worker_ids` (default: all of them), and some blocks at all.

    Starts `core` on the running loop first (a no-op when it runs there already), so that its
    feed follower runs on this loop too (a test may drive one core from several `asyncio.run`).
    """
    await core.start()
    held_any = False
    for worker_id in worker_ids or tuple(core.workers):
        cached = set((await core.workers[worker_id].handle.kv_snapshot.remote()).block_hashes)
        if core.view.hashes_of(worker_id) != cached:
            return False
        held_any = held_any or bool(cached)
    return held_any


async def until_view_mirrors(core: RouterCore, *worker_ids: str) -> None:
    """Wait until `view_mirrors(core, *worker_ids)`: the next request is routed on it."""
    await until(lambda: view_mirrors(core, *worker_ids), "the router's view to mirror the pools")
