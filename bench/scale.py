"""`pagedserve bench scale`: the real routers over many simulated workers, no model.

Cluster: one real `PrefixIndexActor`; `--num-workers` simulated workers (`bench/scale_worker.py`:
a real `KVCacheManager` each, real KV events to the index, one fake token per request per
`--step-ms`), `--workers-per-host` of them per Ray actor process; and, for each count in
`--routers`, that many real `RouterCore` replicas, each in its own Ray actor process
(`bench/scale_router.py`) with its own prefix view following the index's feed.

Workload (as `bench routing`'s, seeded): K system prompts of S random tokens, each request one
of them plus U tokens of its own, open-loop Poisson arrivals at each rate of `--rates`, for
`--duration-s`; request i goes to replica i mod N. Every (replicas, rate) cell hashes with its
own cache salt, so each starts from cold caches as the oracle does. A router polls each worker
every `--stats-interval-s` (1 s here, 0.25 s by default in `ClusterConfig`: with 64 workers
and 4 replicas the default alone is ~2,000 calls/s on this machine's 2 cores).

Reported per cell: completed req/s, the routing decision (time inside `RouterCore.route`, in
the router process) p50/p99, end-to-end p50/p99, KV events/s applied by the index and feed
entries/s applied by each view, router process CPU per request and per output token, and the
prefix hit rate (Σ cached / Σ prompt tokens) beside the oracle's (one worker holding every
system prompt from its first use: the best any routing can do). "Held" is the highest rate
run with no error, routing p99 ≤ `--route-p99-ms` and end-to-end p99 ≤ `--e2e-p99-ms` (the
simulated workers kept up; unloaded, a request takes about (max_tokens + 1) steps). Routing
time is given as wall time and as the router thread's CPU time over the decision.

First, before any Ray process starts, the routing decision is timed alone in this process
(`bench/scale_route.py`, `--route-only` stops there), over a view filled from the same
workload by in-process simulated workers.

Every process shares this machine's cores: on a small machine the figures are a lower bound.

    $ pagedserve bench scale --json scale.json
"""

from __future__ import annotations

import argparse
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve.bench.bench_io import ensure_ray, positive_int, write_json
from pagedserve.bench.scale_report import ScaleSummary, format_report, summarize


@dataclass(frozen=True)
class ScaleBenchConfig:
    """One run's settings."""

    num_workers: int = 64
    workers_per_host: int = 8
    routers: tuple[int, ...] = (1, 2, 4)
    rates: tuple[float, ...] = (20.0, 40.0, 80.0)
    duration_s: float = 4.0
    num_system_prompts: int = 16
    system_prompt_len: int = 512
    user_len: int = 32
    max_tokens: int = 8
    step_ms: float = 20.0
    num_blocks: int = 1024
    block_size: int = 16
    stats_interval_s: float = 1.0
    route_p99_ms: float = 1.0
    e2e_p99_ms: float = 1000.0
    seed: int = 0


def cluster_config(config: ScaleBenchConfig) -> Any:
    """The routers' config: kv_aware (the default policy), no migrations (simulated workers
    hold no KV to move), polls every `stats_interval_s`."""
    from pagedserve.cluster.config import FailureConfig, LimitsConfig, RoutingConfig
    from pagedserve.cluster.router.config import RouterConfig
    from pagedserve.workers.engine.config import EngineConfig

    return RouterConfig(
        engine=EngineConfig(model="tiny-llama", block_size=config.block_size),
        routing=RoutingConfig(enable_pull=False, enable_push=False),
        failure=FailureConfig(stats_interval_s=config.stats_interval_s),
        limits=LimitsConfig(max_inflight=None),
    )


def workload(config: ScaleBenchConfig, rate: float) -> tuple[list[Any], int]:
    """The seeded requests of one rate and the oracle's cached tokens over them."""
    from pagedserve.bench.routing_workload import (
        RoutingBenchConfig,
        ideal_cached_tokens,
        make_workload,
    )

    shape = RoutingBenchConfig(
        num_requests=max(1, int(rate * config.duration_s)),
        request_rate=rate,
        num_system_prompts=config.num_system_prompts,
        system_prompt_len=config.system_prompt_len,
        user_len=config.user_len,
        max_tokens=config.max_tokens,
        seed=config.seed,
        block_size=config.block_size,
    )
    planned = make_workload(shape)
    ideal = ideal_cached_tokens(planned, config.system_prompt_len, config.block_size)
    return planned, sum(ideal)


def run_scale_bench(config: ScaleBenchConfig) -> tuple[list[ScaleSummary], int]:
    """Every (replicas, rate) cell on one worker group; returns the cells and how many
    simulated workers were not clean (busy or leaking) at the end."""
    import ray

    from pagedserve.bench.scale_worker import SimWorkerConfig
    from pagedserve.bench.scale_worker_host import start_sim_workers
    from pagedserve.cluster.index.prefix_index import PrefixIndexActor

    index = PrefixIndexActor.options(num_cpus=0, name=f"scale-index-{uuid.uuid4().hex}").remote()
    sim = SimWorkerConfig(config.num_blocks, config.block_size, step_s=config.step_ms / 1e3)
    hosts, handles = start_sim_workers(config.num_workers, config.workers_per_host, sim, index)
    cells: list[ScaleSummary] = []
    try:
        for num_routers in config.routers:
            cells += _run_replicas(config, num_routers, index, hosts, handles)
        unclean = _unclean_workers(handles)
    finally:
        for actor in (*hosts, index):
            ray.kill(actor)
    return cells, unclean


