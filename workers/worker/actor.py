"""The worker actor: one engine per GPU (or CPU slot) in the cluster.

`Worker` is the Ray actor around `WorkerCore` (`workers/worker/core.py`, the logic, testable
without Ray): it joins the prefix index, streams deltas and serves the migration endpoints.

A router sends each request with `submit` and reads every request it sent here through one
`channel(owner_id)` call, opened once: a `StepBatch` per engine step with all of that router's
requests' messages. `generate` streams one request by itself (benchmarks, tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

import ray

from pagedserve.workers.deadline import within
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.process import drain_signal
from pagedserve.workers.process.core_share import CoreShare, board_path, usable_cores
from pagedserve.workers.process.cpu_placement import (
    niceness,
    pin_process,
    process_cpus,
    set_niceness,
)
from pagedserve.workers.process.pid_files import DEFAULT_PID_DIR, register_pid
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.protocol.events import KVEvent, KVSnapshot
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.lane import LaneAddress
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.protocol.stats import (
    DrainResult,
    LoraLoadResult,
    PoolCheck,
    WorkerInfo,
    WorkerStats,
)
from pagedserve.workers.protocol.stream import RequestMoved, StepBatch, StreamDelta, StreamMessage
from pagedserve.workers.telemetry.request_trace import migration_span
from pagedserve.workers.telemetry.telemetry import TelemetryConfig, worker_tracing
from pagedserve.workers.transfer import handoff_ref
from pagedserve.workers.worker.lane import connect as lane_connect
from pagedserve.workers.worker.lease import DEFAULT_LEASE_TIMEOUT_S
from pagedserve.workers.worker.stream import DEFAULT_MAX_BUFFERED_DELTAS, RUN_AHEAD_MESSAGES

logger = logging.getLogger(__name__)

# Deltas a `generate`/`adopt` stream may have produced and its caller not yet taken; past it
# Ray holds the generator at its `yield`, the stream's `DeltaBuffer` fills and the engine
# pauses the request. (Ray's default, -1, lets a generator run ahead of its reader without
# bound.) A generator held there is also closed by Ray when its caller dies.
STREAM_BACKPRESSURE_OBJECTS = RUN_AHEAD_MESSAGES
# Batches a `channel` may have sent and its router not yet taken; past it the channel's
# messages wait on the worker and go out together as the next batch. Backpressure is also what
# makes Ray close the generator at its next `yield` once the caller is dead (without it, Ray
# never does: measured with Ray 2.60), which is how a dead router's requests end at once.
# (It costs ~0.2 ms per message on each side over none; a batch per step makes that small.)
CHANNEL_BACKPRESSURE_OBJECTS = RUN_AHEAD_MESSAGES
# Deadline of each call to the prefix index (register, publish): it must never hang a worker.
INDEX_CALL_TIMEOUT_S = 30.0
# A worker drained on SIGTERM gives its open streams this long to finish (`ClusterConfig`).
DEFAULT_DRAIN_GRACE_S = 30.0
# After a drain on SIGTERM, how long the process stays up before it exits: Ray reports the
# handed-off streams' `HandedOff` to their callers after our generators have ended, and an
# exit at once would turn those into lost-worker errors (replayed all the same, but counted as
# a lost worker and without the drain's reason).
EXIT_LINGER_S = 1.0


class Worker:
    """The Ray actor: one engine per GPU (or CPU slot), named so peers and the router find it.

    Create it with `ray.remote(Worker).options(name=..., num_gpus=...)`; call `ready()` once.

    Args:
        worker_id: this worker's cluster-wide name.
        config: the engine config.
        index_name: the prefix index actor's name, or None to publish no events. Looked up by
            name (not passed as a handle) so that Ray can restart this actor after its creator
            is gone.
        namespace: the Ray namespace of the index.
        telemetry: tracing settings (tracing is off without them).
        lease_timeout_s: how long an owner's requests live without a renewal (see
            `workers/worker/lease.py`).
        max_buffered_deltas: deltas a stream buffers before its request is paused.
        cpus: the cores this worker's process is pinned to (None: not pinned); see
            `workers/process/cpu_placement.py`.
        nice: this worker's niceness (None: Ray's, 15).
        config_fingerprint: the fingerprint of the spec it was built from
            (`cluster/pool/spec.py`), reported in `WorkerInfo` so the worker pool can tell
            a worker of an older config from a current one.
        drain_grace_s: on SIGTERM, how long open streams get to finish before the rest are
            handed back (see `workers/process/drain_signal.py`); then the process exits.
        pid_dir: where this worker writes its pid file for `pagedserve drain-node` (None:
            none).
        role: its role in prefill/decode disaggregation (`workers/protocol/role.py`).
        share_cores: share this machine's cores with the app's other workers on it, each
            step on this worker's share of them (`workers/process/core_share.py`).
    """

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        index_name: str | None = None,
        namespace: str | None = None,
        telemetry: TelemetryConfig | None = None,
        *,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        max_buffered_deltas: int = DEFAULT_MAX_BUFFERED_DELTAS,
        cpus: tuple[int, ...] | None = None,
        nice: int | None = None,
        config_fingerprint: str = "",
        drain_grace_s: float = DEFAULT_DRAIN_GRACE_S,
        pid_dir: str | None = DEFAULT_PID_DIR,
        role: WorkerRole = WorkerRole.MIXED,
        share_cores: bool = False,
    ) -> None:
        # First: every thread the engine starts later inherits the mask and the niceness.
        if cpus is not None:
            pin_process(cpus, what=f"worker {worker_id}")
        if nice is not None:
            set_niceness(nice, what=f"worker {worker_id}")
        self.config_fingerprint = config_fingerprint
        self._index = ray.get_actor(index_name, namespace=namespace) if index_name else None
        sink = self._publish if self._index is not None else None
        tracing = worker_tracing(telemetry, worker_id)
        # The engine (torch, transformers, the kernels) is imported here, in the worker's own
        # process: the pool that creates workers (`cluster/pool/spec.py`) imports only this
        # class, and a control actor that imported torch paid seconds of CPU at every start.
        from pagedserve.workers.engine.engine import Engine
        from pagedserve.workers.worker.core import WorkerCore, engine_thread_executor

        # Built on the thread that will step it: its load runs OpenMP work too, and a second
        # thread doing so would slow every step (`WorkerCore._engine_thread`).
        engine_thread = engine_thread_executor()
        engine = engine_thread.submit(Engine, config.for_worker(worker_id), role=role).result()
        if config.tensor_parallel_size > 1:  # a rank that dies takes the worker down whole
            engine.runner.exit_process_on_failure()
        self.core = WorkerCore(
            engine,
            worker_id,
            sink,
            tracing,
            lease_timeout_s=lease_timeout_s,
            max_buffered_deltas=max_buffered_deltas,
            engine_thread=engine_thread,
            core_share=_core_share(namespace) if share_cores else None,
        )
        self.drain_grace_s = drain_grace_s
        self._held_kv = handoff_ref.HeldKV()  # KV handed off by ref, until fetched
        if pid_dir is not None:
            register_pid(worker_id, pid_dir)

    def _publish(self, worker_id: str, epoch: str, events: list[KVEvent]) -> None:
        """Send a batch to the index without waiting for it; its answer is checked aside.

        `next_seq` lets the index notice a lost batch even when it was the last one.
        """
        next_seq = self.core.engine.kv.pool.next_event_seq
        ref = self._index.publish.remote(worker_id, epoch, events, next_seq)
        asyncio.get_running_loop().create_task(self._check_published(ref, worker_id))

    async def _check_published(self, ref: Any, worker_id: str) -> None:
        """An index that restarted empty answers `needs_resync` without resyncing (it lost our
        handle): register again so that it pulls our snapshot."""
        try:
            result = await within(ref, INDEX_CALL_TIMEOUT_S)
        except Exception:  # lost, failed or past its deadline: the index may have lost us
            logger.warning("the prefix index did not take a KV event batch; registering again")
            result = None
        if result is None or (result.needs_resync and not result.resynced):
            await self._register()

    async def _register(self) -> bool:
        """Join the index (it resyncs from our snapshot), within a deadline: an index that
        is down or stuck must not hang the worker; a later publish registers again."""
        me = ray.get_runtime_context().current_actor
        try:
            await within(
                self._index.register_worker.remote(self.core.worker_id, me, self.core.epoch),
                INDEX_CALL_TIMEOUT_S,
            )
        except Exception as error:
            logger.warning("could not register with the prefix index (%r); serving on", error)
            return False
        return True

    async def ready(self) -> WorkerInfo:
        """Start the step loop, drain on SIGTERM from now on, and join the index (which
        resyncs from our snapshot)."""
        self.core.start()
        drain_signal.HANDLER.arm(asyncio.get_running_loop(), self._drain_on_sigterm)
        if self._index is not None:
            await self._register()
        return self.describe()

    def describe(self) -> WorkerInfo:
        """What the router needs to hash and validate exactly as this worker does."""
        engine = self.core.engine
        return WorkerInfo(
            worker_id=self.core.worker_id,
            epoch=self.core.epoch,
            model=engine.loaded.name,
            block_size=engine.kv.block_size,
            vocab_size=engine.loaded.vocab_size,
            max_model_len=engine.max_model_len,
            num_blocks=engine.kv.pool.num_blocks,
            num_threads=self.core.engine_threads or _torch_threads(),
            pid=os.getpid(),
            cpus=process_cpus(),
            nice=niceness(),
            config_fingerprint=self.config_fingerprint,
            role=engine.role,
            rank_pids=getattr(engine.runner, "rank_pids", ()),
        )

    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE_OBJECTS)
    async def generate(self, request: WorkerRequest) -> AsyncIterator[StreamDelta | RequestMoved]:
        """Streaming: call as `handle.generate.remote(request)` and iterate the
        ObjectRefGenerator; a `moved` request (`request.handoff`) continues here.

        `request.owner_id` (the router replica's id) ties the request to that owner's lease:
        it is aborted once the owner has not renewed (`stats(owner_id)`, `renew_lease`)
        within `lease_timeout_s`. None: no lease.
        """
        if request.handoff is not None:  # its KV, by reference, comes from the source now
            handoff = await self._fetched(request.handoff)
            deltas = self.core.adopt(handoff, request.trace_context, request.owner_id)
        else:
            deltas = self.core.generate(
                request.request_id,
                request.prompt,
                request.params,
                priority=request.priority,
                cache_salt=request.cache_salt,
                timeout_s=request.timeout_s,
                trace_context=request.trace_context,
                owner_id=request.owner_id,
                lora=request.lora,
            )
        async with aclosing(deltas):  # closed with this call: the request is aborted now
            async for delta in deltas:
                yield self._kv_by_reference(delta)

    async def submit(self, request: WorkerRequest) -> None:
        """Admit a request whose messages go out through the channel of `request.owner_id`
        (the router opens it once: `channel`). Returns once the engine took it; raises
        `RequestRejected`, `Overloaded` or `Draining` when it is refused. A moved request's KV
        is fetched from its source first.

        The owner's lease ties the request to its router as for `generate`; so does the
        channel: once it closes, the owner's requests are aborted."""
        if request.handoff is not None:
            request = dataclasses.replace(request, handoff=await self._fetched(request.handoff))
        await self.core.submit(request)

    @ray.method(_generator_backpressure_num_objects=CHANNEL_BACKPRESSURE_OBJECTS)
    async def channel(
        self, owner_id: str, lane: LaneAddress | None = None
    ) -> AsyncIterator[StepBatch]:
        """Streaming: every message of `owner_id`'s requests here, one `StepBatch` per engine
        step (see `WorkerCore.channel`). A newer call of the same owner supersedes this one.

        With a `lane` the owner listens on, the batches go there, numbered, and only one
        holding a `RequestMoved` (its KV by object reference) comes through this call; the
        lane closed by the owner ends the channel as the call's end would
        (`workers/protocol/lane.py`). A lane that cannot be reached: everything through
        here."""
        sender = await lane_connect(lane) if lane is not None else None
        numbers = itertools.count(1)
        try:
            async with aclosing(self.core.channel(owner_id)) as batches:
                async for batch in batches:
                    moved = any(isinstance(m, RequestMoved) for m in batch.messages)
                    if sender is not None:
                        batch = dataclasses.replace(batch, seq=next(numbers))
                        if not moved:
                            if not await sender.send(batch):
                                return  # the owner is gone: its requests here are aborted
                            continue
                    if moved:
                        messages = tuple(self._kv_by_reference(m) for m in batch.messages)
                        batch = dataclasses.replace(batch, messages=messages)
                    yield batch
        finally:
            if sender is not None:
                await sender.close()

    async def set_paused(self, request_id: str, paused: bool, seq: int) -> None:
        """The router's buffer of a channel's request filled up (pause) or drained (resume);
        `seq` orders its calls for that request (see `WorkerCore.set_paused`)."""
        self.core.set_paused(request_id, paused, seq)

    def _kv_by_reference(self, message: StreamMessage) -> StreamMessage:
        """A `RequestMoved` with its KV put in the object store: the router gets a ref, never
        the KV bytes. Any other message as it is."""
        if not isinstance(message, RequestMoved):
            return message
        handoff = handoff_ref.by_reference(message.handoff)
        self._held_kv.hold(handoff)  # until the target fetched it
        me = ray.get_runtime_context().current_actor
        handoff = dataclasses.replace(handoff, source_worker=message.worker_id, kv_owner=me)
        return dataclasses.replace(message, handoff=handoff)

    async def _fetched(self, handoff: RequestHandoff) -> RequestHandoff:
        faults = self.core.faults
        if handoff.packed_kv is not None and faults is not None and faults.take_kv_fetch_failure():
            handoff_ref.release_source(handoff)
            return handoff_ref.without_kv(handoff)
        return await handoff_ref.resolved(handoff)

    async def release_kv(self, key: str) -> None:
        """A target fetched the KV of a handoff from here (or gave up): stop holding it."""
        self._held_kv.release(key)

    async def load_lora(self, name: str, path: str) -> LoraLoadResult:
        """Load LoRA adapter `name` from `path` between steps; a failure names its cause and
        changes nothing (`workers/lora/`)."""
        return await self.core.load_lora(name, path)

    async def unload_lora(self, name: str) -> bool:
        """Unload adapter `name` (its running requests finish on it); False if not loaded."""
        return await self.core.unload_lora(name)

    async def abort(self, request_id: str) -> bool:
        return await self.core.abort(request_id)

    async def drain(self, grace_s: float) -> DrainResult:
        """Stop admitting (new requests get `Draining`), give open streams `grace_s` to finish,
        then end the rest for the router to replay. The caller then stops the actor."""
        return await self.core.drain(grace_s)

    async def close(self) -> None:
        """The shutdown path: stop stepping and flush the disk tier's queued writes, so that
        this worker restarted (by Ray, or a new deployment) finds its files. The caller then
        stops the actor."""
        await self.core.close()

    async def _drain_on_sigterm(self) -> None:
        result = await self.core.drain(self.drain_grace_s)
        logger.warning(
            "worker %s drained on SIGTERM: %d streams finished, %d handed back; exiting",
            self.core.worker_id,
            result.finished,
            result.handed_off,
        )
        await self.close()  # its disk tier's queued files written before the exit
        await asyncio.sleep(EXIT_LINGER_S)

    async def stats(self, owner_id: str | None = None) -> WorkerStats:
        """The worker's state; also renews `owner_id`'s lease (the router polls this)."""
        if owner_id is not None:
            self.core.renew_lease(owner_id)
        return dataclasses.replace(self.core.stats(owner_id), kv_held=len(self._held_kv))

    async def renew_lease(self, owner_id: str) -> None:
        self.core.renew_lease(owner_id)

    async def kv_snapshot(self) -> KVSnapshot:
        return await self.core.kv_snapshot()

    async def check_pool(self) -> PoolCheck:
        return await self.core.check_pool()

    async def export_prefix(self, block_hashes: Sequence[bytes]) -> tuple[list[BlockKey], Any]:
        return await self.core.export_prefix(block_hashes)

    async def import_prefix(self, keys: Sequence[BlockKey], packed: Any) -> int:
        return await self.core.import_prefix(keys, packed)

    async def push_candidates(self, max_chains: int) -> list[list[bytes]]:
        return await self.core.push_candidates(max_chains)

    async def hot_chains(self, max_blocks: int) -> list[list[bytes]]:
        """Its cached prefixes, hottest first, for a handover before it leaves the pool."""
        return await self.core.hot_chains(max_blocks)

    async def pull_prefix(
        self,
        peer: Any,
        block_hashes: Sequence[bytes],
        timeout_s: float,
        trace_context: dict[str, str] | None = None,
    ) -> int:
        """Fetch the prefix `block_hashes` from `peer` into our cache; 0 if it took too long.

        Nothing is held while the transfer is in flight: blocks are taken only once the KV has
        arrived, so a missed deadline leaves both pools as they were.
        """
        span = migration_span(self.core.traces, trace_context, len(block_hashes))
        imported = 0
        try:
            keys, packed = await within(peer.export_prefix.remote(block_hashes), timeout_s)
            if keys:
                imported = await self.core.import_prefix(keys, packed)
                span.set_attribute("pagedserve.migration.bytes", int(getattr(packed, "nbytes", 0)))
        except TimeoutError:
            logger.warning("pull of %d blocks timed out after %.1f s", len(block_hashes), timeout_s)
            span.add_event("timeout")
        finally:
            span.set_attribute("pagedserve.migration.blocks", imported)
            span.end()
        return imported


def _torch_threads() -> int:
    import torch  # loaded by the engine already (see `Worker.__init__`)

    return torch.get_num_threads()


def _core_share(namespace: str | None) -> CoreShare:
    """This worker's slot on the board of the app's workers on this machine."""
    node_id = ray.get_runtime_context().get_node_id()
    return CoreShare(board_path(namespace or "anonymous", node_id), usable_cores())
