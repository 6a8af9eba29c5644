"""The router: validate, tokenize, hash, match its prefix view, pick a worker, stream back.

`RouterCore` holds the logic and runs wherever an event loop does (tests drive it directly);
`Router` in `cluster/app.py` is the Ray Serve deployment around it. Here it is built from its
parts and kept running (its lifecycle: workers ready, the prefix view synced and followed, its
counters reported, all of it closed); each job is a part of its own, which it inherits or holds:

    requests.py         RouterRequests: a request's path (admit, route each leg, stream back,
                        replay, abort, drain)
    route.py            RouterRouting: where a prompt goes (tokenize, hash, match, pick, pull)
    stats.py            RouterStats: what it reports (to the index, `inflight`, cluster stats)
    loras.py            RouterLoras: the cluster's LoRA adapters
    worker_liveness.py  the watch over workers (ready, polled, leased, dropped)
    worker_channel.py   each worker's step channel
    cluster/pool/migration.py   KV migration (pull, push, move)

Routing makes no remote call: each `RouterCore` keeps its own copy of the prefix index
(`PrefixView`, `cluster/index/view.py`), and a background task (`FeedFollower`, started by
`start` on the running event loop, cancelled by `close`) follows the index actor's change
feed into it. A new replica resyncs from the feed's dump before it serves; an index that does
not answer leaves the last view in place (counted as `index_unavailable`).

Load is counted here as well as reported by workers: every request sent to a worker counts in
its `inflight` until its stream ends, so the policy sees a burst before any report shows it;
a request count adds to the report only the requests it does not show yet (`WorkerState`), so
the other replicas' requests come from the report and this one's are not counted twice.
Which workers there are is the worker pool's to say (`cluster/pool/pool.py`): each stats
poll round first asks it for the membership (`cluster/pool/follower.py`), so joins and leaves
reach every replica without a remote call on the request path. A worker that stops answering
is dropped from routing, from this router's view and from the index at once; its requests
are replayed on a peer from their tokens (or failed with UNAVAILABLE, by config).

Streams: each worker sends everything of this router's requests there through one channel,
a batch per engine step (`cluster/router/worker_channel.py`), read into a bounded buffer per
request: a client that stops reading gets its request paused on the worker, one that leaves gets it
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
import logging
import uuid
from typing import Any

from ray.actor import ActorHandle

from pagedserve.cluster.index.view import FeedFollower, PrefixView
from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.follower import PoolFollower
from pagedserve.cluster.pool.migration import Migrations
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.loras import RouterLoras
from pagedserve.cluster.router.metrics import RouterMetrics
from pagedserve.cluster.router.reports import ClusterRouters
from pagedserve.cluster.router.requests import RouterRequests
from pagedserve.cluster.router.route import RouterRouting
from pagedserve.cluster.router.stats import RouterStats
from pagedserve.cluster.router.tenant_quotas import TenantAdmission
from pagedserve.cluster.router.types import RouterCounters
from pagedserve.cluster.router.worker_channel import WorkerChannels
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS, WorkerLiveness
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.cluster.routing.policies import make_policy, options_of
from pagedserve.cluster.routing.routable import RoutableWorkers
from pagedserve.cluster.routing.tier_costs import TierCosts
from pagedserve.workers.model.registry import DEFAULT_MODEL
from pagedserve.workers.model.tokenizer import load_tokenizer
from pagedserve.workers.protocol.errors import NoWorkerAvailable
from pagedserve.workers.ray_internals import detached_task
from pagedserve.workers.telemetry.telemetry import NOOP, Tracing

logger = logging.getLogger(__name__)


class RouterCore(RouterRequests, RouterRouting, RouterStats, RouterLoras):
    """Owns the routing policy, the view of every worker, its prefix view and the requests in
    flight.

    Args:
        config: the router's sections of the app config (`RouterConfig`); each part gets
            the one it reads.
        index: the prefix index actor.
        workers: worker id → actor handle.
        tracing: where request spans go (no-op by default).
        metrics: whether to keep Prometheus metrics (`self.metrics.render()`).
        pool: the worker pool actor; with it, the workers follow its membership (joins and
            leaves learnt on each stats poll: `cluster/pool/follower.py`), and with `workers`
            empty the first ones are the pool's answer to `pool_config` at `start`. None:
            `workers` is all there is.
        pool_config: the pool's part of the app config, handed to the pool at `start` and
            whenever it follows an older revision (needed with `pool`).
        config_revision: the revision of the app config (a newer one reconfigures the pool).
    """

    def __init__(
        self,
        config: RouterConfig,
        index: ActorHandle,
        workers: dict[str, ActorHandle],
        tracing: Tracing = NOOP,
        metrics: bool = False,
        pool: ActorHandle | None = None,
        pool_config: PoolConfig | None = None,
        config_revision: float = 0.0,
    ) -> None:
        self.config = config
        self.router_id = uuid.uuid4().hex
        self.tracing = tracing
        self.index = index
        self.workers = {wid: WorkerState(wid, handle) for wid, handle in workers.items()}
        routing, failure, limits = config.routing, config.failure, config.limits
        self.policy = make_policy(
            routing.routing_policy,
            engine_block_size=config.engine.block_size,
            **options_of(
                routing.routing_policy,
                routing.routing_options,
                config.workers_share_cores,
            ),
        )
        self.routable = RoutableWorkers(self.workers, self.policy.new_ranking())
        self.tier_costs = TierCosts(routing.tier_host_block_cost, routing.tier_disk_block_cost)
        self.tokenizer = load_tokenizer(config.engine.model or DEFAULT_MODEL)
        self.model_name = ""
        self.block_size = config.engine.block_size
        self.counters = RouterCounters()
        self.tenant_admission = TenantAdmission(limits.tenants, limits.retry_after_s)
        # Scoped request id → the worker serving it now (None until routed). Reserved when a
        # request is admitted, released when its stream ends: the one owner of id uniqueness.
        self._inflight_ids: dict[str, WorkerState | None] = {}
        self.num_inflight = 0  # requests between admission and their stream's end
        self._started: asyncio.Task | None = None
        self.view = PrefixView()
        self.feed = FeedFollower(
            self.view,
            index,
            failure.rpc_timeout_s,
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
            routing,
            failure.rpc_timeout_s,
            config.disaggregated,
            index,
            self.workers,
            tracing,
            self.counters,
            self.metrics,
        )
        # One channel per worker carries every delta of this router's requests there.
        self.channels = WorkerChannels(self.router_id, limits.max_buffered_deltas)
        self.liveness = WorkerLiveness(
            failure,
            index,
            self.workers,
            self.router_id,
            self.counters,
            on_polled=self._after_poll,
            on_dropped=self.view.drop_worker,
            on_hung=self.channels.worker_hung,
        )
        # LoRA adapters served (name -> key, path) and each worker's as last noted (epoch,
        # name -> key): what a worker that joins later is given (`RouterLoras.follow_loras`).
        self.lora_known: dict[str, tuple[str, str]] = {}
        self.lora_seen: dict[str, tuple[str, dict[str, str]]] = {}
        self.membership = None
        if pool is not None:
            if pool_config is None:
                raise ValueError("a router that follows a pool needs its pool_config")
            self.membership = PoolFollower(
                pool,
                pool_config,
                failure.rpc_timeout_s,
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

    def _count_index_unavailable(self) -> None:
        self.counters.index_unavailable += 1

    async def _start(self) -> None:
        try:
            if self.membership is not None and not self.workers:  # the pool's first workers
                await self.membership.first(self.config.failure.startup_timeout_s)
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

    async def _after_poll(self, worker: WorkerState) -> None:
        """After each poll of a live worker: give a new one the run-time LoRA adapters it
        lacks, then push its hot prefixes to peers if it is under pressure."""
        await self.follow_loras(worker)
        await self.migrations.push_if_under_pressure(worker)


def _running_on_this_loop(task: asyncio.Task | None, run: Any) -> asyncio.Task:
    """`task`, or `run()` started anew on the running event loop when `task` is done or ran on
    another loop (a caller may drive a core from one `asyncio.run` after another)."""
    loop = asyncio.get_running_loop()
    if task is None or task.done() or task.get_loop() is not loop:
        return detached_task(run())
    return task