def _run_replicas(config, num_routers, index, hosts, handles) -> list[ScaleSummary]:
    import ray

    from pagedserve.bench.scale_router import ScaleRouter

    remote = ray.remote(ScaleRouter).options(num_cpus=0, max_concurrency=100_000)
    routers = [remote.remote(cluster_config(config), index, handles) for _ in range(num_routers)]
    try:
        alive = ray.get([r.start.remote() for r in routers])
        assert all(a == config.num_workers for a in alive), f"workers alive: {alive}"
        return [_run_cell(config, routers, index, hosts, rate) for rate in config.rates]
    finally:
        ray.get([r.close.remote() for r in routers])
        for router in routers:
            ray.kill(router)


def _run_cell(config, routers, index, hosts, rate: float) -> ScaleSummary:
    import ray

    planned, ideal = workload(config, rate)
    salt = f"r{len(routers)}-{rate:g}-{uuid.uuid4().hex[:6]}"
    plans = [
        [(p.index, p.arrival_s, p.token_ids) for p in planned[i :: len(routers)]]
        for i in range(len(routers))
    ]
    events_before = ray.get(index.stats.remote()).events_applied
    host_before = sum(ray.get([h.host_cpu_s.remote() for h in hosts]))
    start_at = time.time() + 0.5  # every replica has its plan before the first arrival
    calls = zip(routers, plans, strict=True)
    runs = ray.get([r.run.remote(plan, salt, config.max_tokens, start_at) for r, plan in calls])
    events = ray.get(index.stats.remote()).events_applied - events_before
    host_cpu = sum(ray.get([h.host_cpu_s.remote() for h in hosts])) - host_before
    return summarize(len(routers), config.num_workers, rate, runs, ideal, events, host_cpu)


def _unclean_workers(handles: dict[str, Any]) -> int:
    """Simulated workers not idle with a leak-free pool once every stream has ended."""
    import ray

    checks = ray.get([h.check_pool.remote() for h in handles.values()])
    return sum(not check.clean for check in checks)


# --- command line --------------------------------------------------------------------------


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag; the module docstring kept as written."""


def register(subparsers: argparse._SubParsersAction) -> None:
    d = ScaleBenchConfig()
    parser = subparsers.add_parser(
        "scale",
        help="the real routers (1, 2, 4 replicas) over many simulated, model-free workers",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--num-workers", type=positive_int, default=d.num_workers, help="simulated workers")
    add("--workers-per-host", type=positive_int, default=d.workers_per_host, help="per process")
    add("--routers", type=positive_int, nargs="+", default=list(d.routers), help="replica counts")
    add("--rates", type=float, nargs="+", default=list(d.rates), help="offered req/s, in turn")
    add("--duration-s", type=float, default=d.duration_s, help="arrivals per cell, seconds")
    add("--num-system-prompts", type=positive_int, default=d.num_system_prompts, help="K")
    add("--system-prompt-len", type=positive_int, default=d.system_prompt_len, help="S tokens")
    add("--user-len", type=int, default=d.user_len, help="U tokens of each request's own")
    add("--max-tokens", type=positive_int, default=d.max_tokens, help="output tokens each")
    add("--step-ms", type=float, default=d.step_ms, help="a simulated engine step's time")
    add("--num-blocks", type=positive_int, default=d.num_blocks, help="KV blocks per worker")
    add("--block-size", type=positive_int, default=d.block_size, help="tokens per block")
    add("--stats-interval-s", type=float, default=d.stats_interval_s, help="router poll period")
    add("--route-p99-ms", type=float, default=d.route_p99_ms, help="'held': routing bound")
    add("--e2e-p99-ms", type=float, default=d.e2e_p99_ms, help="'held': workers kept up")
    add("--seed", type=int, default=d.seed, help="seeds prompts and arrivals")
    add("--route-only", action="store_true", help="only time routing alone, in process")
    add("--ray-address", default=None, help="join this Ray cluster instead of a local one")
    add("--json", metavar="FILE", default=None, help="write config and cells")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = ScaleBenchConfig(
        num_workers=args.num_workers,
        workers_per_host=args.workers_per_host,
        routers=tuple(args.routers),
        rates=tuple(args.rates),
        duration_s=args.duration_s,
        num_system_prompts=args.num_system_prompts,
        system_prompt_len=args.system_prompt_len,
        user_len=args.user_len,
        max_tokens=args.max_tokens,
        step_ms=args.step_ms,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        stats_interval_s=args.stats_interval_s,
        route_p99_ms=args.route_p99_ms,
        e2e_p99_ms=args.e2e_p99_ms,
        seed=args.seed,
    )
    from pagedserve.bench.scale_route import format_route_cost, route_cost

    alone = route_cost(config, config.num_workers)
    print(format_route_cost(alone))
    cells, unclean = [], 0
    if not args.route_only:
        ensure_ray(args.ray_address)
        cells, unclean = run_scale_bench(config)
        print(format_report(cells, config.route_p99_ms, config.e2e_p99_ms))
        print(f"\nsimulated workers not clean at the end: {unclean}")
    if args.json:
        cells_json = [asdict(c) for c in cells]
        write_json(
            args.json, {"config": asdict(config), "route_alone": asdict(alone), "cells": cells_json}
        )
    return 0 if unclean == 0 and all(c.errors == 0 for c in cells) else 1
