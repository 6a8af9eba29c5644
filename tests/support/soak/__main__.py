"""The soak: a long chaotic run on a local cluster, then the soak checks.

A test harness, not a benchmark: it injects faults through the workers' test-only hooks
(`fault_injection: true`, `workers/worker/fault_injection.py`). The suite runs bounded forms of
it (`tests/integration/test_soak.py`, `test_soak_grpc.py`); long runs start here, from the
repository root:

    PYTHONPATH=tests .venv/bin/python -m support.soak --num-requests 2000 --json soak.json

Two front ends, the same load (`driver.py`: shared prefixes, n > 1, cancellations,
short deadlines, bad inputs, a small pool that forces preemption and moves):

- `--front-end core` (default): a worker group on a local Ray and a `RouterCore` in this
  process; faults: a worker kill, a lost KV event batch, a burst past the router's limit; then
  every check of `checks.py`.
- `--front-end grpc`: Serve's gRPC proxy and the Router deployment on a local Ray, driven with
  raw gRPC calls (`grpc_soak.py`); faults: a burst past the router's and the workers'
  limits, duplicate-id pairs, a Router replica kill and a prefix index kill; then the checks
  of `grpc_checks.py` and `checks.check_pools_and_index`.

Exits 1 when any check found a problem.

    python -m support.soak --num-requests 2000 --json soak.json
    python -m support.soak --prefill-workers 1 --decode-workers 1 --tiers   # P/D and KV tiers
    python -m support.soak --front-end grpc --num-requests 1000 --json soak-grpc.json
    python -m support.soak --front-end grpc --prefill-workers 1 --decode-workers 1 --tiers
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import time
from typing import Any

# `--tiers`: with tiny-llama at 8 tokens a block (16 KiB of KV), a host tier of 48 blocks (twice
# the core soak's device pool), so that its LRU demotes to disk well within a run.
TIERS_HOST_BYTES = 48 * 16 * 1024
TIERS_DISK_BYTES = 16 << 20


def parser() -> argparse.ArgumentParser:
    from support.soak.driver import SoakSpec

    d = SoakSpec()
    parser = argparse.ArgumentParser(
        prog="python -m support.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--num-requests", type=int, default=2000, help="steady requests (a burst comes on top)")
    add("--concurrency", type=int, default=d.concurrency, help="steady requests open at once")
    add("--burst-size", type=int, default=d.burst_size, help="requests the burst sends at once")
    add("--seed", type=int, default=d.seed, help="the workload's seed")
    add("--front-end", choices=("core", "grpc"), default="core", help="what the load drives")
    add("--num-workers", type=int, default=2, help="worker actors")
    add(
        "--router-replicas",
        type=int,
        default=2,
        help="Router replicas (grpc front end; the router-kill fault kills one)",
    )
    add("--num-kv-blocks", type=int, help="KV blocks per worker (core: 24, grpc: 64)")
    add("--block-size", type=int, default=8, help="tokens per KV block")
    add("--max-inflight", type=int, default=24, help="router: requests streamed at most")
    add("--max-waiting", type=int, help="worker: new requests queued at most (core: 16, grpc: 6)")
    add("--no-faults", action="store_true", help="no kill, event loss or burst")
    add(
        "--tiers",
        action="store_true",
        help=f"KV host tier ({TIERS_HOST_BYTES >> 10} KiB) and disk tier "
        f"({TIERS_DISK_BYTES >> 20} MiB, a temporary directory) on every worker",
    )
    add("--prefill-workers", type=int, default=0, help="P/D: prefill workers of the pool")
    add("--decode-workers", type=int, default=0, help="P/D: decode workers of the pool")
    add(
        "--stall-at",
        type=float,
        default=None,
        help="core: also stall a worker's engine at this fraction of the run (off by default)",
    )
    add("--json", default=None, help="write the summary and problems here")
    return parser


def start_ray() -> None:
    """A fresh local Ray (never someone else's cluster on this machine)."""
    import ray

    from pagedserve.cluster.serve.ray_startup import allow_slow_startup

    allow_slow_startup()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)


def run(args: argparse.Namespace) -> int:
    if args.front_end == "grpc":
        return _run_grpc(args)

    from pagedserve.cluster.config import (
        ClusterConfig,
        FailureConfig,
        LimitsConfig,
        PlacementConfig,
        ScalingConfig,
    )
    from pagedserve.cluster.pool.group import stop_worker_group
    from pagedserve.workers.engine.config import EngineConfig
    from support.soak.driver import SoakSpec

    no_faults = ("kill_at", "stall_at", "drop_events_at", "burst_at")
    faults = dict.fromkeys(no_faults) if args.no_faults else {}
    if args.stall_at is not None:
        faults["stall_at"] = args.stall_at
    spec = SoakSpec(
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        burst_size=args.burst_size,
        seed=args.seed,
        **faults,
    )
    tier_dir, tiers = _tier_options(args.tiers)
    config = ClusterConfig(
        engine=EngineConfig(
            model="tiny-llama",
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks or 24,
            attention_backend="torch",
            max_num_seqs=8,
            preemption_mode="move",
            **tiers,
        ),
        name="pagedserve-soak",
        scaling=ScalingConfig(
            num_workers=args.num_workers,
            prefill_workers=args.prefill_workers,
            decode_workers=args.decode_workers,
        ),
        placement=PlacementConfig(worker_num_cpus=0.5),
        failure=FailureConfig(
            fault_injection=True,  # the soak stalls workers and drops event batches
            stats_interval_s=0.2,
            stall_timeout_s=5.0,  # the stall fault lasts until the router judged it
        ),
        limits=LimitsConfig(
            max_inflight=args.max_inflight,
            max_waiting_per_worker=args.max_waiting or 16,
            retry_after_s=0.5,
        ),
    )
    start_ray()
    try:
        result = asyncio.run(_soak(config, spec))
    finally:
        stop_worker_group(config)
        if tier_dir is not None:
            tier_dir.cleanup()
    print(json.dumps(result["summary"], indent=2))
    for problem in result["problems"][:50]:
        print("PROBLEM:", problem)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 1 if result["problems"] else 0


