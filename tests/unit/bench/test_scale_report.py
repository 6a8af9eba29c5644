"""`bench scale`'s summaries: what a cell reports and which rate counts as held."""

from __future__ import annotations

import dataclasses

from pagedserve.bench.scale_report import (
    RequestResult,
    RouterRun,
    format_report,
    held_rate,
    summarize,
)


def _run(route_ms: float, e2e_s: float, error: str | None = None) -> RouterRun:
    requests = (
        RequestResult(0, e2e_s, 8, 100, 64),
        RequestResult(1, e2e_s, 8, 100, 0, error),
    )
    route = (route_ms / 1e3,) * 2
    return RouterRun(requests, route, route, cpu_s=0.02, view_entries=40, window_s=2.0)


def test_summary_counts_every_replica_and_the_oracle():
    cell = summarize(2, 64, 10.0, [_run(0.2, 0.1), _run(0.2, 0.1)], 256, 200, 1.0)
    assert (cell.completed, cell.errors) == (4, 0)
    assert cell.achieved_rps == 2.0
    assert cell.route_p50_ms == cell.route_p99_ms == 0.2
    assert cell.index_events_per_s == 100.0
    assert cell.view_entries_per_s == 20.0  # per view, not summed
    assert cell.router_cpu_ms_per_request == 10.0
    assert cell.router_cpu_us_per_token == 1250.0
    assert cell.hit_rate == 128 / 400
    assert cell.oracle_hit_rate == 256 / 400


def test_held_is_the_highest_rate_within_both_bounds_and_without_errors():
    base = summarize(1, 64, 10.0, [_run(0.2, 0.1)], 0, 0, 0.0)
    cells = [
        base,
        dataclasses.replace(base, offered_rps=20.0),
        dataclasses.replace(base, offered_rps=40.0, route_p99_ms=2.0),  # routing too slow
        dataclasses.replace(base, offered_rps=80.0, e2e_p99_ms=5000.0),  # workers fell behind
        dataclasses.replace(base, offered_rps=160.0, errors=1),
    ]
    assert held_rate(cells, route_p99_ms=1.0, e2e_p99_ms=1000.0).offered_rps == 20.0
    assert held_rate(cells, route_p99_ms=0.1, e2e_p99_ms=1000.0) is None
    assert "held at routing p99 <= 1.0 ms, e2e p99 <= 1000.0 ms: 20 req/s" in format_report(
        cells, 1.0, 1000.0
    )
