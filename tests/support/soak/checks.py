"""What a soak run must leave behind (see `driver.py`): each check returns the
problems it found, as sentences; an empty list means the run passed."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import ray

from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.deadline import within
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.protocol.events import TIER_NAMES
from pagedserve.workers.protocol.stats import PoolCheck
from support.soak.driver import Outcome, SoakReport, SoakRequest

# What each kind of request may end as; anything else is a problem.
ALLOWED = {
    "ok": {"finished", "refused"},
    "burst": {"finished", "refused"},
    "cancel": {"cancelled", "finished", "refused"},
    "deadline": {"timeout", "finished", "refused"},
    "bad": {"rejected", "refused"},
    "slow": {"finished", "refused"},
}


def reference_outputs(engine: EngineConfig, report: SoakReport) -> dict[int, list[int]]:
    """Each valid request that produced tokens, run alone offline (see `references_for`)."""
    return references_for(engine, [o.request for o in report.outcomes if o.tokens])


def references_for(engine: EngineConfig, requests: Iterable[SoakRequest]) -> dict[int, list[int]]:
    """Each valid request run alone, offline (greedy: every branch equals this one), by index.

    One engine in this process with the workers' config, one request at a time: no batching,
    prefix sharing, preemption or migration can touch the reference. It runs on one torch
    thread: beside the soak's workers on a loaded machine (load average ~10 on 2 cores),
    torch's threads waiting on each other at every op kept the gRPC soak's references running
    for over 10 minutes, past the test's time limit.
    """
    import torch

    from pagedserve.workers.offline.llm import LLM

    options = dataclasses.asdict(engine)
    options.update(max_waiting=None, preemption_mode="recompute")
    # Alone means no cache to hit either: and the workers' disk tier is not this engine's.
    options.update(kv_host_tier_bytes=0, kv_disk_tier_dir=None, kv_disk_tier_bytes=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(options.pop("model"), **options)
        references = {}
        for req in requests:
            if req.kind == "bad":
                continue
            params = dataclasses.replace(req.params, n=1)
            (output,) = llm.generate([req.token_ids], params)
            references[req.index] = list(output.outputs[0].token_ids)
    finally:
        torch.set_num_threads(threads)
    return references


def check_outcomes(report: SoakReport, references: dict[int, list[int]]) -> list[str]:
    problems = []
    for outcome in report.outcomes:
        req = outcome.request
        if outcome.status not in ALLOWED[req.kind]:
            problems.append(
                f"request {req.index} ({req.kind}, {req.bad_input}) ended {outcome.status}: "
                f"{outcome.error}"
            )
            continue
        problems.extend(_check_tokens(outcome, references.get(req.index)))
    return problems


def _check_tokens(outcome: Outcome, reference: list[int] | None) -> list[str]:
    req = outcome.request
    if not outcome.tokens:
        return []
    if outcome.status == "finished" and sorted(outcome.tokens) != list(range(req.params.n)):
        return [f"request {req.index} finished with branches {sorted(outcome.tokens)}"]
    problems = []
    for branch, tokens in outcome.tokens.items():
        exact = outcome.status == "finished"
        if (tokens != reference) if exact else (tokens != reference[: len(tokens)]):
            problems.append(
                f"request {req.index} branch {branch} ({outcome.status}) differs from the "
                f"request run alone: {tokens} vs {reference}"
            )
    return problems


def check_tenants(report: SoakReport) -> list[str]:
    """No request hit another tenant's cached prefix: a request that found cached tokens had
    a request of its own tenant with the same prefix that started before it ended (the only
    place those blocks can have come from)."""
    starts: dict[tuple[str, int], list[float]] = {}
    for o in report.outcomes:
        starts.setdefault((o.request.tenant, o.request.prefix), []).append(o.started)
    problems = []
    for o in report.outcomes:
        if not o.cached_tokens:
            continue
        own = [t for t in starts[(o.request.tenant, o.request.prefix)] if t != o.started]
        if not any(t < o.ended for t in own):
            problems.append(
                f"request {o.request.index} ({o.request.tenant}) found {o.cached_tokens} cached "
                f"tokens no request of its tenant can have left: a cross-tenant hit"
            )
    return problems


def check_counters(report: SoakReport, router: dict[str, int]) -> list[str]:
    """The router's counters against what the client saw."""
    problems = []
    seen_refused = report.refusals
    counted = router.get("refused.router", 0) + router.get("refused.worker", 0)
    if counted != seen_refused:
        problems.append(f"router counted {counted} refusals, the client saw {seen_refused}")
    if "kill" in report.faults:
        for name in ("workers_lost", "workers_restarted"):
            if router.get(name, 0) < 1:
                problems.append(f"a worker was killed but router counter {name} is 0")
        if report.faults["kill"]["inflight"] and router.get("replays", 0) < 1:
            problems.append("the killed worker had requests in flight but none replayed")
    stall = report.faults.get("stall")
    if stall is not None and not (stall["judged_stalled"] and router.get("workers_stalled")):
        problems.append(f"a worker's engine was hung but the router never judged it: {stall}")
    return problems


