"""The request path of a router: admit a request, route each leg, stream it back, replay what
a lost worker held, abort and drain.

`RouterRequests` is the part of `RouterCore` (`cluster/router/router.py`) a request goes through;
the routing itself (`route`), the worker views and the lifecycle stay there:

    generate ─► _generate: one plan of legs; a moved leg continues on its target, a lost
                worker's branches replay on a peer (`_replay_plan`), a refused continuing leg
                tries the next worker (what a leg is, and the replay plan: `legs.py`)
        _attempt ─► route (a fresh leg or a replay), or the move's target
            _stream ─► the worker's channel (`cluster/router/worker_channel.py`): submit, read the
                       leg's messages, abort it there when it is left early

Each layer closes the one it reads the moment it is closed itself (`contextlib.aclosing`), so a
client's cancel reaches the leg's abort at once; a generator left to the garbage collector is
closed only when a collection finds it, possibly after the request ran to its end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pagedserve.cluster.config import FailureMode
from pagedserve.cluster.pool.migration import Migrations
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.legs import Attempt, Emitted, LegRefused, params_left, replay_plan
from pagedserve.cluster.router.metrics import RouterMetrics
from pagedserve.cluster.router.tenant_quotas import TenantAdmission, TenantQuotaExceeded
from pagedserve.cluster.router.tracing import RouterTrace
from pagedserve.cluster.router.types import RouterCounters
from pagedserve.cluster.router.worker_channel import WorkerChannels
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS, WorkerLiveness
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within
from pagedserve.workers.kv.block_hash import cache_key
from pagedserve.workers.protocol.errors import (
    Draining,
    HandedOff,
    NoWorkerAvailable,
    Overloaded,
    RequestRejected,
    WorkerLost,
)
from pagedserve.workers.protocol.requests import GenerateRequest, WorkerRequest
from pagedserve.workers.protocol.stats import DrainResult
from pagedserve.workers.protocol.stream import RequestMoved, StreamDelta
from pagedserve.workers.telemetry.telemetry import Tracing

logger = logging.getLogger(__name__)


def scoped_request_id(tenant: str, client_id: str) -> str:
    """The id workers know a request by: the client's id within its tenant."""
    return f"{tenant}:{client_id}" if tenant else client_id


