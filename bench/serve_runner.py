"""Send a planned workload at its arrival times and time every stream; front-end agnostic.

`run_workload` takes two callables, so the same timing code drives the gRPC client
(`bench serve`) and an in-process `RouterCore` (`bench ablate`):

    send(planned)  -> async iterator of `Delta`   one request's stream
    poll()         -> KV sample dict             cluster stats, sampled every `poll_interval_s`
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.bench.serve_metrics import Delta, RequestRecord, measure
from pagedserve.bench.serve_workload import PlannedRequest
from pagedserve.workers.deadline import within

Send = Callable[[PlannedRequest], AsyncIterator[Delta]]
Poll = Callable[[float], Awaitable[dict[str, Any]]]


@dataclass
class RunResult:
    """Every request's record (failures included), KV samples and the throughput window."""

    records: list[RequestRecord]
    kv_samples: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    poll_errors: int = 0


async def run_workload(
    workload: list[PlannedRequest],
    send: Send,
    poll: Poll | None = None,
    *,
    max_concurrency: int | None = None,
    poll_interval_s: float = 0.25,
    progress: bool = False,
    error_reason: Callable[[BaseException], str] = lambda e: f"{type(e).__name__}: {e}",
) -> RunResult:
    """Send each request at its arrival time (at most `max_concurrency` open at once).

    Args:
        workload: the requests, arrival times relative to the first.
        send: opens one request's stream.
        poll: returns one KV sample given seconds since the start (None: no sampling).
        max_concurrency: open streams at most (None: unbounded).
        poll_interval_s: seconds between KV samples.
        progress: show a tqdm bar of finished requests.
        error_reason: turns an exception into the record's `error` text.

    Returns:
        The run's records in workload order, KV samples, and its duration.
    """
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(workload), disable=not progress, unit="req", desc="bench")
    result = RunResult(records=[])
    t0 = time.monotonic() + 0.05  # every task is scheduled before the first arrival
    done = asyncio.Event()
    sampler = None
    if poll:
        sampler = asyncio.create_task(_sample(poll, t0, poll_interval_s, done, result))

    async def one(planned: PlannedRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + planned.arrival_s - time.monotonic()))
        record = RequestRecord(
            planned.index,
            planned.arrival_s,
            len(planned.token_ids),
            planned.max_tokens,
            planned.group,
        )
        if limit:
            await limit.acquire()
        try:
            record.send_delay_s = time.monotonic() - (t0 + planned.arrival_s)
            await measure(record, lambda: send(planned), error_reason)
        finally:
            if limit:
                limit.release()
            bar.update(1)
        return record

    try:
        result.records = list(await asyncio.gather(*(one(p) for p in workload)))
    finally:
        result.duration_s = time.monotonic() - t0
        done.set()
        if sampler:
            await sampler
        bar.close()
    return result


async def _sample(poll: Poll, t0: float, interval: float, done: asyncio.Event, result) -> None:
    """Poll stats until the run is done, and once more after it (the idle pool)."""
    while True:
        try:
            result.kv_samples.append(await poll(time.monotonic() - t0))
        except Exception:  # a slow or failed poll must not end the run; counted
            result.poll_errors += 1
        if done.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await within(done.wait(), interval)
