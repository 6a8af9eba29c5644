"""Speculative decoding's numbers where users read them: GetStats, /metrics, and the flags."""

from __future__ import annotations

import argparse
import dataclasses

from pagedserve.cluster.api.grpc.convert import stats_to_proto
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.index.stats import IndexStats
from pagedserve.cluster.router.metrics import RouterMetrics
from pagedserve.cluster.router.types import (
    BackpressureLimits,
    ClusterStats,
    RouterCounters,
    WorkerView,
)
from pagedserve.cluster.serve import cli
from pagedserve.workers.protocol.stats import KVUsage, SpecStats, WorkerStats


def worker(worker_id: str, spec: SpecStats) -> WorkerStats:
    fields = {f.name: 0 for f in dataclasses.fields(KVUsage)}
    kv = KVUsage(**{**fields, "block_size": 8, "total_blocks": 10})
    return WorkerStats(worker_id=worker_id, epoch="e", kv=kv, spec=spec)


STATS = {
    "w0": worker("w0", SpecStats(4, 12, 6, 10, 0.5, 1.5, 2)),
    "w1": worker("w1", SpecStats(2, 6, 6, 8, 0.25, 0.5, 1)),
}


def test_get_stats_reports_acceptance_per_worker_and_summed():
    stats = ClusterStats(
        workers={wid: WorkerView(wid, True, 0, None, s) for wid, s in STATS.items()},
        router=RouterCounters(),
        limits=BackpressureLimits(None, None, 1.0),
        index=IndexStats(entries=0, max_entries=1, workers={}),
        policy="kv_aware",
    )
    message = stats_to_proto(stats)
    w0 = message.workers[0].spec
    assert (w0.num_draft_tokens, w0.num_accepted_tokens, w0.acceptance_rate) == (12, 6, 0.5)
    assert w0.mean_accepted_length == 2.5 and w0.draft_time_s == 0.5
    total = message.spec
    assert (total.num_verified, total.num_draft_tokens, total.num_accepted_tokens) == (6, 18, 12)
    assert total.acceptance_rate == 12 / 18 and total.mean_accepted_length == 3.0
    assert total.verify_time_s == 2.0


def test_metrics_show_acceptance():
    metrics = RouterMetrics(True, lambda: {wid: (True, s) for wid, s in STATS.items()})
    text = metrics.render().decode()
    assert 'pagedserve_spec_draft_tokens_total{worker="w0"} 12.0' in text
    assert 'pagedserve_spec_accepted_tokens_total{worker="w1"} 6.0' in text
    assert 'pagedserve_spec_acceptance_rate{worker="w0"} 0.5' in text
    assert 'pagedserve_spec_seconds_total{phase="verify",worker="w0"} 1.5' in text


def test_serve_flags_turn_speculation_on():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--speculative-method", "ngram", "--num-speculative-tokens", "3"]
    )
    config = ClusterConfig.from_dict(cli.cluster_config_from_args(args, 0))
    spec = config.worker_engine.speculative
    assert (spec.method, spec.num_tokens) == ("ngram", 3)
    plain = ClusterConfig.from_dict(cli.cluster_config_from_args(parser.parse_args(["serve"]), 0))
    assert plain.worker_engine.speculative is None