class RouterRequests:
    """The request endpoints `RouterCore` inherits. Owns nothing of its own: what it uses of
    the core is declared below."""

    config: RouterConfig
    router_id: str
    model_name: str
    block_size: int
    workers: dict[str, WorkerState]
    counters: RouterCounters
    metrics: RouterMetrics
    tracing: Tracing
    liveness: WorkerLiveness
    migrations: Migrations
    channels: WorkerChannels
    num_inflight: int
    tenant_admission: TenantAdmission
    _inflight_ids: dict[str, WorkerState | None]
    start: Callable[[], Any]
    route: Callable[..., Any]
    _tokenize: Callable[[GenerateRequest], Any]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas from the worker chosen for it.

        The stream survives a worker moving the request to a peer (`moved` deltas are followed,
        never shown) and, by config, the worker dying (unfinished branches replay on a peer).
        """
        # Admission and id reservation run before the first await: atomic on the event loop.
        self._admit()
        counts = self.counters.tenant(request.tenant)
        self._enter_tenant(request.tenant, counts)
        client_id = request.request_id or uuid.uuid4().hex
        try:
            request_id = self._reserve_id(request.tenant, client_id)
        except RequestRejected:
            self.tenant_admission.leave(request.tenant)
            raise
        self.num_inflight += 1
        trace = RouterTrace(self.tracing, request, client_id, self.model_name)
        error = None
        taken = [0]  # output tokens taken from the tenant's bucket (its quota) and not used
        try:
            await self.start()
            # Each layer closes the one it reads the moment it is closed itself, down to the
            # leg's abort on its worker (`_stream`): a generator left to the garbage collector
            # is closed when a collection finds it, which can be after the request ran out.
            generate = self._generate(request, request_id, trace, taken)
            async with aclosing(generate) as deltas:
                async for delta in deltas:
                    if delta.request_id != client_id:  # the worker knows the tenant-scoped id
                        delta = dataclasses.replace(delta, request_id=client_id)
                    counts.output_tokens += len(delta.token_ids)
                    taken[0] -= len(delta.token_ids)
                    yield delta
        except Overloaded as e:
            if isinstance(e, TenantQuotaExceeded):
                counts.refused_tokens += 1
                self.counters.refused_tenant += 1
            else:
                self.counters.refused_worker += 1
            error = e
            raise
        except Exception as e:
            error = e
            raise
        finally:
            self.num_inflight -= 1
            self._inflight_ids.pop(request_id, None)
            self.tenant_admission.leave(request.tenant)
            self.tenant_admission.give_back(request.tenant, taken[0])
            trace.end(error)

    def _enter_tenant(self, tenant: str, counts) -> None:
        """Count a request in its tenant's flight, or refuse it past the tenant's quota."""
        try:
            self.tenant_admission.enter(tenant)
        except TenantQuotaExceeded:
            counts.refused_inflight += 1
            self.counters.refused_tenant += 1
            raise

    def _reserve_id(self, tenant: str, client_id: str) -> str:
        """Reserve the tenant-scoped id of a new request; a duplicate is refused, and nothing
        of the request already in flight under that id is touched."""
        request_id = scoped_request_id(tenant, client_id)
        if request_id in self._inflight_ids:
            self.counters.refused_duplicate_id += 1
            raise RequestRejected(f"request_id {client_id!r} is already in flight")
        self._inflight_ids[request_id] = None
        return request_id

    def _admit(self) -> None:
        """Refuse at once, with a retry hint, when the router already streams its limit."""
        limit = self.config.limits.max_inflight
        if limit is not None and self.num_inflight >= limit:
            self.counters.refused_router += 1
            raise Overloaded(
                f"the router streams its limit of {limit} requests",
                self.config.limits.retry_after_s,
            )

    async def _generate(
        self, request: GenerateRequest, request_id: str, trace: RouterTrace, taken: list[int]
    ) -> AsyncIterator[StreamDelta]:
        token_ids = await self._tokenize(request)
        trace.on_prompt(len(token_ids))
        # The tenant's token quota: its prompt and all it may generate, now; the rest of what
        # it did not generate goes back when it ends (`generate`).
        params = request.params
        need = len(token_ids) + params.max_tokens * params.n
        self.tenant_admission.take_tokens(request.tenant, need)
        taken[0] = params.max_tokens * params.n
        counts = self.counters.tenant(request.tenant)
        counts.admitted += 1
        counts.prompt_tokens += len(token_ids)
        emitted = {j: Emitted() for j in range(request.params.n)}
        finished: set[int] = set()
        plan = [Attempt(None, token_ids, request.params)]
        while plan:
            attempt = plan.pop(0)
            try:
                async with aclosing(self._attempt(attempt, request_id, request, trace)) as leg:
                    async for delta in leg:
                        if isinstance(delta, RequestMoved):  # continue on a peer, never shown
                            plan.append(
                                Attempt(delta.index, handoff=delta.handoff, source=delta.worker_id)
                            )
                            self.migrations.on_moved(delta.handoff)
                            continue
                        emitted[delta.index].add(delta)
                        if delta.finish_reason is not None:
                            finished.add(delta.index)
                            trace.on_delta(delta)
                            self.metrics.on_finished(delta)
                        yield delta
            except WorkerLost as lost:
                trace.root.add_event("worker_lost", {"exception.message": str(lost)})
                plan = self._replay_plan(request, request_id, token_ids, emitted, finished)
            except LegRefused as refused:
                refused_by = attempt.refused_by | {refused.worker_id}
                others = [w for w in self.workers.values() if w.worker_id not in refused_by]
                if not any(w.routable for w in others):
                    raise refused.error from None  # every worker refused it: nothing to try
                self.counters.legs_retried += 1
                trace.root.add_event("leg_refused", {"pagedserve.worker_id": refused.worker_id})
                plan.insert(0, dataclasses.replace(attempt, refused_by=refused_by))

    async def _attempt(
        self, attempt: Attempt, request_id: str, request: GenerateRequest, trace: RouterTrace
    ) -> AsyncIterator[StreamDelta | RequestMoved]:
        params = attempt.params
        if attempt.handoff is not None and not attempt.replay:
            worker = self.migrations.move_target(attempt.source, attempt.refused_by)
            span = self.migrations.move_span(trace.root, attempt.handoff, attempt.source, worker)
            worker_request = WorkerRequest.moved(
                attempt.handoff, trace_context=trace.carrier(span), owner_id=self.router_id
            )
            demand = len(attempt.handoff.all_token_ids) + params_left(attempt.handoff)
        else:
            route_span = trace.child("route")
            try:
                worker, matched = await self.route(
                    attempt.prompt,
                    request.prefix_salt,
                    route_span,
                    attempt.refused_by,
                    self.lora_key(request.lora),
                )
            finally:
                route_span.end()
            span = trace.child("worker.call", **{"pagedserve.worker_id": worker.worker_id})
            if attempt.replay:
                worker_request = WorkerRequest.moved(
                    attempt.handoff, trace_context=trace.carrier(span), owner_id=self.router_id
                )
                decode = params_left(attempt.handoff)
            else:
                worker_request = WorkerRequest.fresh(
                    request_id,
                    attempt.prompt,
                    params,
                    priority=request.priority,
                    tenant=request.tenant,
                    cache_salt=request.prefix_salt,
                    timeout_s=request.timeout_s,
                    trace_context=trace.carrier(span),
                    owner_id=self.router_id,
                    lora=request.lora,
                )
                decode = params.max_tokens * params.n
            # What this request adds to the worker's work: tokens it must still prefill (a
            # cached prefix costs nothing) plus what it will decode.
            demand = len(attempt.prompt) - matched * self.block_size + decode
        streamed = False
        try:
            async with aclosing(self._stream(worker, worker_request, demand)) as messages:
                async for delta in messages:
                    # A leg serving one branch runs as the worker's branch 0: name the client's
                    # (a moved message too: its next leg serves that one).
                    if attempt.branch is not None and delta.index != attempt.branch:
                        delta = dataclasses.replace(delta, index=attempt.branch)
                    streamed = True
                    yield delta
        except Overloaded as error:
            if not attempt.continues or streamed:
                raise
            raise LegRefused(worker.worker_id, error) from error
        finally:
            span.end()

    def _replay_plan(
        self,
        request: GenerateRequest,
        request_id: str,
        token_ids: list[int],
        emitted: dict[int, Emitted],
        finished: set[int],
    ) -> list[Attempt]:
        """One replay leg per unfinished branch (`legs.replay_plan`), unless the config says
        a lost worker fails its requests."""
        if self.config.failure.on_worker_failure is FailureMode.FAIL:
            raise NoWorkerAvailable("the worker serving this request died")
        self.counters.replays += 1
        extra_keys = cache_key(self.model_name, request.prefix_salt, self.lora_key(request.lora))
        return replay_plan(
            request, request_id, token_ids, emitted, finished, extra_keys, self.block_size
        )

    async def _stream(
        self, worker: WorkerState, request: WorkerRequest, demand: int
    ) -> AsyncIterator[StreamDelta | RequestMoved]:
        """One leg on one worker: submit it, read its messages from the worker's channel
        (`cluster/router/worker_channel.py`) until every branch ended; a worker lost or hung, or one
        that cut the leg off while draining, ends it with `WorkerLost` (the caller replays)."""
        request_id = request.request_id
        self._inflight_ids[request_id] = worker
        worker.begin(demand, request_id)
        stream = self.channels.open(worker, request_id)  # before the submit: deltas may come first
        stream.submit(request)
        remaining = request.num_branches
        try:
            while remaining:
                message = await stream.next()
                if isinstance(message, RequestMoved) or message.finish_reason is not None:
                    remaining -= 1
                yield message
        except WORKER_LOST_ERRORS as error:
            logger.warning("worker %s lost mid-stream: %s", worker.worker_id, error)
            await self.liveness.drop(worker)
            raise WorkerLost(f"worker {worker.worker_id} was lost") from error
        except Draining as error:  # cut off (a handoff) or refused by a draining worker: replay
            worker.draining = True
            handoff = isinstance(error, HandedOff)
            if handoff:
                self.counters.drain_handoffs += 1
            else:
                self.counters.refused_draining += 1
            raise WorkerLost(str(error)) from error
        finally:
            worker.end(demand, request_id)
            stream.close(open_on_worker=bool(remaining))  # cancelled or failed: free it there

    async def abort(self, request_id: str, tenant: str = "") -> bool:
        """Abort a request by the id its client gave, within its tenant, wherever it runs.

        A request this router streams is aborted on its worker; any other id (another replica
        streams it) goes to every alive worker, each call under `rpc_timeout_s`.

        Returns:
            Whether a worker aborted it.
        """
        scoped_id = scoped_request_id(tenant, request_id)
        if scoped_id in self._inflight_ids:
            worker = self._inflight_ids[scoped_id]
            return worker is not None and await self._abort_on(worker, scoped_id)
        alive = [w for w in self.workers.values() if w.alive]
        aborted = await asyncio.gather(*(self._abort_on(w, scoped_id) for w in alive))
        return any(aborted)

    async def _abort_on(self, worker: WorkerState, scoped_id: str) -> bool:
        """One worker's abort of `scoped_id`; False when it does not answer in time."""
        try:
            return await within(
                worker.handle.abort.remote(scoped_id), self.config.failure.rpc_timeout_s
            )
        except (*WORKER_LOST_ERRORS, TimeoutError):
            logger.warning("abort of %s on %s got no answer", scoped_id, worker.worker_id)
            return False

    async def drain_worker(self, worker_id: str, grace_s: float) -> DrainResult:
        """Take a worker out of routing first, then drain it (see `Worker.drain`): its open
        streams get `grace_s` to finish and the rest replay on peers. The caller then stops it.
        """
        worker = self.workers[worker_id]
        worker.draining = True
        self.counters.workers_drained += 1
        return await within(
            worker.handle.drain.remote(grace_s), grace_s + self.config.failure.rpc_timeout_s
        )
