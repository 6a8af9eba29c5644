"""Cluster-wide router counters (`cluster/router/reports.py`): every replica's latest report
summed, a replica gone silent folded into the retired totals (which never go back), and
GetStats built from the sum whichever replica answers."""

from __future__ import annotations

import dataclasses

from support.clock import ManualClock

from pagedserve.cluster.api.grpc.convert import stats_to_proto
from pagedserve.cluster.router.reports import RouterReport, RouterReports
from pagedserve.cluster.router.tenant_quotas import TenantCounts
from pagedserve.cluster.router.types import (
    BackpressureLimits,
    ClusterStats,
    RouterCounters,
    WorkerView,
)


def counters(**values) -> RouterCounters:
    return RouterCounters(**values)


def test_counters_add_every_field_and_policy():
    total = counters(routed={"kv_aware": 2}, moves=1, replays=3)
    total.add(counters(routed={"kv_aware": 1, "round_robin": 4}, moves=2, refused_router=5))
    assert total == counters(
        routed={"kv_aware": 3, "round_robin": 4}, moves=3, replays=3, refused_router=5
    )
    maps = ("routed", "tenants")
    every = [f.name for f in dataclasses.fields(RouterCounters) if f.name not in maps]
    ones = counters(**{name: 1 for name in every})
    twice = counters()
    twice.add(ones)
    twice.add(ones)
    assert twice == counters(**{name: 2 for name in every})  # no field left out of `add`


def test_counters_add_and_flatten_each_tenants_counts():
    fields = [f.name for f in dataclasses.fields(TenantCounts)]
    total, other = counters(), counters()
    total.tenant("a").admitted = 2
    other.tenants = {"a": TenantCounts(**dict.fromkeys(fields, 1)), "": TenantCounts(admitted=3)}
    total.add(other)
    assert total.tenants["a"] == TenantCounts(**{**dict.fromkeys(fields, 1), "admitted": 3})
    flat = total.as_dict()
    assert flat["tenant.a.admitted"] == 3 and flat["tenant.a.output_tokens"] == 1
    assert flat["tenant.anonymous.admitted"] == 3  # auth off: the one tenant ""


def test_reports_sum_the_live_replicas_and_keep_the_gone_ones_counts():
    clock = ManualClock()
    reports = RouterReports(clock)
    reports.put(RouterReport("a", counters(routed={"kv_aware": 5}, moves=1), {"w0": 2}, 10.0))
    reports.put(RouterReport("b", counters(routed={"kv_aware": 3}), {"w0": 1, "w1": 4}, 10.0))
    cluster = reports.cluster()
    assert cluster.replicas == ("a", "b") and cluster.inflight == {"w0": 3, "w1": 4}
    assert cluster.counters == counters(routed={"kv_aware": 8}, moves=1)
    reports.put(RouterReport("a", counters(routed={"kv_aware": 6}, moves=1), {}, 10.0))  # newer
    assert reports.cluster().counters.routed == {"kv_aware": 9}
    clock.now = 5.0
    reports.put(RouterReport("b", counters(routed={"kv_aware": 4}), {}, 10.0))
    clock.now = 12.0  # a is silent past its expiry: gone, its counts kept, its load not
    cluster = reports.cluster()
    assert cluster.replicas == ("b",) and cluster.inflight == {}
    assert cluster.counters == counters(routed={"kv_aware": 10}, moves=1)
    clock.now = 100.0
    assert reports.cluster().counters == counters(routed={"kv_aware": 10}, moves=1)
    assert reports.cluster().replicas == ()
    # b was only stalled: its next report (cumulative) replaces its retired counts.
    reports.put(RouterReport("b", counters(routed={"kv_aware": 5}), {}, 10.0))
    assert reports.cluster().counters == counters(routed={"kv_aware": 11}, moves=1)


def test_get_stats_answers_with_the_cluster_sum_not_the_answering_replica_s_own():
    cluster = RouterReports()
    cluster.put(RouterReport("a", counters(routed={"kv_aware": 7}, pulls=2), {"w0": 3}))
    cluster.put(RouterReport("b", counters(routed={"kv_aware": 1}), {}))
    stats = ClusterStats(
        workers={"w0": WorkerView("w0", True, 0, None, None)},  # b has nothing open on w0
        router=counters(routed={"kv_aware": 1}),  # b's own
        limits=BackpressureLimits(None, None, 1.0),
        index=None,
        policy="kv_aware",
        cluster=cluster.cluster(),
    )
    message = stats_to_proto(stats)
    assert message.router_counters["routed.kv_aware"] == 8 and message.migrations.pulls == 2
    assert [w.inflight for w in message.workers] == [3]
    alone = stats_to_proto(dataclasses.replace(stats, cluster=None))  # the index did not answer
    assert alone.router_counters["routed.kv_aware"] == 1 and alone.workers[0].inflight == 0
