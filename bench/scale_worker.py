"""Model-free simulated workers for `pagedserve bench scale`: real block pools, real KV events.

`SimWorkerCore` (no Ray) is one simulated worker: it owns a real `KVCacheManager` (no KV
tensors: the manager never needs any), admits requests first come first served, allocates
their blocks with prefix caching, "computes" each step by sleeping `step_s`, emits one
deterministic fake token per running request per step, frees the blocks when a request ends
and hands every step's real KV events (`BlockPool.take_events`) to its sink with the pool's
`next_event_seq`, exactly as `workers/worker/actor.py` publishes them. As on a real worker, a
router's requests stream back through its one channel per worker, a `StepBatch` per step
(`workers/worker/stream.py`'s `OwnerChannel`), and a channel that closes frees its owner's
requests.

The Ray side (the host actor that runs several cores in one process, and the handles the
router holds) is in `bench/scale_worker_host.py`.

What is not simulated: leases (`renew_lease` is a no-op), pauses (`set_paused` is a no-op:
the router asks, nothing waits), heartbeats, drain, migration, preemption (a running request
whose next block does not fit waits a step), sampling and stop strings (every request decodes
exactly `max_tokens`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedserve.workers.kv.block_hash import cache_key
from pagedserve.workers.kv.checks import KVInvariantError, assert_no_leaks
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.events import KVEvent, KVSnapshot
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.stats import PoolCheck, WorkerInfo, WorkerStats
from pagedserve.workers.protocol.stream import FinishReason, StepBatch, StreamDelta, Usage
from pagedserve.workers.worker.stream import OwnerChannel

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
