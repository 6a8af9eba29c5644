"""Prometheus exposes each worker's host and disk KV tiers: occupancy, hits, bytes moved."""

from __future__ import annotations

from pagedserve.cluster.router.metrics import _WorkerCollector
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.stats import TierStats, TierUsage, WorkerStats


def test_tier_occupancy_hits_and_bytes_are_exported():
    tiers = TierStats(
        (
            TierUsage("host", blocks=3, bytes=300, capacity_bytes=400, hit_blocks=2, bytes_out=200),
            TierUsage("disk", blocks=5, bytes=600, capacity_bytes=1000, stored_blocks=5),
        )
    )
    stats = WorkerStats("w0", "e1", KVCacheManager(4, 2, 8).usage(), tiers=tiers)
    families = {f.name: f for f in _WorkerCollector(lambda: {"w0": (True, stats)}).collect()}
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for name in families
        if name.startswith("pagedserve_kv_tier")
        for s in families[name].samples
    }
    assert samples[("pagedserve_kv_tier_blocks", "host")] == 3
    assert samples[("pagedserve_kv_tier_bytes", "disk")] == 600
    assert samples[("pagedserve_kv_tier_hit_blocks_total", "host")] == 2
    assert samples[("pagedserve_kv_tier_bytes_out_total", "host")] == 200
    assert samples[("pagedserve_kv_tier_stored_blocks_total", "disk")] == 5
