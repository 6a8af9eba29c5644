"""The Ray side of `pagedserve bench scale`'s simulated workers (`bench/scale_worker.py`).

`SimWorkerHost` is the Ray actor that hosts several cores in one process (8 by default, so
64 workers are 8 processes, not 64: on a 2-core machine 64 Python processes would spend the
cores on Ray's per-process threads and heartbeats, not on the work being measured). Each
core has its own step loop on the host's event loop, its own epoch and event sequence.

`SimWorkerHandle` is what `RouterCore` and the prefix index get for one simulated worker: it
looks like a `Worker` actor handle (`submit`, `channel`, `set_paused`, `generate`, `ready`,
`stats`, `renew_lease`, `abort`, `kv_snapshot`, `check_pool`) and sends each call to its host
with the worker's slot, so routing, streaming through the channels, liveness and the index's
resync run unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray

from pagedserve.bench.scale_worker import SimWorkerConfig, SimWorkerCore
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.events import KVEvent, KVSnapshot
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.stats import PoolCheck, WorkerInfo, WorkerStats
from pagedserve.workers.protocol.stream import StepBatch, StreamDelta

logger = logging.getLogger(__name__)

# As `workers/worker/actor.py` (not imported: it pulls torch into every host process).
INDEX_CALL_TIMEOUT_S = 30.0  # an index call must never hang a worker
STREAM_BACKPRESSURE_OBJECTS = 8


class _Method:
    """`handle.<name>.remote(*args)` for one simulated worker: its host's method, slot first."""

    def __init__(self, host: Any, name: str, slot: int) -> None:
        self.host, self.name, self.slot = host, name, slot

    def remote(self, *args: Any) -> Any:
        return getattr(self.host, self.name).remote(self.slot, *args)


class SimWorkerHandle:
    """What the router and the index hold for one simulated worker (picklable: a host
    handle and a slot)."""

    def __init__(self, host: Any, slot: int) -> None:
        self.host = host
        self.slot = slot

    def __getstate__(self) -> dict[str, Any]:
        return {"host": self.host, "slot": self.slot}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.host, self.slot = state["host"], state["slot"]

    submit = property(lambda self: _Method(self.host, "submit", self.slot))
    channel = property(lambda self: _Method(self.host, "channel", self.slot))
    set_paused = property(lambda self: _Method(self.host, "set_paused", self.slot))
    generate = property(lambda self: _Method(self.host, "generate", self.slot))
    ready = property(lambda self: _Method(self.host, "ready", self.slot))
    stats = property(lambda self: _Method(self.host, "stats", self.slot))
    renew_lease = property(lambda self: _Method(self.host, "renew_lease", self.slot))
    abort = property(lambda self: _Method(self.host, "abort", self.slot))
    kv_snapshot = property(lambda self: _Method(self.host, "kv_snapshot", self.slot))
    check_pool = property(lambda self: _Method(self.host, "check_pool", self.slot))


class SimWorkerHost:
    """The Ray actor hosting `len(worker_ids)` simulated workers in one process.

    Owns their cores and publishes each core's events to the prefix index as `Worker` does:
    a batch with `next_seq`, not awaited; an answer saying the index lost us re-registers.

    Args:
        worker_ids: one name per simulated worker; slot i is `worker_ids[i]`.
        config: every worker's shape.
        index: the prefix index actor handle.
    """

    def __init__(self, worker_ids: list[str], config: SimWorkerConfig, index: Any) -> None:
        self._index = index
        self.cores = [SimWorkerCore(wid, config, self._publish) for wid in worker_ids]
        self.events_published = 0

    def _publish(self, worker_id: str, epoch: str, events: list[KVEvent], next_seq: int) -> None:
        self.events_published += len(events)
        ref = self._index.publish.remote(worker_id, epoch, events, next_seq)
        asyncio.get_running_loop().create_task(self._check_published(ref, worker_id))

    async def _check_published(self, ref: Any, worker_id: str) -> None:
        try:
            result = await within(ref, INDEX_CALL_TIMEOUT_S)
        except Exception:  # lost or late: the index may have lost us
            result = None
        if result is None or (result.needs_resync and not result.resynced):
            slot = next(i for i, c in enumerate(self.cores) if c.worker_id == worker_id)
            await self._register(slot)

    async def _register(self, slot: int) -> None:
        me = SimWorkerHandle(ray.get_runtime_context().current_actor, slot)
        try:
            await within(
                self._index.register_worker.remote(
                    self.cores[slot].worker_id, me, self.cores[slot].epoch
                ),
                INDEX_CALL_TIMEOUT_S,
            )
        except Exception as error:
            logger.warning("could not register with the prefix index (%r)", error)

    async def ready(self, slot: int) -> WorkerInfo:
        self.cores[slot].start()
        await self._register(slot)
        return self.cores[slot].info()

    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE_OBJECTS)
    async def generate(self, slot: int, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        async for delta in self.cores[slot].generate(request):
            yield delta

    async def submit(self, slot: int, request: WorkerRequest) -> None:
        self.cores[slot].submit_to_channel(request)

    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE_OBJECTS)
    async def channel(
        self, slot: int, owner_id: str, lane: object = None
    ) -> AsyncIterator[StepBatch]:
        """Every batch through Ray: a simulated worker connects no lane (`lane` unused)."""
        async for batch in self.cores[slot].channel(owner_id):
            yield batch

    async def set_paused(self, slot: int, request_id: str, paused: bool, seq: int) -> None:
        return None  # no pauses in the simulation

    async def abort(self, slot: int, request_id: str) -> bool:
        return self.cores[slot].abort(request_id)

    async def stats(self, slot: int, owner_id: str | None = None) -> WorkerStats:
        return self.cores[slot].stats(owner_id)

    async def renew_lease(self, slot: int, owner_id: str) -> None:
        return None  # no leases in the simulation

    async def kv_snapshot(self, slot: int) -> KVSnapshot:
        return self.cores[slot].kv_snapshot()

    async def check_pool(self, slot: int) -> PoolCheck:
        return self.cores[slot].check_pool()

    async def host_cpu_s(self) -> float:
        """This process's CPU seconds so far (user + system)."""
        times = os.times()
        return times.user + times.system

    async def events_total(self) -> int:
        return self.events_published


def start_sim_workers(
    num_workers: int, per_host: int, config: SimWorkerConfig, index: Any, prefix: str = "sim"
) -> tuple[list[Any], dict[str, SimWorkerHandle]]:
    """Start ceil(num_workers / per_host) hosts; returns (hosts, {worker_id: handle})."""
    from pagedserve.cluster.pool.group import WORKER_MAX_CONCURRENCY

    remote_host = ray.remote(SimWorkerHost)
    hosts, handles = [], {}
    for first in range(0, num_workers, per_host):
        ids = [f"{prefix}-{i}" for i in range(first, min(num_workers, first + per_host))]
        host = remote_host.options(num_cpus=0, max_concurrency=WORKER_MAX_CONCURRENCY).remote(
            ids, config, index
        )
        hosts.append(host)
        handles.update({wid: SimWorkerHandle(host, slot) for slot, wid in enumerate(ids)})
    return hosts, handles
