"""The router: validate, tokenize, hash, match its prefix view, pick a worker, stream back.

`RouterCore` holds the logic and runs wherever an event loop does (tests drive it directly);
`Router` in `cluster/app.py` is the Ray Serve deployment around it. It keeps route, generate,
replay and abort; the watch over workers (ready, polled, leased, dropped) is
`cluster/worker_liveness.py`, and KV migration (pull, push, move) is `cluster/migration.py`.

Routing makes no remote call: each `RouterCore` keeps its own copy of the prefix index
(`PrefixView`, `cluster/prefix_view.py`), and a background task (`FeedFollower`, started by
`start` on the running event loop, cancelled by `close`) follows the index actor's change
feed into it. A new replica resyncs from the feed's dump before it serves; an index that does
not answer leaves the last view in place (counted as `index_unavailable`).

Load is counted here as well as reported by workers: every request sent to a worker counts in
its `inflight` until its stream ends, so the policy sees a burst before any report shows it;
a request count adds to the report only the requests it does not show yet (`WorkerState`), so
the other replicas' requests come from the report and this one's are not counted twice.
Which workers there are is the worker pool's to say (`cluster/worker_pool.py`): each stats
poll round first asks it for the membership (`cluster/pool_follower.py`), so joins and leaves
reach every replica without a remote call on the request path. A worker that stops answering
is dropped from routing, from this router's view and from the index at once; its requests
are replayed on a peer from their tokens (or failed with UNAVAILABLE, by config).

Streams: each worker sends everything of this router's requests there through one channel,
a batch per engine step (`cluster/worker_channel.py`), read into a bounded buffer per request:
a client that stops reading gets its request paused on the worker, one that leaves gets it
aborted there.

Request ids are the router's: a request's id is checked and reserved in one step, before any
await, so two requests can never share one; with auth on, an id is scoped to its tenant (the
token that sent it): what the workers see is `tenant:id`, so a tenant can neither see, abort
nor squat another's request. Any replica can abort any request: one that does not stream it
asks every alive worker to abort the scoped id. Prompts are length-checked before they are
tokenized, and tokenized in a thread, so a huge prompt cannot stall the event loop every
request shares.

Backpressure: past `max_inflight` open requests the router refuses at once with `Overloaded`
(RESOURCE_EXHAUSTED, HTTP 429, a retry hint), as each worker does past its waiting-queue bound.
A draining worker (`drain_worker`) leaves routing first; what it cannot finish in its grace
period comes back as `Draining` and replays on a peer like a lost worker's requests.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray.actor import ActorHandle

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.metrics import RouterMetrics
from pagedserve.cluster.migration import Migrations
from pagedserve.cluster.pool_follower import PoolFollower
from pagedserve.cluster.prefix_view import FeedFollower, PrefixView
from pagedserve.cluster.routable import RoutableWorkers
from pagedserve.cluster.router_reports import ClusterRouters, RouterReport
from pagedserve.cluster.router_types import (
    ClusterStats,
    GenerateRequest,
    NoWorkerAvailable,
    RouterCounters,
    RouterInflight,
    WorkerLost,
    WorkerView,
)
from pagedserve.cluster.routing import make_policy
from pagedserve.cluster.tier_costs import TierCosts
from pagedserve.cluster.tracing import RouterTrace, record_decision
from pagedserve.cluster.worker_channel import WorkerChannels
from pagedserve.cluster.worker_liveness import WORKER_LOST_ERRORS, WorkerLiveness
from pagedserve.cluster.worker_roles import PREFILL_PHASE, RoleFilter
from pagedserve.cluster.worker_state import WorkerState
from pagedserve.workers.block_hash import cache_key, hash_full_blocks
from pagedserve.workers.deadline import within
from pagedserve.workers.errors import Draining, HandedOff, Overloaded, RequestRejected
from pagedserve.workers.handoff import RequestHandoff
from pagedserve.workers.model_registry import DEFAULT_MODEL
from pagedserve.workers.ray_internals import detached_task
from pagedserve.workers.sampling_params import SamplingParams
from pagedserve.workers.stream import StreamDelta
from pagedserve.workers.telemetry import NOOP, Tracing
from pagedserve.workers.tokenizer import load_tokenizer
from pagedserve.workers.worker_types import (
    DrainResult,
    RequestMoved,
    WorkerRequest,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Attempt:
    """One leg of a request: a fresh start, a replay of one branch, or a moved continuation."""

    branch: int | None  # the client's branch index this leg serves (None: all of them)
    prompt: list[int] | None = None
    params: SamplingParams | None = None
    handoff: RequestHandoff | None = None
    source: str | None = None
    refused_by: frozenset[str] = frozenset()  # workers that refused this leg (Overloaded)
    # A replay: `handoff` (no KV) goes to the worker routed for `prompt`, which continues the
    # branch's output and its text exactly where the client's stream stopped.
    replay: bool = False

    @property
    def continues(self) -> bool:
        """A replay or a moved continuation: the client already has part of the answer, so a
        refusal tries the next worker instead of ending the request."""
        return self.branch is not None or self.handoff is not None


@dataclasses.dataclass
class _Emitted:
    """What the client has of one branch: its token ids and how much of its text."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_chars: int = 0

    def add(self, delta: StreamDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.num_chars += len(delta.text)


class _LegRefused(Exception):
    """A worker refused a continuing leg before streaming anything (`Overloaded`)."""

    def __init__(self, worker_id: str, error: Overloaded) -> None:
        super().__init__(str(error))
        self.worker_id = worker_id
        self.error = error


def params_left(handoff) -> int:
    return handoff.params.max_tokens - len(handoff.output_token_ids)


class RouterCore:
    """Owns the routing policy, the view of every worker, its prefix view and the requests in
    flight.

    Args:
        config: the cluster config.
        index: the prefix index actor.
        workers: worker id → actor handle.
        tracing: where request spans go (no-op by default).
        metrics: whether to keep Prometheus metrics (`self.metrics.render()`).
        pool: the worker pool actor; with it, the workers follow its membership (joins and
            leaves learnt on each stats poll: `cluster/pool_follower.py`). None: `workers` is
            all there is.
        config_revision: the revision of `config` (a newer one reconfigures the pool).
    """

    def __init__(
        self,
        config: ClusterConfig,
        index: ActorHandle,
        workers: dict[str, ActorHandle],
        tracing: Tracing = NOOP,
        metrics: bool = False,
        pool: ActorHandle | None = None,
        config_revision: float = 0.0,
    ) -> None:
        self.config = config
        self.router_id = uuid.uuid4().hex
        self.tracing = tracing
        self.index = index
        self.workers = {wid: WorkerState(wid, handle) for wid, handle in workers.items()}
        options = dict(config.routing_options)
        if config.routing_policy == "kv_aware":  # it converts router token counts to blocks
            options.setdefault("block_size", config.engine.block_size)
        self.policy = make_policy(config.routing_policy, **options)
        self.routable = RoutableWorkers(self.workers, self.policy.new_ranking())
        self.tier_costs = TierCosts(config.tier_host_block_cost, config.tier_disk_block_cost)
        self.tokenizer = load_tokenizer(config.engine.model or DEFAULT_MODEL)
        self.model_name = ""
        self.block_size = config.engine.block_size
        self.counters = RouterCounters()
        # Scoped request id → the worker serving it now (None until routed). Reserved when a
        # request is admitted, released when its stream ends: the one owner of id uniqueness.
        self._inflight_ids: dict[str, WorkerState | None] = {}
        self.num_inflight = 0  # requests between admission and their stream's end
        self._started: asyncio.Task | None = None
        self.view = PrefixView()
        self.feed = FeedFollower(
            self.view,
            index,
            config.rpc_timeout_s,
            on_error=self._count_index_unavailable,
            lost_errors=WORKER_LOST_ERRORS,
        )
        self._following: asyncio.Task | None = None
        self._reporting: asyncio.Task | None = None
        self.last_cluster: ClusterRouters | None = None  # every replica's, as last read
        self.metrics = RouterMetrics(
            metrics,
            lambda: {w.worker_id: (w.alive, w.stats) for w in self.workers.values()},
            lambda: self.last_cluster,
        )
        self.migrations = Migrations(
            config, index, self.workers, tracing, self.counters, self.metrics
        )
        # One channel per worker carries every delta of this router's requests there.
        self.channels = WorkerChannels(self.router_id, config.max_buffered_deltas)
        self.liveness = WorkerLiveness(
            config,
            index,
            self.workers,
            self.router_id,
            self.counters,
            on_polled=self.migrations.push_if_under_pressure,
            on_dropped=self.view.drop_worker,
            on_hung=self.channels.worker_hung,
        )
        self.membership = None
        if pool is not None:
            self.membership = PoolFollower(
                pool,
                config,
                config_revision,
                self.router_id,
                self.workers,
                self.liveness,
                self.view,
            )
            self.liveness.sync = self.membership.sync

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Wait for every worker to be ready and the prefix view to sync once, then keep loads
        and the view fresh. Idempotent."""
        if self._started is None:  # every loop it starts outlives the request that started it
            self._started = detached_task(self._start())
        await asyncio.shield(self._started)
        self._following = _running_on_this_loop(self._following, self.feed.run)
        if self.index is not None:
            self._reporting = _running_on_this_loop(self._reporting, self._report_loop)

    def report(self) -> RouterReport:
        """This replica's counters and in-flight requests, as the index actor keeps them for
        every replica's GetStats (`cluster/router_reports.py`)."""
        return RouterReport(
            self.router_id,
            copy.deepcopy(self.counters),
            {w.worker_id: w.inflight for w in self.workers.values() if w.inflight},
            expires_after_s=self.config.lease_timeout_s,
        )

    async def _send_report(self) -> None:
        try:
            await within(self.index.report_router.remote(self.report()), self.config.rpc_timeout_s)
        except (*WORKER_LOST_ERRORS, TimeoutError):  # the next round sends a newer one
            logger.debug("the prefix index did not take this router's counters")

    async def _report_loop(self) -> None:
        while True:
            await self._send_report()
            await asyncio.sleep(self.config.stats_interval_s)

    def _count_index_unavailable(self) -> None:
        self.counters.index_unavailable += 1

    async def _start(self) -> None:
        try:
            alive = await self.liveness.start()
        except NoWorkerAvailable:
            self._started = None  # let the next request try again
            raise
        self.model_name = alive[0].info.model
        self.block_size = alive[0].info.block_size
        await self.feed.read_once(wait_s=0)  # the dump: serve with what the index knows

    async def close(self) -> None:
        self.liveness.close()
        self.channels.close()
        for task in (self._started, self._following, self._reporting):
            if task is not None:
                task.cancel()
        if self.index is not None:  # the last counts, so cluster totals keep them
            self.index.report_router.remote(self.report())

    # -------------------------------------------------------------- routing
    async def _tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids; text is measured first, then tokenized off the event loop."""
        if request.prompt_token_ids is not None:
            if request.prompt is not None:
                raise RequestRejected("give prompt or prompt_token_ids, not both")
            check_prompt_size(len(request.prompt_token_ids), self.config.max_prompt_chars)
            return list(request.prompt_token_ids)
        if not request.prompt:
            raise RequestRejected("prompt is empty")
        if self.tokenizer is None:
            raise RequestRejected("the model has no tokenizer; send prompt_token_ids")
        check_prompt_size(len(request.prompt), self.config.max_prompt_chars)
        return await asyncio.to_thread(self.tokenizer.encode, request.prompt)

    async def prompt_length(self, prompt: str | list[int]) -> int:
        """Tokens in a prompt, checked for size first and tokenized off the event loop."""
        if isinstance(prompt, str):
            request = GenerateRequest(params=SamplingParams(), prompt=prompt)
        else:
            request = GenerateRequest(params=SamplingParams(), prompt_token_ids=prompt)
        return len(await self._tokenize(request))

    async def route(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        span: Any = None,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[WorkerState, int]:
        """Pick a worker for a prompt; pull its prefix from a peer when that beats prefill.

        `span`: the `route` span, given the decision (and parent of a pull), if traced.
        `exclude`: workers not to pick (they refused this request already).
        """
        ranking = self.routable.current()  # loads kept current per worker change
        if self.config.disaggregated:  # P/D: a fresh prompt goes to a worker that prefills
            exclude |= self._unfit(PREFILL_PHASE, exclude)
        others = None  # a retry after refusals (rare) scores the workers not excluded in full
        if exclude:
            others = [w for w in self.workers.values() if w.routable and w.worker_id not in exclude]
        if not (ranking if others is None else others):
            raise NoWorkerAvailable("no worker is alive and admitting")
        key = cache_key(self.model_name, cache_salt)
        hashes = hash_full_blocks(token_ids, self.block_size, key)
        matches = self.view.match(hashes)  # local: no remote call on the request path
        tier_hits = self.view.tier_hits(hashes, matches)
        tier_load = self.tier_costs.per_worker(tier_hits)
        if others is None:
            decision = self.policy.choose_ranked(len(hashes), matches, ranking, tier_load)
        else:
            loads = [w.load() for w in others]
            decision = self.policy.choose(len(hashes), matches, loads, tier_load)
        chosen = self.workers[decision.worker_id]
        matched = matches.get(chosen.worker_id, 0)
        self.counters.count_routed(decision.policy)
        outcome = "prefix_hit" if matched else "prefix_miss"
        if matched:
            self.counters.prefix_hits += 1
        else:
            self.counters.prefix_misses += 1
        self.metrics.on_routed(decision.policy, outcome)
        if span is not None:
            record_decision(span, decision, len(hashes), matched)
        if self.config.enable_pull:
            exportable = {w: hits.device_prefix for w, hits in tier_hits.items()}
            peers = {**matches, **exportable}  # a peer exports only what is on its device
            matched = await self.migrations.maybe_pull(chosen, hashes, peers, matched, span)
        return chosen, matched

    def _unfit(self, phase: RoleFilter, exclude: frozenset[str]) -> frozenset[str]:
        """The workers (not in `exclude`) of a role `phase` should not go to; none when no
        worker of a fitting role is routable (counted as a P/D fallback)."""
        candidates = (w for w in self.workers.values() if w.worker_id not in exclude)
        unfit, fell_back = phase.unfit(candidates)
        self.counters.pd_fallbacks += fell_back
        return unfit

    # ------------------------------------------------------------ requests
    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas from the worker chosen for it.

        The stream survives a worker moving the request to a peer (`moved` deltas are followed,
        never shown) and, by config, the worker dying (unfinished branches replay on a peer).
        """
        # Admission and id reservation run before the first await: atomic on the event loop.
        self._admit()
        client_id = request.request_id or uuid.uuid4().hex
        request_id = self._reserve_id(request.tenant, client_id)
        self.num_inflight += 1
        trace = RouterTrace(self.tracing, request, client_id, self.model_name)
        error = None
        try:
            await self.start()
            # Each layer closes the one it reads the moment it is closed itself, down to the
            # leg's abort on its worker (`_stream`): a generator left to the garbage collector
            # is closed when a collection finds it, which can be after the request ran out.
            async with aclosing(self._generate(request, request_id, trace)) as deltas:
                async for delta in deltas:
                    delta.request_id = client_id  # the worker knows the tenant-scoped id
                    yield delta
        except Overloaded as e:
            self.counters.refused_worker += 1
            error = e
            raise
        except Exception as e:
            error = e
            raise
        finally:
            self.num_inflight -= 1
            self._inflight_ids.pop(request_id, None)
            trace.end(error)

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
        limit = self.config.max_inflight
        if limit is not None and self.num_inflight >= limit:
            self.counters.refused_router += 1
            raise Overloaded(
                f"the router streams its limit of {limit} requests", self.config.retry_after_s
            )

    async def _generate(
        self, request: GenerateRequest, request_id: str, trace: RouterTrace
    ) -> AsyncIterator[StreamDelta]:
        token_ids = await self._tokenize(request)
        trace.on_prompt(len(token_ids))
        emitted = {j: _Emitted() for j in range(request.params.n)}
        finished: set[int] = set()
        plan = [_Attempt(None, token_ids, request.params)]
        while plan:
            attempt = plan.pop(0)
            try:
                async with aclosing(self._attempt(attempt, request_id, request, trace)) as leg:
                    async for delta in leg:
                        if isinstance(delta, RequestMoved):  # continue on a peer, never shown
                            plan.append(
                                _Attempt(delta.index, handoff=delta.handoff, source=delta.worker_id)
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
            except _LegRefused as refused:
                refused_by = attempt.refused_by | {refused.worker_id}
                others = [w for w in self.workers.values() if w.worker_id not in refused_by]
                if not any(w.routable for w in others):
                    raise refused.error from None  # every worker refused it: nothing to try
                self.counters.legs_retried += 1
                trace.root.add_event("leg_refused", {"pagedserve.worker_id": refused.worker_id})
                plan.insert(0, dataclasses.replace(attempt, refused_by=refused_by))

    async def _attempt(
        self, attempt: _Attempt, request_id: str, request: GenerateRequest, trace: RouterTrace
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
                    attempt.prompt, request.prefix_salt, route_span, attempt.refused_by
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
                    cache_salt=request.prefix_salt,
                    timeout_s=request.timeout_s,
                    trace_context=trace.carrier(span),
                    owner_id=self.router_id,
                )
                decode = params.max_tokens * params.n
            # What this request adds to the worker's work: tokens it must still prefill (a
            # cached prefix costs nothing) plus what it will decode.
            demand = len(attempt.prompt) - matched * self.block_size + decode
        streamed = False
        try:
            async with aclosing(self._stream(worker, worker_request, demand)) as messages:
                async for delta in messages:
                    # A leg serving one branch runs as the worker's branch 0: name the client's.
                    if attempt.branch is not None and isinstance(delta, StreamDelta):
                        delta.index = attempt.branch
                    elif attempt.branch is not None:  # moved on: its next leg serves that one
                        delta = dataclasses.replace(delta, index=attempt.branch)
                    streamed = True
                    yield delta
        except Overloaded as error:
            if not attempt.continues or streamed:
                raise
            raise _LegRefused(worker.worker_id, error) from error
        finally:
            span.end()

    def _replay_plan(
        self,
        request: GenerateRequest,
        request_id: str,
        token_ids: list[int],
        emitted: dict[int, _Emitted],
        finished: set[int],
    ) -> list[_Attempt]:
        """One replay leg per unfinished branch: a handoff without KV, so the peer continues
        from the branch's tokens (recomputing their KV, or hitting its prefix cache) with the
        detokenizer resumed where the client's text stopped: a character split across the
        failure point, or a stop string spanning it, comes out exactly as without it."""
        if self.config.on_worker_failure == "fail":
            raise NoWorkerAvailable("the worker serving this request died")
        self.counters.replays += 1
        extra_keys = cache_key(self.model_name, request.prefix_salt)
        plan = []
        for j in sorted(set(emitted) - finished):
            done = emitted[j]
            # Prompt log-probabilities went out with the branch's first delta.
            params = dataclasses.replace(request.params.for_branch(j), prompt_logprobs=None)
            handoff = RequestHandoff.replay(
                request_id,
                token_ids,
                done.token_ids,
                done.num_chars,
                params,
                priority=request.priority,
                cache_extra_keys=extra_keys,
                block_size=self.block_size,
                deadline_remaining_s=request.timeout_s,
            )
            plan.append(_Attempt(j, token_ids + done.token_ids, handoff=handoff, replay=True))
        return plan

    async def _stream(
        self, worker: WorkerState, request: WorkerRequest, demand: int
    ) -> AsyncIterator[StreamDelta | RequestMoved]:
        """One leg on one worker: submit it, read its messages from the worker's channel
        (`cluster/worker_channel.py`) until every branch ended; a worker lost or hung, or one
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
            return await within(worker.handle.abort.remote(scoped_id), self.config.rpc_timeout_s)
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
            worker.handle.drain.remote(grace_s), grace_s + self.config.rpc_timeout_s
        )

    # ---------------------------------------------------------------- state
    def inflight(self) -> RouterInflight:
        """The requests this router holds open now and what it counts on each worker."""
        return RouterInflight(
            request_ids=tuple(sorted(self._inflight_ids)),
            num_requests=self.num_inflight,
            workers={
                w.worker_id: (w.inflight, w.inflight_tokens)
                for w in self.workers.values()
                if w.inflight or w.inflight_tokens
            },
        )

    async def cluster_routers(self) -> ClusterRouters | None:
        """Every replica's counters summed, this one's reported first (None: the index did not
        answer); kept as `last_cluster` for `/metrics`."""
        await self._send_report()
        try:
            routers = self.index.routers.remote()
            self.last_cluster = await within(routers, self.config.rpc_timeout_s)
        except (*WORKER_LOST_ERRORS, TimeoutError):
            self.last_cluster = None
        return self.last_cluster

    async def cluster_stats(self) -> ClusterStats:
        await self.start()
        await self.liveness.poll_all()
        workers = {
            w.worker_id: WorkerView(w.worker_id, w.alive, w.inflight, w.info, w.stats)
            for w in self.workers.values()
        }
        try:
            index = await within(self.index.stats.remote(), self.config.rpc_timeout_s)
        except (*WORKER_LOST_ERRORS, TimeoutError):
            index = None
        return ClusterStats(
            cluster=await self.cluster_routers(),
            workers=workers,
            router=copy.deepcopy(self.counters),
            limits=self.config.limits,
            index=index,
            policy=self.config.routing_policy,
            view=self.view.stats(),
        )


def _running_on_this_loop(task: asyncio.Task | None, run: Any) -> asyncio.Task:
    """`task`, or `run()` started anew on the running event loop when `task` is done or ran on
    another loop (a caller may drive a core from one `asyncio.run` after another)."""
    loop = asyncio.get_running_loop()
    if task is None or task.done() or task.get_loop() is not loop:
        return detached_task(run())
    return task


def scoped_request_id(tenant: str, client_id: str) -> str:
    """The id workers know a request by: the client's id within its tenant."""
    return f"{tenant}:{client_id}" if tenant else client_id


def check_prompt_size(size: int, limit: int) -> None:
    """Refuse a prompt longer than `limit` characters (or token ids) before any work on it."""
    if size > limit:
        raise RequestRejected(
            f"prompt is {size:,} characters or tokens long; the limit is {limit:,} "
            "(max_prompt_chars)"
        )