async def _soak(config, spec) -> dict[str, Any]:
    from pagedserve.cluster.pool.group import start_worker_group
    from pagedserve.cluster.router.config import RouterConfig
    from pagedserve.cluster.router.router import RouterCore
    from support.soak.checks import check_soak, reference_outputs
    from support.soak.driver import run_soak

    index, workers = start_worker_group(config)
    core = RouterCore(RouterConfig.of(config), index, workers)
    await core.start()
    try:
        report = await run_soak(core, spec, log=print)
        started = time.monotonic()
        references = reference_outputs(config.engine, report)
        problems = await check_soak(core, report, references)
        stats = await core.cluster_stats()
    finally:
        await core.close()
    summary = {
        **report.summary(),
        "checks_s": round(time.monotonic() - started, 1),
        "router": stats.router.as_dict(),
        "limits": dataclasses.asdict(stats.limits),
        "index": dataclasses.asdict(stats.index) if stats.index is not None else None,
        "workers": {wid: _worker_summary(w.stats) for wid, w in stats.workers.items()},
        "tiers": {wid: _tier_summary(w.stats) for wid, w in stats.workers.items()},
        "latency_s_max": round(max(o.latency_s for o in report.outcomes), 2),
    }
    return {"summary": summary, "problems": problems}


def _worker_summary(stats: Any) -> dict[str, Any]:
    """A worker's steps, role and handoffs (out: moves and P/D; in: adopted with or without
    their KV)."""
    names = ("num_steps", "num_handoffs", "event_batches_dropped", "role")
    summary = {k: getattr(stats, k, None) for k in names}
    summary["role"] = str(summary["role"])
    for k in ("adopted_with_kv", "adopted_recomputed"):
        summary[k] = getattr(stats, k, None)
    scheduler = getattr(stats, "scheduler", None)
    summary["prefill_handoffs"] = getattr(scheduler, "prefill_handoffs", None)
    return summary


def _tier_summary(stats: Any) -> dict[str, Any] | None:
    """A worker's loads and per-tier traffic (None: no tiers, or no stats yet)."""
    tiers = getattr(stats, "tiers", None)
    if tiers is None or not tiers.tiers:
        return None
    per_tier = {
        u.tier: {
            k: getattr(u, k)
            for k in ("blocks", "stored_blocks", "hit_blocks", "evicted_blocks", "dropped_blocks")
        }
        for u in tiers.tiers
    }
    return {"loads": tiers.loads, "loaded_blocks": tiers.loaded_blocks, **per_tier}


def _tier_options(on: bool) -> tuple[tempfile.TemporaryDirectory | None, dict[str, Any]]:
    """`--tiers`: a temporary directory for the disk tier (the caller cleans it up) and the
    engine options of both tiers; (None, {}) without the flag."""
    if not on:
        return None, {}
    tier_dir = tempfile.TemporaryDirectory(prefix="pagedserve-soak-kv-")
    options = {
        "kv_host_tier_bytes": TIERS_HOST_BYTES,
        "kv_disk_tier_dir": tier_dir.name,
        "kv_disk_tier_bytes": TIERS_DISK_BYTES,
    }
    return tier_dir, options


def _run_grpc(args: argparse.Namespace) -> int:
    import sys

    from support.soak.driver import SoakSpec
    from support.soak.grpc_soak import GrpcSoakSpec, grpc_soak_config, soak_over_grpc

    load = SoakSpec(
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        burst_size=args.burst_size,
        seed=args.seed,
        burst_at=None if args.no_faults else GrpcSoakSpec().load.burst_at,
    )
    faults = dict.fromkeys(("dup_at", "router_kill_at", "index_kill_at")) if args.no_faults else {}
    spec = GrpcSoakSpec(load=load, **faults)
    tier_dir, tiers = _tier_options(args.tiers)
    config = grpc_soak_config(
        num_workers=args.num_workers,
        router_replicas=args.router_replicas,
        num_kv_blocks=args.num_kv_blocks or 64,
        block_size=args.block_size,
        max_inflight=args.max_inflight,
        max_waiting=args.max_waiting or 6,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        tiers=tiers,
    )
    command = "python -m support.soak " + " ".join(sys.argv[1:])
    try:
        report, problems, summary = soak_over_grpc(config, spec, command, log=print)
    finally:
        if tier_dir is not None:
            tier_dir.cleanup()
    print(json.dumps(summary, indent=2))
    for problem in problems[:50]:
        print("PROBLEM:", problem)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "problems": problems}, f, indent=2, default=str)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(run(parser().parse_args()))
