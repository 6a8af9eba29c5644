"""WorkerCore: one engine driven by an async step loop, streaming deltas to its callers.

It holds the worker's logic and needs no Ray, so it is tested directly; `Worker`
(`workers/worker/actor.py`) is the Ray actor around it.

The engine is single-threaded. Steps run in a thread so the event loop stays free to accept
requests and stream tokens during a forward; anything that changes the engine (add, abort,
block import) or reads its pool (snapshots, pool checks, push candidates, the KV event list)
waits until no step is in flight and then runs on the loop thread. So exactly one thread
touches the engine at any time, and an abort takes effect within one step. (`stats` alone reads
counters during a step: the router's liveness poll must be answered by a busy or hung engine.)

The logic is split by concept over three files: this one (the step loop, the engine's one
thread, leases, stats), `workers/worker/request_endpoints.py` (admit, stream, pause, abort, drain: a
request's messages go out through its owner's channel, one `StepBatch` per engine step, or
through a stream of its own) and `workers/worker/kv_endpoints.py` (what peers and checks read or
write of the pool).

Three guards keep a request from running on when nobody wants it:
- a bounded buffer per stream: a reader that stops reading gets its request paused in the
  engine once `max_buffered_deltas` wait, and resumed once it has read half (for a channel's
  requests that buffer is the router's, which asks for the pause: `set_paused`);
- a closed channel: when its owner's `channel` call ends (Ray closes it when the router dies;
  a heartbeat batch every quarter lease makes sure an idle one notices), every request of
  that owner here is aborted at once; so is a `generate` stream its reader leaves;
- owner leases (`LeaseTable`): a request sent with an `owner_id` is aborted once that owner
  (a router replica) has not renewed within `lease_timeout_s`. A housekeeping task checks every
  quarter of that, engine busy or idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.engine.outputs import RequestDelta
from pagedserve.workers.process.core_share import CoreShare
from pagedserve.workers.protocol.errors import LoraLoadError, RequestRejected
from pagedserve.workers.protocol.events import KVEvent
from pagedserve.workers.protocol.stats import LoraLoadResult, WorkerStats
from pagedserve.workers.protocol.stream import FinishReason
from pagedserve.workers.telemetry.request_trace import RequestTraces
from pagedserve.workers.telemetry.telemetry import NOOP, Tracing
from pagedserve.workers.transfer.prefix_transfer import PrefixTransfer
from pagedserve.workers.worker.kv_endpoints import WorkerKV
from pagedserve.workers.worker.lease import DEFAULT_LEASE_TIMEOUT_S, LeaseTable
from pagedserve.workers.worker.request_endpoints import WorkerRequests
from pagedserve.workers.worker.stream import DEFAULT_MAX_BUFFERED_DELTAS
from pagedserve.workers.worker.streams import StreamTable

if TYPE_CHECKING:
    from pagedserve.workers.worker.fault_injection import StepFaults

logger = logging.getLogger(__name__)
T = TypeVar("T")
EventSink = Callable[[str, str, list[KVEvent]], None]


def engine_thread_executor() -> ThreadPoolExecutor:
    """The one thread a worker builds and steps its engine on."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class WorkerCore(WorkerRequests, WorkerKV):
    """Owns one engine, its step loop, the open streams and owners' channels (`StreamTable`),
    the owners' leases and the KV event feed.

    Args:
        engine: the engine to drive.
        worker_id: this worker's name in the cluster.
        event_sink: called as `sink(worker_id, epoch, events)` after each step that produced
            KV events (the prefix index's publish).
        tracing: where request spans go (the no-op tracer by default).
        lease_timeout_s: how long an owner's requests live without a renewal.
        max_buffered_deltas: deltas a stream buffers before its request is paused.
        clock: the leases' monotonic clock (tests inject one).
        engine_thread: the thread the engine was built on (a new one by default).
        core_share: the machine's cores shared with its other workers: each step runs on
            this worker's share of them (`workers/process/core_share.py`). None: the engine
            keeps the torch threads it started with.
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
        engine_thread: ThreadPoolExecutor | None = None,
        core_share: CoreShare | None = None,
    ):
        if max_buffered_deltas < 1:
            raise ValueError(f"max_buffered_deltas must be >= 1, got {max_buffered_deltas}")
        self.engine = engine
        self.traces = RequestTraces(tracing, worker_id)
        self.worker_id = worker_id
        engine.worker_id = worker_id or None  # named in every delta it builds
        self.epoch = uuid.uuid4().hex
        self.event_sink = event_sink
        self.transfer = PrefixTransfer(engine.kv)
        self.leases = LeaseTable(lease_timeout_s, clock)
        self.max_buffered_deltas = max_buffered_deltas
        self._streams = StreamTable(worker_id, self.leases, self.traces)
        self._pending: list[tuple[Callable[[], Any], asyncio.Future | None]] = []
        self._stepping = False
        self.steps_started = 0  # engine steps this loop launched (counted as each starts)
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._housekeeping: asyncio.Task | None = None
        self._step_in_flight: asyncio.Future | None = None  # the step thread, while it runs
        # Every step runs on this one thread (the actor builds its engine there too): each
        # thread that starts OpenMP work gets a libgomp team of its own, and once libgomp
        # manages more threads than the machine has cores it stops spinning between parallel
        # regions, so every one of a step's ~200 regions waits for its threads to wake. Built
        # on the main thread and stepped on asyncio's pool, SmolLM2's decode step took twice
        # as long (bench/README.md, "GGUF block codes and one engine thread").
        self._engine_thread = engine_thread or engine_thread_executor()
        self.core_share = core_share
        self.num_blocks_imported = 0
        self.num_blocks_exported = 0
        self.num_event_batches_dropped = 0
        self.draining = False  # set by `drain`: nothing new is admitted
        # When the engine last made progress (a step ended, or the loop took up work after
        # waiting for some): how the router tells a stalled worker from a busy one.
        self._progress_at = time.monotonic()
        self._waiting_for_work = False
        # Soak and failure tests only (`workers/worker/fault_injection.py` installs it): None here.
        self.faults: StepFaults | None = None

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
        if self.faults is not None:  # a stalled step must not hold the close forever
            self.faults.release()
        if self._step_in_flight is not None:  # its thread runs on after the loop's cancel
            with contextlib.suppress(Exception):
                await self._step_in_flight
        await asyncio.get_running_loop().run_in_executor(self._engine_thread, self.engine.close)
        self._engine_thread.shutdown(wait=False)
        if self.core_share is not None:
            self.core_share.close()

    async def _housekeeping_loop(self) -> None:
        """Every quarter lease: abort the orphans of expired owners, send a heartbeat on every
        idle channel (a dead owner's ends at it), and wake the step loop so that a paused
        request's deadline is noticed while nothing else runs."""
        while True:
            await asyncio.sleep(self.leases.timeout_s / 4)
            try:
                await self.check_leases()
            except Exception:  # the next round tries again; the loop must live on
                logger.exception("lease check failed")
            self._streams.beat()
            self._wakeup.set()

    async def _run_loop(self) -> None:
        while True:
            if not self.engine.has_runnable_requests():  # idle, or every request paused
                if self.core_share is not None:
                    self.core_share.idle()
                self._wakeup.clear()
                self._waiting_for_work = True
                await self._wakeup.wait()
                self._waiting_for_work = False
                self._progress_at = time.monotonic()
                continue
            self._stepping = True
            self.steps_started += 1
            prefilling, start_ns = self.traces.before_step(self.engine.scheduler), time.time_ns()
            failure = None
            try:
                loop = asyncio.get_running_loop()
                self._step_in_flight = loop.run_in_executor(self._engine_thread, self._step)
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
        if self.core_share is not None:
            self.core_share.take_share()
        faults = self.faults
        if faults is None:
            return self.engine.step()
        faults.before_step()
        deltas = self.engine.step()
        faults.after_step()
        return deltas

    @property
    def engine_threads(self) -> int | None:
        """The torch threads its core share last set (None: no share, or no step yet)."""
        return self.core_share.applied if self.core_share is not None else None

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
        """Hand an engine delta to its stream (`StreamTable.deliver`), one message per branch."""
        stream = self._streams.deliver(delta, error)
        buffer = stream.buffer if stream is not None else None
        if buffer is not None and not delta.finished and not buffer.paused and buffer.full():
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
        if events and self.faults is not None and self.faults.take_batch_drop():
            self.num_event_batches_dropped += 1  # lost on purpose: the index must resync
            return
        if events and self.event_sink is not None:
            try:
                self.event_sink(self.worker_id, self.epoch, events)
            except Exception:  # the index resyncs from a snapshot after a lost batch
                logger.exception("publishing %d KV events failed", len(events))

    def buffered_deltas(self, request_id: str) -> int:
        """How many deltas wait unread in a stream's buffer (0: no such stream)."""
        stream = self._streams.get(request_id)
        return 0 if stream is None or stream.buffer is None else len(stream.buffer)

    # -------------------------------------------------------------- leases
    async def load_lora(self, name: str, path: str) -> LoraLoadResult:
        """Load an adapter on the engine's thread; its error, if any, as text."""
        try:
            adapter = await self._on_engine(lambda: self.engine.load_lora(name, path))
        except LoraLoadError as error:
            return LoraLoadResult(name, None, str(error))
        return LoraLoadResult(name, adapter.key, None)

    async def unload_lora(self, name: str) -> bool:
        try:
            await self._on_engine(lambda: self.engine.unload_lora(name))
        except RequestRejected:
            return False
        return True

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
            kv=engine.kv,
            num_waiting=engine.num_waiting,
            num_running=engine.num_running,
            num_swapped=engine.num_swapped,
            num_paused=engine.num_paused,
            num_steps=engine.num_steps,
            num_handoffs=engine.num_handoffs,
            adopted_with_kv=engine.adopted_with_kv,
            adopted_recomputed=engine.adopted_recomputed,
            role=engine.role,
            kv_cache_device_bytes=engine.kv_cache_device_bytes,
            kv_cache_swap_bytes=engine.kv_cache_swap_bytes,
            spec=engine.spec,
            tiers=engine.tiers,
            lora_adapters=engine.lora_adapters,
            lora_paths=engine.lora_paths,
            resident_loras=engine.resident_loras,
            lora_requests=engine.lora_requests,
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
            tenants=self.engine.scheduler.tenants.snapshot(),
        )
