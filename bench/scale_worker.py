"""Model-free simulated workers for `pagedserve bench scale`: real block pools, real KV events.

`SimWorkerCore` (no Ray) is one simulated worker: it owns a real `KVCacheManager` (no KV
tensors: the manager never needs any), admits requests first come first served, allocates
their blocks with prefix caching, "computes" each step by sleeping `step_s`, emits one
deterministic fake token per running request per step, frees the blocks when a request ends
and hands every step's real KV events (`BlockPool.take_events`) to its sink with the pool's
`next_event_seq`, exactly as `workers/worker/actor.py` publishes them.

`SimWorkerHost` is the Ray actor that hosts several cores in one process (8 by default, so
64 workers are 8 processes, not 64: on a 2-core machine 64 Python processes would spend the
cores on Ray's per-process threads and heartbeats, not on the work being measured). Each
core has its own step loop on the host's event loop, its own epoch and event sequence.

`SimWorkerHandle` is what `RouterCore` and the prefix index get for one simulated worker: it
looks like a `Worker` actor handle (`submit`, `channel`, `set_paused`, `generate`, `ready`,
`stats`, `renew_lease`, `abort`, `kv_snapshot`, `check_pool`) and sends each call to its host
with the worker's slot, so routing, streaming through the channels, liveness and the index's
resync run unchanged. As on a real worker, a router's requests stream back through its one
channel per worker, a `StepBatch` per step (`workers/worker/stream.py`'s `OwnerChannel`), and a
channel that closes frees its owner's requests.

What is not simulated: leases (`renew_lease` is a no-op), pauses (`set_paused` is a no-op:
the router asks, nothing waits), heartbeats, drain, migration, preemption (a running request
whose next block does not fit waits a step), sampling and stop strings (every request decodes
exactly `max_tokens`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from pagedserve.workers.deadline import within
from pagedserve.workers.kv.block_hash import cache_key
from pagedserve.workers.kv.checks import KVInvariantError, assert_no_leaks
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.events import KVEvent, KVSnapshot
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.stats import PoolCheck, WorkerInfo, WorkerStats
from pagedserve.workers.protocol.stream import FinishReason, StepBatch, StreamDelta, Usage
from pagedserve.workers.worker.stream import OwnerChannel

logger = logging.getLogger(__name__)

SIM_MODEL = "tiny-llama"  # what the workers report: the router hashes with it (ByteTokenizer)
VOCAB_SIZE = 256
# sink(worker_id, epoch, events, next_seq): the pool's events of one step, in order.
EventSink = Callable[[str, str, list[KVEvent], int], None]


@dataclass(frozen=True)
class SimWorkerConfig:
    """One simulated worker's shape: its pool and how long a step 'computes'."""

    num_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 4096
    step_s: float = 0.02


@dataclass(eq=False)  # identity: `in self.waiting` must not compare token lists
class SimRequest:
    """One request on a simulated worker (what `KVCacheManager` needs, plus its stream)."""

    request_id: str
    all_token_ids: list[int]
    cache_extra_keys: tuple[str, ...]
    num_prompt_tokens: int
    max_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cached_tokens: int = 0
    admitted: bool = False
    finished: bool = False
    owner_id: str | None = None  # the router replica that sent it
    channel: OwnerChannel | None = None  # its owner's channel (None: its own `queue`)

    def send(self, delta: StreamDelta) -> None:
        if self.channel is not None:
            self.channel.put(delta)
        else:
            self.queue.put_nowait(delta)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


def fake_token(position: int) -> int:
    """The deterministic token a simulated worker 'samples' at `position`."""
    return (position * 7919) % VOCAB_SIZE


