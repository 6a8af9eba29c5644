"""WorkerCore: one engine driven by an async step loop, streaming deltas to its callers.

It holds the worker's logic and needs no Ray, so it is tested directly; `Worker`
(`workers/worker.py`) is the Ray actor around it.

The engine is single-threaded. Steps run in a thread so the event loop stays free to accept
requests and stream tokens during a forward; anything that changes the engine (add, abort,
block import) or reads its pool (snapshots, pool checks, push candidates, the KV event list)
waits until no step is in flight and then runs on the loop thread. So exactly one thread
touches the engine at any time, and an abort takes effect within one step. (`stats` alone reads
counters during a step: the router's liveness poll must be answered by a busy or hung engine.)

Two guards keep a request from running on when nobody wants it:
- a bounded buffer per stream (`DeltaBuffer`): a reader that stops reading gets its request
  paused in the engine once `max_buffered_deltas` wait, and resumed once it has read half;
- owner leases (`LeaseTable`): a request sent with an `owner_id` is aborted once that owner
  (a router replica) has not renewed within `lease_timeout_s`. A housekeeping task checks every
  quarter of that, engine busy or idle.

A stream sends at most one message per branch per engine step, and fewer when its reader lags:
the deltas of one branch waiting in a row go out as one (`DeltaBuffer.get_coalesced`), so a
reader k steps behind gets one message carrying k steps' tokens, not k messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from pagedserve.workers.block import BlockKey
from pagedserve.workers.engine import Engine
from pagedserve.workers.errors import Draining, HandedOff, Overloaded, RequestRejected
from pagedserve.workers.handoff import RequestHandoff
from pagedserve.workers.hot_chains import eviction_chains, hot_chains
from pagedserve.workers.kv_cache_manager import PrefixTransfer
from pagedserve.workers.kv_checks import KVInvariantError, assert_no_leaks, check_invariants
from pagedserve.workers.kv_events import KVEvent, KVSnapshot
from pagedserve.workers.lease import DEFAULT_LEASE_TIMEOUT_S, LeaseTable
from pagedserve.workers.outputs import RequestDelta
from pagedserve.workers.request_trace import RequestTrace, RequestTraces
from pagedserve.workers.sampling_params import SamplingParams
from pagedserve.workers.stop_checker import FinishReason
from pagedserve.workers.stream import (
    DEFAULT_MAX_BUFFERED_DELTAS,
    DeltaBuffer,
    StreamDelta,
    stream_deltas,
)
from pagedserve.workers.telemetry import NOOP, Tracing
from pagedserve.workers.worker_types import DrainResult, PoolCheck, RequestMoved, WorkerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")
EventSink = Callable[[str, str, list[KVEvent]], None]


class WorkerCore:
    """Owns one engine, its step loop, the open streams (each with its bounded buffer), the
    owners' leases and the KV event feed.

    Args:
        engine: the engine to drive.
        worker_id: this worker's name in the cluster.
        event_sink: called as `sink(worker_id, epoch, events)` after each step that produced
            KV events (the prefix index's publish).
        tracing: where request spans go (the no-op tracer by default).
        lease_timeout_s: how long an owner's requests live without a renewal.
        max_buffered_deltas: deltas a stream buffers before its request is paused.
        clock: the leases' monotonic clock (tests inject one).
    """

    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        event_sink: EventSink | None = None,
        tracing: Tracing = NOOP,
        *,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        max_buffered_deltas: int = DEFAULT_MAX_BUFFERED_DELTAS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_buffered_deltas < 1:
            raise ValueError(f"max_buffered_deltas must be >= 1, got {max_buffered_deltas}")
        self.engine = engine
        self.traces = RequestTraces(tracing, worker_id)
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex
        self.event_sink = event_sink
        self.transfer = PrefixTransfer(engine.kv)
        self.leases = LeaseTable(lease_timeout_s, clock)
        self.max_buffered_deltas = max_buffered_deltas
        self._streams: dict[str, DeltaBuffer] = {}
        self._pending: list[tuple[Callable[[], Any], asyncio.Future | None]] = []
        self._stepping = False
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._housekeeping: asyncio.Task | None = None
        self._step_in_flight: asyncio.Future | None = None  # the step thread, while it runs
        self.num_blocks_imported = 0
        self.num_blocks_exported = 0
        self._drop_next_batch = False
        self.num_event_batches_dropped = 0
        self.draining = False  # set by `drain`: nothing new is admitted
        # When the engine last made progress (a step ended, or the loop took up work after
        # waiting for some): how the router tells a stalled worker from a busy one.
        self._progress_at = time.monotonic()
        self._waiting_for_work = False
        self._unstalled = threading.Event()  # cleared by `chaos_stall`: steps block
        self._unstalled.set()
        self._stall_after_steps: int | None = None  # `chaos_stall(True, n)`: steps left
        self._refuse_next = 0  # set by `chaos_refuse_next`: new streams refused as Overloaded

    # ------------------------------------------------------------ the loop
    def start(self) -> None:
        if self._loop_task is None:
            loop = asyncio.get_running_loop()
            self._loop_task = loop.create_task(self._run_loop())
            self._housekeeping = loop.create_task(self._housekeeping_loop())

    async def close(self) -> None:
        """Stop the loops, let a step in flight end, then close the engine: its disk tier
        finishes the writes it has queued, so a worker started again on the same directory
        finds every block this one spilled (the worker actor's shutdown path calls this)."""
        for task in (self._loop_task, self._housekeeping):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._loop_task = self._housekeeping = None
        self._unstalled.set()  # a `chaos_stall`ed step must not hold the close forever
        if self._step_in_flight is not None:  # its thread runs on after the loop's cancel
            with contextlib.suppress(Exception):
                await self._step_in_flight
        await asyncio.to_thread(self.engine.close)

    async def _housekeeping_loop(self) -> None:
        """Every quarter lease: abort the orphans of expired owners, and wake the step loop so
        that a paused request's deadline is noticed while nothing else runs."""
        while True:
            await asyncio.sleep(self.leases.timeout_s / 4)
            try:
                await self.check_leases()
            except Exception:  # the next round tries again; the loop must live on
                logger.exception("lease check failed")
            self._wakeup.set()

    async def _run_loop(self) -> None:
        while True:
            if not self.engine.has_runnable_requests():  # idle, or every request paused
                self._wakeup.clear()
                self._waiting_for_work = True
                await self._wakeup.wait()
                self._waiting_for_work = False
                self._progress_at = time.monotonic()
                continue
            self._stepping = True
            prefilling, start_ns = self.traces.before_step(self.engine.scheduler), time.time_ns()
            failure = None
            try:
                self._step_in_flight = asyncio.ensure_future(asyncio.to_thread(self._step))
                # Shielded: a `close` cancelling the loop must still be able to wait for it.
                deltas = await asyncio.shield(self._step_in_flight)
                self._step_in_flight = None
                self.traces.on_tier_loads(self.engine.step_tier_loads)
                self.traces.after_step(prefilling, start_ns)
            except Exception as error:
                logger.exception("engine step failed; ending every request in flight")
                deltas, failure = self._fail_all(), f"engine step failed: {error}"
            finally:
                self._stepping = False
                self._progress_at = time.monotonic()
                self._run_pending()
            for delta in deltas:
                self._dispatch(delta, failure)
            self._publish_events()

    def _step(self) -> list[RequestDelta]:
        self._unstalled.wait()  # only `chaos_stall` ever makes this wait
        deltas = self.engine.step()
        if self._stall_after_steps is not None:
            self._stall_after_steps -= 1
            if self._stall_after_steps <= 0:  # `chaos_stall(True, after_steps)`: stall now
                self._stall_after_steps = None
                self._unstalled.clear()
        return deltas

    def seconds_without_progress(self) -> float:
        """How long the engine has had runnable work and taken no step: 0 when it is idle or
        every request is paused (nothing to do is not a stall)."""
        if self._waiting_for_work or not self.engine.has_runnable_requests():
            return 0.0
        return time.monotonic() - self._progress_at

    def _fail_all(self) -> list[RequestDelta]:
        """A failed step must not leave streams hanging: end them all (finish reason `error`),
        free their blocks."""
        deltas = (self.engine.abort(r, FinishReason.ERROR) for r in list(self._streams))
        return [delta for delta in deltas if delta is not None]

    async def _on_engine(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine once no step is in flight."""
        if not self._stepping:
            return fn()
        future = asyncio.get_running_loop().create_future()
        self._pending.append((fn, future))
        return await future

    def _on_engine_soon(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the engine now, or right after the step in flight; nobody waits."""
        if not self._stepping:
            fn()
        else:
            self._pending.append((fn, None))

    def _run_pending(self) -> None:
        pending, self._pending = self._pending, []
        for fn, future in pending:
            try:
                result = fn()
            except Exception as error:  # handed to the waiting caller, which re-raises it
                if future is None:
                    logger.exception("deferred engine call failed")
                elif not future.done():
                    future.set_exception(error)
            else:
                if future is not None and not future.done():
                    future.set_result(result)

    def _dispatch(self, delta: RequestDelta, error: str | None = None) -> None:
        """Hand an engine delta to its stream's buffer, one `StreamDelta` per branch."""
        buffer = self._streams.get(delta.request_id)
        if buffer is None:
            return
        for branch_delta in stream_deltas(delta, self.worker_id, error):
            buffer.put(branch_delta)
        if not delta.finished and not buffer.paused and buffer.full():
            # The reader lags: stop decoding for it (blocks kept) until it has read half.
            buffer.paused = True
            self._on_engine_soon(functools.partial(self.engine.pause, delta.request_id))

    def _publish_events(self) -> None:
        """Hand the pool's new KV events to the sink. Not while a step is in flight: its thread
        appends to the pool's event list, and an event appended to a batch already sent would
        be lost (the index would see a gap and resync). The loop publishes after every step."""
        if self._stepping:
            return
        events = self.engine.kv.pool.take_events()
        if events and self._drop_next_batch:  # chaos: the index must notice and resync
            self._drop_next_batch = False
            self.num_event_batches_dropped += 1
            return
        if events and self.event_sink is not None:
            try:
                self.event_sink(self.worker_id, self.epoch, events)
            except Exception:  # the index resyncs from a snapshot after a lost batch
                logger.exception("publishing %d KV events failed", len(events))

    def buffered_deltas(self, request_id: str) -> int:
        """How many deltas wait unread in a stream's buffer (0: no such stream)."""
        buffer = self._streams.get(request_id)
        return 0 if buffer is None else len(buffer)

    # ------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        trace_context: dict[str, str] | None = None,
        owner_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas until every branch finished. Raises `RequestRejected`.

        Leaving the iteration early (cancellation, a closed stream) aborts the request and
        frees its blocks. `trace_context` (a W3C carrier) parents this request's spans.
        `owner_id` ties the request to that owner's lease (None: no lease).
        """
        add = functools.partial(
            self.engine.add_request,
            request_id,
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            timeout_s=timeout_s,
        )
        trace = self.traces.open(request_id, trace_context, params)
        async for delta in self._stream(request_id, params.n, add, trace, owner_id):
            yield delta

    async def adopt(
        self,
        handoff: RequestHandoff,
        trace_context: dict[str, str] | None = None,
        owner_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Continue a request a peer handed off; streams only the tokens it generates here (and
        text the peer held back): the engine counts the handoff's output as reported.
        `owner_id` as in `generate`."""
        trace = self.traces.open(handoff.request_id, trace_context, handoff.params, "worker.adopt")
        if handoff.timings is not None:
            trace.elapsed_ns = int(handoff.timings.elapsed_s * 1e9)
        start = functools.partial(self.engine.adopt, handoff)
        async for delta in self._stream(handoff.request_id, 1, start, trace, owner_id):
            yield delta

    async def _stream(
        self,
        request_id: str,
        num_branches: int,
        add: Callable[[], None],
        trace: RequestTrace,
        owner_id: str | None,
    ) -> AsyncIterator[StreamDelta]:
        self.start()
        if self.draining:
            raise Draining(f"worker {self.worker_id} is draining", retry_after_s=0.0)
        if self._refuse_next:
            self._refuse_next -= 1
            raise Overloaded(f"worker {self.worker_id} refused on purpose (chaos)")
        if request_id in self._streams:
            # Typed (INVALID_ARGUMENT at the front ends, not INTERNAL): two router replicas
            # can each admit a request under one id, and the second must be refused by name.
            raise RequestRejected(f"request_id {request_id!r} is already in flight")
        buffer = DeltaBuffer(self.max_buffered_deltas)
        self._streams[request_id] = buffer
        remaining = num_branches
        try:
            await self._on_engine(add)
            self.leases.attach(request_id, owner_id)
            self._wakeup.set()
            while remaining:
                delta = await buffer.get_coalesced()  # what waits of one branch, as one
                if delta is None:  # `drain` ran out of grace: the router replays the rest
                    raise HandedOff(f"worker {self.worker_id} drained before this request ended")
                if isinstance(delta, RequestMoved) or delta.finish_reason is not None:
                    remaining -= 1
                elif buffer.drained():
                    await self._resume(request_id, buffer)
                trace.on_delta(delta)
                yield delta
        finally:
            self._streams.pop(request_id, None)
            self.leases.detach(request_id)
            self.traces.close(trace, aborted=bool(remaining))
            if remaining:
                await asyncio.shield(self._abort_quietly(request_id))

    async def _resume(self, request_id: str, buffer: DeltaBuffer) -> None:
        buffer.paused = False
        await self._on_engine(functools.partial(self.engine.resume, request_id))
        self._wakeup.set()

    async def _abort_quietly(self, request_id: str) -> None:
        await self._on_engine(lambda: self.engine.abort(request_id))
        self._publish_events()

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with finish_reason "abort". False if unknown."""
        delta = await self._on_engine(lambda: self.engine.abort(request_id))
        if delta is None:
            return False
        self._dispatch(delta)
        self._publish_events()
        return True

    async def drain(self, grace_s: float) -> DrainResult:
        """Stop admitting, let open streams finish for up to `grace_s`, then end the rest with
        `Draining` (their blocks are freed; the router replays them on a peer).

        Returns:
            How many streams finished within the grace period and how many were handed off.
        """
        self.draining = True
        open_at_start = len(self._streams)
        end = time.monotonic() + grace_s
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.02)
        handed_off = list(self._streams)
        for buffer in self._streams.values():
            buffer.put(None)
        end = time.monotonic() + 5.0  # a deadline here too: a stuck stream must not hang us
        while self._streams and time.monotonic() < end:  # each one's `finally` aborts it
            await asyncio.sleep(0.01)
        return DrainResult(finished=open_at_start - len(handed_off), handed_off=len(handed_off))

    # -------------------------------------------------------------- leases
    def renew_lease(self, owner_id: str) -> None:
        """`owner_id` is alive: its requests live another `lease_timeout_s`."""
        self.leases.renew(owner_id)

    async def check_leases(self) -> int:
        """Abort every request whose owner's lease expired (blocks freed, KV events published,
        stream ended with finish_reason "abort"). Returns how many were aborted."""
        aborted = 0
        for request_id in self.leases.expired():
            logger.warning("request %s: its owner stopped renewing; aborting it", request_id)
            if await self.abort(request_id):
                aborted += 1
        return aborted

    # --------------------------------------------------------------- state
    def stats(self, owner_id: str | None = None) -> WorkerStats:
        """The worker's state; with `owner_id`, also which of that owner's requests it holds."""
        engine = self.engine.stats()
        return WorkerStats(
            worker_id=self.worker_id,
            epoch=self.epoch,
            kv=engine.pop("kv"),
            num_streams=len(self._streams),
            events_published=self.engine.kv.pool.num_events_published,
            blocks_imported=self.num_blocks_imported,
            blocks_exported=self.num_blocks_exported,
            event_batches_dropped=self.num_event_batches_dropped,
            draining=self.draining,
            owned_requests=self.leases.held_by(owner_id) if owner_id is not None else (),
            lease_expired=self.leases.num_expired,
            lease_owners=self.leases.num_owners,
            seconds_without_progress=self.seconds_without_progress(),
            scheduler=dataclasses.replace(self.engine.scheduler.counters),
            **engine,
        )

    async def check_pool(self) -> PoolCheck:
        """Pool invariants between steps; when idle, also that no block is held (free + cached
        = total)."""
        return await self._on_engine(self._check_pool_now)

    def _check_pool_now(self) -> PoolCheck:
        idle = not self.engine.has_unfinished_requests() and not self._streams
        proposer = self.engine.proposer
        pools = [self.engine.kv] + ([proposer.kv] if proposer and proposer.kv else [])
        try:
            for kv in pools:  # the engine's, and a speculative draft model's own
                (assert_no_leaks if idle else check_invariants)(kv)
        except KVInvariantError as error:
            return PoolCheck(ok=False, idle=idle, error=str(error))
        return PoolCheck(ok=True, idle=idle)

    def chaos_stall(self, stalled: bool, after_steps: int = 0) -> None:
        """Hang every engine step from the next one on (True) until released (False): a
        worker alive and answering, whose requests make no progress (stall tests).

        `after_steps` > 0: take that many more steps first, then hang; so a test knows a
        stream cannot have run past them whatever the machine's speed."""
        if after_steps < 0:
            raise ValueError(f"after_steps must be >= 0, got {after_steps}")
        self._stall_after_steps = None
        if stalled and after_steps:
            self._stall_after_steps = after_steps
        elif stalled:
            self._unstalled.clear()
        else:
            self._unstalled.set()

    def chaos_refuse_next(self, count: int) -> None:
        """Refuse the next `count` streams (new or adopted) with `Overloaded`, as a full
        waiting queue would (retry tests)."""
        self._refuse_next = count

    def chaos_drop_next_event_batch(self) -> None:
        """Lose the next KV event batch on purpose (soak and resync tests)."""
        self._drop_next_batch = True

    async def kv_snapshot(self) -> KVSnapshot:
        """The blocks held in every tier and the event sequence number they reflect, read
        between steps (a step in flight changes both)."""
        return await self._on_engine(self._snapshot_now)

    def _snapshot_now(self) -> KVSnapshot:
        pool = self.engine.kv.pool
        self._publish_events()  # events below next_seq are reflected in the snapshot
        held = pool.held_blocks()  # every tier's blocks, each with its fastest tier
        hashes, tiers = tuple(h for h, _ in held), tuple(t for _, t in held)
        return KVSnapshot(self.worker_id, self.epoch, pool.next_event_seq, hashes, tiers)

    # ----------------------------------------------------------- migration
    async def export_prefix(self, block_hashes: Sequence[bytes]) -> tuple[list[BlockKey], Any]:
        """The leading cached blocks of `block_hashes`: their keys and KV packed on the CPU."""

        def export():
            blocks = self.transfer.cached_prefix(block_hashes)
            if not blocks:
                return [], None
            packed = self.engine.kv_cache.export_blocks([b.block_id for b in blocks])
            self.num_blocks_exported += len(blocks)
            return [b.key for b in blocks], packed

        return await self._on_engine(export)

    async def push_candidates(self, max_chains: int) -> list[list[bytes]]:
        """Chains (root first) ending in the cached free blocks next in line for eviction
        (`eviction_chains`), read between steps."""
        pool = self.engine.kv.pool
        return await self._on_engine(lambda: eviction_chains(pool, max_chains))

    async def hot_chains(self, max_blocks: int) -> list[list[bytes]]:
        """Its cached prefixes as whole chains, hottest first (`workers/hot_chains.py`), read
        on the engine's thread so that no step changes the pool under the walk."""
        pool = self.engine.kv.pool
        return await self._on_engine(lambda: hot_chains(pool, max_blocks))

    async def import_prefix(self, keys: Sequence[BlockKey], packed: Any) -> int:
        """Store exported blocks as cached here; returns how many were new. 0 without room."""

        def do_import():
            reserved = self.transfer.reserve_for_import(keys)
            if reserved is None or not reserved[0]:
                return 0
            indices, blocks = reserved
            try:
                self.engine.kv_cache.import_blocks(
                    packed[:, :, indices], [b.block_id for b in blocks]
                )
            except Exception:
                self.transfer.abort_import(blocks)
                raise
            self.transfer.commit_import(blocks, [keys[i] for i in indices])
            self.num_blocks_imported += len(blocks)
            return len(blocks)

        imported = await self._on_engine(do_import)
        self._publish_events()
        return imported