async def check_cluster(core: RouterCore, settle_s: float = 60.0) -> list[str]:
    """Every worker back and idle with a clean pool; the index agrees with every pool."""
    end = time.monotonic() + settle_s
    while not all(w.alive for w in core.workers.values()):
        if time.monotonic() > end:
            return ["a killed worker never rejoined"]
        await asyncio.sleep(0.2)
    problems = []
    if core.num_inflight or core._inflight_ids:
        held = list(core._inflight_ids)
        problems.append(f"router still holds {core.num_inflight} requests: {held}")
    workers = {w.worker_id: w.handle for w in core.workers.values()}
    left = max(end - time.monotonic(), 0.0)
    problems += await check_pools_and_index(
        workers, core.index, core.config.failure.rpc_timeout_s, left
    )
    return problems


async def check_pools_and_index(
    workers: dict[str, Any], index: Any, rpc_timeout_s: float, settle_s: float
) -> list[str]:
    """Each worker idle with a clean pool (`check_pool`: no block held, invariants hold) and the
    index's entries for it equal to its cached blocks (in every tier, as many per tier),
    within `settle_s`.

    Args:
        workers: worker id → actor handle.
        index: the prefix index actor.
        rpc_timeout_s: deadline of each call.
        settle_s: how long the cluster may take to get there.
    """
    end = time.monotonic() + settle_s
    problems = []
    for worker_id, handle in workers.items():
        last: Any = None
        while True:
            try:
                last = await _pool_and_index_of(worker_id, handle, index, rpc_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as error:
                # An actor still restarting (the index after its kill, on a loaded machine)
                # is not at rest yet: ask again until `settle_s` is spent.
                last = error
            else:
                pool, cached, held, tiers, indexed = last
                if pool.clean and cached == held and tiers == indexed:
                    break
            if time.monotonic() > end:
                if isinstance(last, Exception):
                    problems.append(f"{worker_id} or the index did not answer: {last!r}")
                else:
                    problems += _pool_problems(worker_id, *last)
                break
            await asyncio.sleep(0.2)
    return problems


async def _pool_and_index_of(
    worker_id: str, handle: Any, index: Any, rpc_timeout_s: float
) -> tuple[PoolCheck, set, set, dict, dict]:
    """A worker's pool check, its cached blocks and tier counts, and the index's of it."""
    pool = await within(handle.check_pool.remote(), rpc_timeout_s)
    snapshot = await within(handle.kv_snapshot.remote(), rpc_timeout_s)
    held = await within(index.snapshot_of.remote(worker_id), rpc_timeout_s)
    counts = await within(index.tier_counts.remote(worker_id), rpc_timeout_s)
    indexed = {tier: counts.get(tier, 0) for tier in TIER_NAMES}  # {}: not in the index
    return pool, set(snapshot.block_hashes), held, _tier_counts(snapshot), indexed


def _tier_counts(snapshot: Any) -> dict[str, int]:
    """Blocks per tier in a worker's snapshot, every tier named (as the index counts them)."""
    counts = Counter(snapshot.tiers())
    return {tier: counts[tier] for tier in TIER_NAMES}


def _pool_problems(
    worker_id: str, pool: PoolCheck, cached: set, held: set, tiers: dict, indexed: dict
) -> list[str]:
    problems = []
    if tiers != indexed:
        problems.append(f"index counts {indexed} blocks per tier of {worker_id}, it has {tiers}")
    if not pool.clean:
        problems.append(f"{worker_id} pool not clean: {pool}")
    if cached != held:
        problems.append(
            f"index disagrees with {worker_id}: {len(cached - held)} cached "
            f"blocks missing, {len(held - cached)} stale"
        )
    return problems


async def check_soak(
    core: RouterCore, report: SoakReport, references: dict[int, list[int]]
) -> list[str]:
    """All the checks; returns every problem found (empty: the soak passed)."""
    problems = check_outcomes(report, references)
    problems += check_tenants(report)
    problems += await check_cluster(core)
    stats = await core.cluster_stats()
    problems += check_counters(report, stats.router.as_dict())
    return problems