class SimWorkerCore:
    """Owns one simulated worker's `KVCacheManager`, its waiting and running requests and its
    step loop.

    Args:
        worker_id: the worker's cluster-wide name.
        config: pool shape and step time.
        sink: where each step's KV events go (None: kept in the pool, unpublished).
    """

    def __init__(
        self, worker_id: str, config: SimWorkerConfig, sink: EventSink | None = None
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.epoch = uuid.uuid4().hex
        self.sink = sink
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.max_model_len)
        self.waiting: deque[SimRequest] = deque()
        self.running: dict[str, SimRequest] = {}
        self.num_steps = 0
        self._channels: dict[str, OwnerChannel] = {}  # owner id → its channel
        self._wake = asyncio.Event()
        self._loop: asyncio.Task | None = None

    # ------------------------------------------------------------------ steps
    def step(self) -> list[tuple[SimRequest, StreamDelta]]:
        """One engine step without a model: admit what fits, grow every running request by
        one token, end those at `max_tokens`. Returns the deltas to send."""
        self._admit()
        deltas = []
        for request in list(self.running.values()):
            # Decode: the last token's KV is computed this step; a request with no block for
            # it waits a step (no preemption here).
            if request.admitted and self.kv.allocate_slots(request, 1) is None:
                continue
            request.admitted = True
            deltas.append((request, self._emit(request)))
        self.num_steps += 1
        return deltas

    def _admit(self) -> None:
        while self.waiting:
            request = self.waiting[0]
            computed = self.kv.get_computed_blocks(request)
            new_tokens = len(request.all_token_ids) - computed.num_tokens
            if self.kv.allocate_slots(request, new_tokens, computed) is None:
                return  # first come first served: nothing overtakes the head
            self.waiting.popleft()
            request.cached_tokens = computed.num_tokens
            self.running[request.request_id] = request

    def _emit(self, request: SimRequest) -> StreamDelta:
        token = fake_token(len(request.all_token_ids))
        request.all_token_ids.append(token)
        done = request.num_output_tokens >= request.max_tokens
        if not done:
            return StreamDelta(request.request_id, 0, [token], "", worker_id=self.worker_id)
        usage = Usage(request.num_prompt_tokens, request.num_output_tokens, request.cached_tokens)
        self._finish(request)
        return StreamDelta(
            request.request_id,
            0,
            [token],
            "",
            finish_reason=FinishReason.LENGTH,
            usage=usage,
            worker_id=self.worker_id,
        )

    def _finish(self, request: SimRequest) -> None:
        """The one place a request's blocks are freed (finished, aborted or cancelled)."""
        if request.finished:
            return
        request.finished = True
        self.running.pop(request.request_id, None)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)

    def publish_events(self) -> None:
        events = self.kv.pool.take_events()
        if events and self.sink is not None:
            self.sink(self.worker_id, self.epoch, events, self.kv.pool.next_event_seq)

    # ------------------------------------------------------------------- loop
    def start(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()

    async def _run(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.config.step_s)  # the forward this step stands for
            for request, delta in self.step():
                request.send(delta)
            self.publish_events()

    # --------------------------------------------------------------- requests
    def submit(self, request: WorkerRequest) -> SimRequest:
        """Queue one fresh request (token-id prompt) for the next step's admission."""
        if request.handoff is not None or isinstance(request.prompt, str):
            raise ValueError("simulated workers take fresh token-id prompts only")
        if request.request_id in self.running:
            raise ValueError(f"request {request.request_id} is already running here")
        extra = cache_key(SIM_MODEL, request.cache_salt)
        prompt = list(request.prompt)
        sim = SimRequest(request.request_id, prompt, extra, len(prompt), request.params.max_tokens)
        sim.owner_id = request.owner_id
        self.waiting.append(sim)
        self._wake.set()
        return sim

    def submit_to_channel(self, request: WorkerRequest) -> None:
        """Queue a request whose deltas go out through its owner's channel (`channel`)."""
        if request.owner_id is None:
            raise ValueError("a request streamed through a channel needs its owner_id")
        self.submit(request).channel = self._channel_of(request.owner_id)

    def _channel_of(self, owner_id: str) -> OwnerChannel:
        if owner_id not in self._channels:
            self._channels[owner_id] = OwnerChannel(owner_id, self.worker_id)
        return self._channels[owner_id]

    async def channel(self, owner_id: str) -> AsyncIterator[StepBatch]:
        """Every delta of `owner_id`'s requests, a batch per step (as `WorkerCore.channel`);
        once the owner stops reading, its requests are freed."""
        channel = self._channel_of(owner_id)
        reader = channel.attach()
        try:
            while (batch := await channel.next_batch(reader)) is not None:
                yield batch
        finally:
            if channel.detach(reader):  # not superseded: the owner is gone
                self._channels.pop(owner_id, None)
                for request in [*self.waiting, *self.running.values()]:
                    if request.channel is channel:
                        self._finish(request)
                self.publish_events()

    async def generate(self, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        """Stream one fresh request's deltas (one token each); freed when it ends or the
        reader goes away."""
        sim = self.submit(request)
        try:
            while True:
                delta = await sim.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not sim.finished:  # the reader left early: free its blocks now
                self._finish(sim)
                self.publish_events()

    def abort(self, request_id: str) -> bool:
        request = self.running.get(request_id) or next(
            (r for r in self.waiting if r.request_id == request_id), None
        )
        if request is None:
            return False
        self._finish(request)
        request.send(
            StreamDelta(
                request_id, 0, [], "", finish_reason=FinishReason.ABORT, worker_id=self.worker_id
            )
        )
        self.publish_events()
        return True

    # ------------------------------------------------------------------ state
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            epoch=self.epoch,
            model=SIM_MODEL,
            block_size=self.config.block_size,
            vocab_size=VOCAB_SIZE,
            max_model_len=self.config.max_model_len,
            num_blocks=self.config.num_blocks,
            pid=os.getpid(),
        )

    def stats(self, owner_id: str | None = None) -> WorkerStats:
        """As `WorkerCore.stats`: with `owner_id`, that owner's requests held here too."""
        held = [*self.waiting, *self.running.values()]
        owned = sorted(r.request_id for r in held if owner_id and r.owner_id == owner_id)
        return WorkerStats(
            worker_id=self.worker_id,
            owned_requests=tuple(owned),
            epoch=self.epoch,
            kv=self.kv.usage(),
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_steps=self.num_steps,
            num_streams=len(self.waiting) + len(self.running),
            events_published=self.kv.pool.num_events_published,
        )

    def kv_snapshot(self) -> KVSnapshot:
        self.publish_events()  # events below next_seq are reflected in the snapshot
        pool = self.kv.pool
        return KVSnapshot(self.worker_id, self.epoch, pool.next_event_seq, tuple(pool.cached))

    def check_pool(self) -> PoolCheck:
        idle = not self.waiting and not self.running
        try:
            if idle:
                assert_no_leaks(self.kv)
        except KVInvariantError as error:
            return PoolCheck(ok=False, idle=idle, error=str(error))
        return PoolCheck(ok=True, idle=idle)


# ---------------------------------------------------------------------- the Ray side

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
    async def channel(self, slot: int, owner_id: str) -> AsyncIterator[StepBatch]:
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
