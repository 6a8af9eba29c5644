"""The CI soak: 190 requests with shared prefixes, n > 1, cancellations, short deadlines,
slow readers and every kind of bad input (each twice: seed 6), on a pool small enough to
preempt and move; one worker killed mid-run, one KV event batch lost, one burst past the
router's limit. Then the checks of `tests/support/soak/checks.py`: outputs as if run alone,
none hung, pools clean, index in step, counters true. Long soaks are `python -m support.soak`
(docs/development.md).

Own module so that the shared Ray cluster is clean when it starts: every worker slot is free.
"""

import asyncio
import time
from collections import Counter

from support.cluster import cluster_config, start_router
from support.soak.checks import check_soak, reference_outputs
from support.soak.driver import BAD_INPUTS, SoakSpec, plan_requests, run_soak

from pagedserve.cluster.pool.group import stop_worker_group

SPEC = SoakSpec(num_requests=150, seed=6, concurrency=12, burst_size=40, hang_timeout_s=60.0)


def test_the_load_holds_every_request_kind():
    """What the seed was chosen for (no cluster needed)."""
    steady, _ = plan_requests(SPEC)
    kinds = Counter(r.kind for r in steady)
    assert min(kinds[k] for k in ("ok", "cancel", "deadline", "bad", "slow")) >= 5, kinds
    bad = Counter(r.bad_input for r in steady if r.kind == "bad")
    assert set(bad) == set(BAD_INPUTS) and min(bad.values()) >= 2, bad
    assert sum(r.params.n > 1 for r in steady) >= 10


def test_soak_with_chaos(ray_cluster):
    config = cluster_config(
        "t-soak",
        num_workers=2,
        engine={"num_kv_blocks": 24, "max_num_seqs": 8, "preemption_mode": "move"},
        max_waiting_per_worker=16,
        max_inflight=24,
        retry_after_s=0.5,
    )

    async def main():
        core = await start_router(config)
        report = await run_soak(core, SPEC)
        started = time.monotonic()
        references = reference_outputs(config.engine, report)
        print(f"references: {time.monotonic() - started:.1f} s")
        problems = await check_soak(core, report, references)
        router = (await core.cluster_stats()).router
        await core.close()
        return report, problems, router

    try:
        report, problems, router = asyncio.run(main())
    finally:
        stop_worker_group(config)
    summary = report.summary()
    print(summary)
    assert not problems, "\n".join(problems[:20])
    statuses = summary["statuses"]
    assert summary["requests"] >= SPEC.num_requests + SPEC.burst_size
    assert statuses.get("hung", 0) == 0
    # Steady clients send a refused request again after its retry hint, so each one that
    # asked for nothing unusual finishes, however long a loaded machine takes to drain the
    # burst's backlog (without retries the share refused swung with the machine's speed).
    unfinished = [
        (o.request.index, o.request.kind, o.status)
        for o in report.outcomes
        if o.request.kind in ("ok", "slow") and o.status != "finished"
    ]
    assert not unfinished, unfinished
    assert statuses["rejected"] > 0 and statuses["cancelled"] > 0
    assert statuses.get("refused", 0) > 0  # the burst (which never retries) met backpressure
    assert set(report.faults) == {"kill", "drop_events", "burst"}
    assert len({o.request.tenant for o in report.outcomes}) == SPEC.num_tenants
    assert router.moves > 0  # the small pool preempted by moving to the peer
