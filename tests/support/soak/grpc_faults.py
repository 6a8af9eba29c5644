"""The faults the gRPC soak strikes at fixed points, each on a quiet cluster so that what it
must prove can be seen exactly:

- duplicate-id pairs: two concurrent `GenerateStream` calls with one `request_id`; exactly one
  runs (to its normal end: its tokens are checked against the request run alone with the other
  finished requests), the other gets INVALID_ARGUMENT before any delta.
- router kill (`grpc_router_kill.py`): the Router replica dies mid-stream
  (`ray.kill(..., no_restart=False)`); its streams must end UNAVAILABLE, no worker may keep
  decoding them past the router's lease (`orphans`), Serve must bring a replica back and new
  requests must succeed.
- index kill: the prefix index actor dies and Ray restarts it; with no request sent, its entries
  must equal the workers' cached blocks again within a bounded time.

(The burst past the limits runs alongside the steady load; see `grpc_soak.py`.)

Each fault returns a `FaultRecord`: what it saw (for the summary), the problems it found, and
the outcomes of the requests it sent (checked with all the others).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray

from pagedserve.cluster.client import AsyncClient
from support.soak.driver import SoakRequest
from support.soak.grpc_app import SoakApp
from support.soak.grpc_calls import GrpcOutcome, call_stream

POLL_S = 0.2  # how often a bounded wait looks again


@dataclass
class FaultRecord:
    """One fault: what it observed, what was wrong, and the requests it sent."""

    name: str
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    outcomes: list[GrpcOutcome] = field(default_factory=list)


async def wait_until(condition: Callable[[], Awaitable[Any]], timeout_s: float) -> tuple[bool, Any]:
    """Poll the async `condition` until it returns something truthy, at most `timeout_s`.

    Returns:
        (whether it held, its last value). A condition that raises counts as not holding.
    """
    end = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = await condition()
        except (ray.exceptions.RayError, TimeoutError) as error:
            last = error
        else:
            if last:
                return True, last
        if time.monotonic() > end:
            return False, last
        await asyncio.sleep(POLL_S)


async def router_counters(address: str) -> dict[str, int]:
    """The Router replicas' counters, summed over every replica (whichever one answers)."""
    async with AsyncClient(address, timeout=30) as client:
        stats = await client.stats()
    return dict(stats.router_counters)


# ---------------------------------------------------------------- duplicate id
async def duplicate_pair(
    channel: grpc.aio.Channel,
    first: SoakRequest,
    second: SoakRequest,
    hang_timeout_s: float,
    num_replicas: int = 1,
) -> FaultRecord:
    """Two concurrent streams with one request_id (and different prompts, so cross-talk shows).

    One Router replica refuses the second by id. With several, the two may land on two
    replicas: the second is then refused by the worker if both chose the same one, and both
    run if they chose two (each replica and each worker keeps ids unique; nothing shares them
    across replicas without a remote call per request), so two complete runs pass too, their
    outputs checked like every other request's. Never an INTERNAL, and never one ending the
    other (an abort by id of a refused request's id used to end the one that ran)."""
    request_id = f"soak-dup-{first.index}"
    record = FaultRecord("duplicate_id", {"request_id": request_id})
    outcomes = await asyncio.gather(
        call_stream(channel, first, hang_timeout_s, request_id=request_id),
        call_stream(channel, second, hang_timeout_s, request_id=request_id),
    )
    record.outcomes = list(outcomes)
    codes = sorted(o.code for o in outcomes)
    record.facts["codes"] = codes
    where = f"duplicate-id pair {request_id} (requests {first.index}, {second.index})"
    if num_replicas > 1 and codes == ["OK", "OK"]:
        for o in outcomes:
            if not o.finished:
                record.problems.append(f"{where}: one was cut off: {o.finish_reasons}")
        return record
    if codes != ["INVALID_ARGUMENT", "OK"]:
        record.problems.append(
            f"{where}: want one OK and one INVALID_ARGUMENT, got {_describe(outcomes)}"
        )
        return record
    ran = next(o for o in outcomes if o.code == "OK")
    refused = next(o for o in outcomes if o.code == "INVALID_ARGUMENT")
    if not ran.finished:
        record.problems.append(f"{where}: the one that ran was cut off: {ran.finish_reasons}")
    if refused.num_deltas:
        record.problems.append(
            f"{where}: the refused one streamed {refused.num_deltas} deltas before its error"
        )
    return record


# ------------------------------------------------------------------ index kill
async def index_kill(
    app: SoakApp, restart_timeout_s: float = 90.0, resync_timeout_s: float = 20.0
) -> FaultRecord:
    """Kill the prefix index (Ray restarts it empty, within `restart_timeout_s`: a new
    process, slow on a loaded machine); with no request sent, once back it must hold every
    worker's cached blocks again within `resync_timeout_s`."""

    def _pid(_actor: Any) -> int:
        """Run inside the actor by `__ray_call__`: which process serves it now. Defined here,
        so that Ray ships it by value: the actor's process cannot import `support`."""
        return os.getpid()

    record = FaultRecord("index_kill")
    index = await asyncio.to_thread(app.index_handle)
    workers = await asyncio.to_thread(app.worker_handles)
    cached = await _cached_blocks(workers)
    record.facts["cached_blocks"] = sum(len(c) for c in cached.values())
    if not record.facts["cached_blocks"]:
        record.problems.append("index kill: the workers cached nothing, so the kill proves nothing")
    pid = await index.__ray_call__.remote(_pid)
    await asyncio.to_thread(ray.kill, index, no_restart=False)
    killed_at = time.monotonic()

    async def restarted() -> bool:
        return await index.__ray_call__.remote(_pid) != pid

    back, _ = await wait_until(restarted, restart_timeout_s)
    if not back:
        record.problems.append(f"index kill: the index did not come back in {restart_timeout_s} s")
        return record
    back_at = time.monotonic()
    record.facts["back_after_s"] = round(back_at - killed_at, 1)

    async def in_step() -> bool:
        now = await _cached_blocks(workers)
        held = {wid: await index.snapshot_of.remote(wid) for wid in workers}
        record.facts["index_blocks"] = sum(len(h) for h in held.values())
        return all(held[wid] == now[wid] for wid in workers)

    synced, _ = await wait_until(in_step, resync_timeout_s)
    record.facts["resynced_after_s"] = round(time.monotonic() - back_at, 1) if synced else None
    if not synced:
        record.problems.append(
            f"index kill: {resync_timeout_s} s after its restart, with no new request, the "
            f"index holds {record.facts['index_blocks']} blocks, the workers cache "
            f"{record.facts['cached_blocks']}: it never resynced"
        )
    return record


async def _cached_blocks(workers: dict[str, Any]) -> dict[str, set[bytes]]:
    snapshots = await asyncio.gather(*(w.kv_snapshot.remote() for w in workers.values()))
    return {wid: set(s.block_hashes) for wid, s in zip(workers, snapshots, strict=True)}


def _describe(outcomes: list[GrpcOutcome]) -> str:
    return "; ".join(
        f"request {o.request.index}: {o.code} {o.details[:120]!r} after {o.num_deltas} deltas"
        for o in outcomes
    )
