"""The router's watch over its workers: ready at start, polled for load, renewed, dropped.

`WorkerLiveness` keeps each `WorkerState` true: `start` waits for every worker's `ready()`;
then a poll loop refreshes each worker's `WorkerStats` every `stats_interval_s` (a worker
that stops answering is dropped from routing and from the index at once; one that answers
with a new epoch was restarted by Ray and is revived: its loop started, the index rejoined;
one that answers but has taken no engine step with work queued for `stall_timeout_s` is
stalled: out of routing until it steps again; one that reports draining leaves routing until
a new incarnation of it is ready; one stalled, or unanswering for `stall_timeout_s`, is hung:
its streams end as lost from here, `on_hung`, so no stream waits on a timer of its own),
and the leases stay renewed: each poll renews this router's lease on its worker, and a lease
loop renews it on every worker the polls have not reached lately (a worker aborts the
requests of a router whose lease lapsed, so a dead router leaves no orphan).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from pagedserve.cluster.config import FailureConfig
from pagedserve.cluster.router.types import RouterCounters
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.errors import NoWorkerAvailable
from pagedserve.workers.protocol.stats import WorkerStats
from pagedserve.workers.ray_internals import detached_task

logger = logging.getLogger(__name__)
WORKER_LOST_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)
PolledHook = Callable[[WorkerState], Awaitable[None]]
# A worker's lease is renewed on its own once its last poll went out this many stats intervals
# ago: past one interval plus a poll round's usual length, so a paced poll loop needs none.
RENEW_AFTER_INTERVALS = 1.5


class WorkerLiveness:
    """Owns the poll and lease loops over a router's workers and their liveness transitions.

    Args:
        config: the intervals and deadlines it keeps (`FailureConfig`).
        index: the prefix index actor (a dropped worker's entries leave it at once).
        workers: worker id → the router's `WorkerState` of it (shared with the router).
        router_id: whose lease the loops renew.
        counters: where lost and restarted workers are counted.
        on_polled: run after each successful poll of an alive worker (push pressure), beside
            the poll loop, one at a time per worker.
        on_dropped: run with a dropped worker's id at once (the router's prefix view forgets
            it before the index's removal comes through the feed).
        sync: run at the start of every poll round (the worker pool's membership: joins and
            leaves change `workers` between rounds, never during one).
        on_hung: run with a worker whose streams cannot progress (`WorkerState.hung`): after
            each poll that finds it so, and once `stall_timeout_s` after it stopped answering.
    """

    def __init__(
        self,
        config: FailureConfig,
        index: Any,
        workers: dict[str, WorkerState],
        router_id: str,
        counters: RouterCounters,
        on_polled: PolledHook | None = None,
        on_dropped: Callable[[str], None] | None = None,
        sync: Callable[[], Awaitable[None]] | None = None,
        on_hung: Callable[[WorkerState], None] | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.workers = workers
        self.router_id = router_id
        self.counters = counters
        self.on_polled = on_polled
        self.on_dropped = on_dropped
        self.sync = sync
        self.on_hung = on_hung
        self._tasks: list[asyncio.Task] = []
        self._removals: dict[str, asyncio.Future] = {}  # worker id → its index removal
        self._hooks: dict[str, asyncio.Task] = {}  # worker id → its running `on_polled`
        self._polled_at: dict[str, float] = {}  # worker id → when its last poll was sent

    async def start(self) -> list[WorkerState]:
        """Wait (up to `startup_timeout_s`) for every worker's `ready()`, then start the poll
        and lease loops. Returns the alive workers; raises `NoWorkerAvailable` if none is."""
        timeout = self.config.startup_timeout_s
        await asyncio.gather(*(self.revive(w, timeout) for w in self.workers.values()))
        alive = [w for w in self.workers.values() if w.alive]
        if not alive:
            raise NoWorkerAvailable(f"no worker became ready within {timeout} s")
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_loop()), loop.create_task(self._renew_loop())]
        return alive

    def close(self) -> None:
        for task in (*self._tasks, *self._hooks.values()):
            task.cancel()

    def forget(self, worker_id: str) -> None:
        """A worker left the pool: stop its running after-poll hook, if any."""
        self._polled_at.pop(worker_id, None)
        hook = self._hooks.pop(worker_id, None)
        if hook is not None:
            hook.cancel()

    async def revive(self, worker: WorkerState, timeout_s: float | None = None) -> None:
        """`ready()` the worker (starting its loop, rejoining the index) and mark it alive."""
        timeout_s = timeout_s or self.config.rpc_timeout_s
        try:
            info = await within(worker.handle.ready.remote(), timeout_s)
        except (*WORKER_LOST_ERRORS, TimeoutError) as error:
            logger.warning("worker %s is not ready: %s", worker.worker_id, error)
            return
        if worker.info is not None and info.epoch != worker.info.epoch:
            self.counters.workers_restarted += 1
        worker.mark_alive(info)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.workers.values()))

    async def poll(self, worker: WorkerState) -> None:
        """Refresh one worker's stats (renewing our lease there); drop or revive it."""
        self._polled_at[worker.worker_id] = time.monotonic()
        try:
            stats = await within(
                worker.handle.stats.remote(self.router_id), self.config.rpc_timeout_s
            )
        except (*WORKER_LOST_ERRORS, TimeoutError):
            await self.drop(worker)
            self._end_if_hung(worker)
            return
        if not worker.alive or worker.info is None or stats.epoch != worker.info.epoch:
            await self.revive(worker)  # restarted by Ray: start its loop, rejoin the index
        worker.stats = stats
        if stats.draining:  # draining for any reason (SIGTERM, another replica): leaving
            worker.draining = True
        self._judge_progress(worker, stats)
        self._end_if_hung(worker)
        if worker.alive and self.on_polled is not None:
            self._start_hook(worker)

    def _start_hook(self, worker: WorkerState) -> None:
        """Run `on_polled` beside the poll loop, one at a time per worker: a push to a peer
        that hangs (stalled, or slow to answer) must not hold up the polls, which are what
        judge that peer stalled in the first place."""
        running = self._hooks.get(worker.worker_id)
        if running is not None and not running.done():
            return  # the last round still runs; the next poll tries again
        assert self.on_polled is not None
        self._hooks[worker.worker_id] = detached_task(self._run_hook(worker))

    async def _run_hook(self, worker: WorkerState) -> None:
        assert self.on_polled is not None
        try:
            await self.on_polled(worker)
        except Exception:  # the next poll tries again; the loop must live on
            logger.exception("after-poll hook for %s failed", worker.worker_id)

    def _judge_progress(self, worker: WorkerState, stats: WorkerStats) -> None:
        """Stalled: runnable work and no engine step for `stall_timeout_s` (the worker's own
        clock says how long); it rejoins routing once it steps again."""
        stalled = stats.seconds_without_progress > self.config.stall_timeout_s
        if stalled and not worker.stalled:
            self.counters.workers_stalled += 1
            logger.warning(
                "worker %s stalled: no engine step for %.1f s with work queued; its streams "
                "end as lost and routing skips it",
                worker.worker_id,
                stats.seconds_without_progress,
            )
        elif worker.stalled and not stalled:
            logger.warning("worker %s steps again; back in routing", worker.worker_id)
        worker.stalled = stalled

    def _end_if_hung(self, worker: WorkerState) -> None:
        """Hand a hung worker to `on_hung` (its streams end as lost); again at every look
        while it stays hung, so that a stream opened on it meanwhile ends too."""
        if self.on_hung is not None and worker.hung(time.monotonic(), self.config.stall_timeout_s):
            self.on_hung(worker)

    async def drop(self, worker: WorkerState) -> None:
        """Take a dead worker out of routing and its entries out of the index at once.

        The poll loop and a stream can see one loss at the same time: whichever drops second
        awaits the first one's index removal, so no caller goes on while the index still
        lists the worker."""
        removal = self._removals.get(worker.worker_id)
        if removal is None:
            if not worker.alive:
                return
            worker.alive = False
            worker.lost_at = time.monotonic()
            self.counters.workers_lost += 1
            if self.on_dropped is not None:
                self.on_dropped(worker.worker_id)
            logger.warning("worker %s lost; dropped from routing and the index", worker.worker_id)
            # Hung once unanswering for `stall_timeout_s`: looked at then, not a poll round
            # later (a round waits `rpc_timeout_s` on each worker that does not answer).
            loop = asyncio.get_running_loop()
            later = self.config.stall_timeout_s + self.config.stats_interval_s
            loop.call_later(later, self._end_if_hung, worker)
            removal = detached_task(self._remove_from_index(worker.worker_id))
            self._removals[worker.worker_id] = removal
            removal.add_done_callback(lambda _: self._removals.pop(worker.worker_id, None))
        await asyncio.shield(removal)

    async def _remove_from_index(self, worker_id: str) -> None:
        try:
            await within(self.index.remove_worker.remote(worker_id), self.config.rpc_timeout_s)
        except (*WORKER_LOST_ERRORS, TimeoutError):
            logger.exception("could not drop %s from the index", worker_id)

    async def _poll_loop(self) -> None:
        while True:
            if self.sync is not None:
                try:
                    await self.sync()
                except Exception:  # the next round tries again; the loop must live on
                    logger.exception("membership sync failed")
            await self.poll_all()
            await asyncio.sleep(self.config.stats_interval_s)

    async def _renew_loop(self) -> None:
        """Renew this router's lease, each stats interval, on every worker `renew_due` names,
        without waiting for any answer: a slow worker, poll or push must never let the
        others' leases lapse (a lapsed lease aborts every request this router streams from
        that worker)."""
        while True:
            self.renew_due(time.monotonic())
            await asyncio.sleep(self.config.stats_interval_s)

    def renew_due(self, now: float) -> None:
        """Renew the lease on each worker whose last poll was sent `RENEW_AFTER_INTERVALS`
        stats intervals ago or more (or never). A poll renews the lease where it arrives, so
        while the polls keep their pace no renewal goes out: one Ray call a second per worker
        less. A poll round held up by one worker leaves the others' leases at most 2.5
        intervals unrenewed, inside `lease_timeout_s` (at least four)."""
        after_s = RENEW_AFTER_INTERVALS * self.config.stats_interval_s
        for worker in self.workers.values():
            if now - self._polled_at.get(worker.worker_id, -math.inf) >= after_s:
                worker.handle.renew_lease.remote(self.router_id)
