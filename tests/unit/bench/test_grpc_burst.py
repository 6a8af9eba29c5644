"""`bench grpc-burst`'s verdict on each call and its summary (no server needed)."""

from __future__ import annotations

from pagedserve.bench.grpc_burst import CallOutcome, summarize


def outcome(code: str, details: str = "", retry_after: str | None = None, latency_s=1.0):
    return CallOutcome(code, details, retry_after, latency_s)


def test_only_served_refused_with_a_hint_or_named_errors_are_expected():
    assert outcome("OK").expected
    assert outcome("RESOURCE_EXHAUSTED", "the router streams its limit", "1").expected
    assert not outcome("RESOURCE_EXHAUSTED", "the router streams its limit").expected
    assert outcome("INVALID_ARGUMENT", "prompt is empty").expected
    assert not outcome("CANCELLED", "CANCELLED").expected  # gRPC dropped it, unnamed
    assert not outcome("UNAVAILABLE").expected


def test_summary_counts_codes_lists_the_unexpected_and_times_refusals():
    outcomes = [outcome("OK", latency_s=2.0)] * 3 + [
        outcome("RESOURCE_EXHAUSTED", "full", "1", latency_s=0.1),
        outcome("RESOURCE_EXHAUSTED", "full", "1", latency_s=0.3),
        outcome("CANCELLED", "CANCELLED", latency_s=0.05),
    ]
    summary = summarize(outcomes)
    assert summary["codes"] == {"OK": 3, "RESOURCE_EXHAUSTED": 2, "CANCELLED": 1}
    assert summary["unexpected"] == {"CANCELLED: 'CANCELLED'": 1}
    assert summary["refusal_ms"] == {"median": 200.0, "p99": 300.0}
    assert summary["latency_s"]["OK"] == [2.0, 2.0, 2.0]
