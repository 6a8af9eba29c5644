"""`pagedserve bench ray-hop` end to end at a tiny size: every transport delivers every message
between two real actors, and each run has a figure for both ends."""

from __future__ import annotations

import math

from pagedserve.bench.ray_hop import TRANSPORTS, run_hops


def test_every_transport_delivers_every_message_and_is_measured(ray_cluster):
    runs = run_hops(messages=5, period_s=0.0, repeats=2, idle_s=0.2)
    assert [r.transport for r in runs] == list(TRANSPORTS) * 2  # alternated
    for run in runs:
        assert run.messages == 5 and run.wall_s > 0
        assert math.isfinite(run.consumer_ms) and math.isfinite(run.producer_ms)
