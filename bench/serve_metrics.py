"""Per-request records and their summary, shared by `bench serve` (gRPC) and `bench ablate`.

Times are the client's (`time.monotonic`), from the moment a request is sent (after any wait for
`--max-concurrency`, recorded apart as `send_delay_s`):

    TTFT   sent → first delta carrying tokens
    ITL    gaps between deltas carrying tokens (a delta may carry several tokens)
    TPOT   (E2E − TTFT) / (output tokens − 1)
    E2E    sent → final delta
    queue  the worker's own queue time (arrival at the worker → first scheduled), from `metrics`

A request that fails (an RPC error, a refusal, a timeout, finish reason abort/timeout/error) is
kept with its reason; summaries count it and leave it out of the latency statistics only.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedserve.cluster.router.types import ClusterStats

OK_FINISH = ("stop", "length")
REFUSED_PREFIX = "RESOURCE_EXHAUSTED"  # how `bench serve` names a load refusal's error
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_time_s")


@dataclass
class Delta:
    """One streamed delta, whichever front end it came from (gRPC or `RouterCore`)."""

    num_tokens: int
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    queue_time_s: float | None = None
    worker_ttft_s: float | None = None
    preemptions: int | None = None
    worker_id: str | None = None
    error: str | None = None


@dataclass
class RequestRecord:
    """Everything measured about one request; `error` is set exactly when it failed."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    group: str | None = None
    send_delay_s: float | None = None
    queue_time_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    worker_ttft_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    preemptions: int | None = None
    migrations: int | None = None  # not exposed per request by the API: always None
    worker_id: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    failed_after_s: float | None = None  # sent → the error that ended it (a refusal: at once)

    @property
    def refused(self) -> bool:
        """Refused for load (RESOURCE_EXHAUSTED with a retry hint), as opposed to failed."""
        return self.error is not None and self.error.startswith(REFUSED_PREFIX)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in OK_FINISH


RECORD_FIELDS = tuple(RequestRecord.__dataclass_fields__)


async def measure(
    record: RequestRecord,
    stream: Callable[[], AsyncIterator[Delta]],
    error_reason: Callable[[BaseException], str],
) -> RequestRecord:
    """Consume one request's stream into `record`; any exception becomes its `error`."""
    start = time.monotonic()
    last = start
    try:
        async for delta in stream():
            now = time.monotonic()
            if delta.num_tokens:
                if record.ttft_s is None:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                last = now
                record.output_tokens += delta.num_tokens
            record.worker_id = delta.worker_id or record.worker_id
            if delta.finish_reason:
                _finish(record, delta, now - start)
    except Exception as error:  # kept as the record's reason; one failure never ends a run
        record.error = error_reason(error)
        record.failed_after_s = time.monotonic() - start
        record.finish_reason = record.finish_reason or "error"
    if record.error is None and record.finish_reason is None:
        record.error = "stream ended without a finish reason"
    return record


def _finish(record: RequestRecord, delta: Delta, e2e: float) -> None:
    record.e2e_s = e2e
    record.finish_reason = delta.finish_reason
    record.cached_tokens = delta.cached_tokens
    record.queue_time_s = delta.queue_time_s
    record.worker_ttft_s = delta.worker_ttft_s
    record.preemptions = delta.preemptions
    if delta.error or delta.finish_reason not in OK_FINISH:
        record.error = delta.error or f"finish_reason={delta.finish_reason}"
    if record.ttft_s is not None and record.output_tokens > 1:
        record.tpot_s = (e2e - record.ttft_s) / (record.output_tokens - 1)


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 (None each when there is nothing to summarise)."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    array = np.asarray(values, dtype=float)
    return {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
        "count": len(values),
    }


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """Latency distributions, throughput, goodput and failures of one run.

    Args:
        records: every request, failed ones included.
        duration_s: first send → last finish, the throughput window.
        slo_ttft_ms: goodput counts requests with TTFT at most this (None: no bound).
        slo_tpot_ms: ... and TPOT at most this (None: no bound; one-token outputs pass).

    Returns:
        Plain data (JSON-ready).
    """
    ok = [r for r in records if r.ok]
    failures: dict[str, int] = {}
    for record in records:
        if not record.ok:
            reason = (record.error or "unknown").split(":", 1)[0]
            failures[reason] = failures.get(reason, 0) + 1
    good = [r for r in ok if _meets_slo(r, slo_ttft_ms, slo_tpot_ms)]
    window = max(duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    latencies = {name: _values(ok, name) for name in LATENCIES}
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures_by_reason": failures,
        "duration_s": duration_s,
        "request_throughput": len(ok) / window,
        "output_token_throughput": output_tokens / window,
        "total_token_throughput": (output_tokens + prompt_tokens) / window,
        "goodput": len(good) / window,
        "goodput_fraction": len(good) / len(records) if records else 0.0,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "preemptions": sum(r.preemptions or 0 for r in ok),
        **{name: distribution(values) for name, values in latencies.items()},
        # How long a refused request waited for its refusal: router work only, or a queue.
        "refused": sum(r.refused for r in records),
        "refusal_s": distribution([r.failed_after_s for r in records if r.refused]),
    }


def _values(records: list[RequestRecord], name: str) -> list[float]:
    if name == "itl_s":
        return [gap for r in records for gap in r.itl_s]
    return [getattr(r, name) for r in records if getattr(r, name) is not None]


def _meets_slo(record: RequestRecord, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    if ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1e3 > ttft_ms):
        return False
    return not (tpot_ms is not None and record.tpot_s is not None and record.tpot_s * 1e3 > tpot_ms)


def record_dict(record: RequestRecord) -> dict[str, Any]:
    return {**asdict(record), "ok": record.ok}


# --- KV usage over time --------------------------------------------------------------------

KV_SAMPLE_FIELDS = (
    "t_s",
    "used_blocks",
    "total_blocks",
    "cached_free_blocks",
    "useful_tokens",
    "allocated_positions",
    "num_running",
    "num_waiting",
)


def kv_sample_from_pb(t_s: float, stats: Any) -> dict[str, float]:
    """One sample from a gRPC `GetStatsResponse` (KV summed over alive workers)."""
    kv = stats.kv
    return {
        "t_s": t_s,
        "used_blocks": kv.used_blocks,
        "total_blocks": kv.total_blocks,
        "cached_free_blocks": kv.cached_free_blocks,
        "useful_tokens": kv.useful_tokens,
        "allocated_positions": kv.allocated_positions,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
    }


def kv_sample_from_cluster(t_s: float, stats: ClusterStats) -> dict[str, float]:
    """One sample from `RouterCore.cluster_stats()`, summed over alive workers."""
    alive = [w.stats for w in stats.workers.values() if w.alive and w.stats is not None]
    sample = {"t_s": t_s}
    for name in KV_SAMPLE_FIELDS[1:6]:
        sample[name] = sum(getattr(w.kv, name) for w in alive)
    sample["num_running"] = sum(w.num_running for w in alive)
    sample["num_waiting"] = sum(w.num_waiting for w in alive)
    return sample
