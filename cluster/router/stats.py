"""What a router reports (a mixin of `RouterCore`): its counters and in-flight requests to the
prefix index actor every stats interval (`RouterReport`, summed over every replica there:
`cluster/router/reports.py`), what it holds open now (`inflight`), and the cluster's stats
(`cluster_stats`: every worker polled, this router's counters, every replica's summed, the
index's and this router's prefix view), as GetStats, `/metrics` and the Python handle's `stats`
answer them.
"""

from __future__ import annotations

import asyncio
import copy
import logging

from pagedserve.cluster.router.reports import ClusterRouters, RouterReport
from pagedserve.cluster.router.types import ClusterStats, RouterInflight, WorkerView
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.workers.deadline import within

logger = logging.getLogger(__name__)


class RouterStats:
    """The reporting endpoints `RouterCore` inherits. Owns nothing of its own: it uses the
    core's `router_id`, `config`, `index`, `workers`, `counters`, `liveness`, `view`, `start`,
    `_inflight_ids`, `num_inflight` and `last_cluster` (which it sets)."""

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

    def report(self) -> RouterReport:
        """This replica's counters and in-flight requests, as the index actor keeps them for
        every replica's GetStats (`cluster/router/reports.py`)."""
        return RouterReport(
            self.router_id,
            copy.deepcopy(self.counters),
            {w.worker_id: w.inflight for w in self.workers.values() if w.inflight},
            expires_after_s=self.config.failure.lease_timeout_s,
        )

    async def _send_report(self) -> None:
        try:
            await within(
                self.index.report_router.remote(self.report()), self.config.failure.rpc_timeout_s
            )
        except (*WORKER_LOST_ERRORS, TimeoutError):  # the next round sends a newer one
            logger.debug("the prefix index did not take this router's counters")

    async def _report_loop(self) -> None:
        while True:
            await self._send_report()
            await asyncio.sleep(self.config.failure.stats_interval_s)

    async def cluster_routers(self) -> ClusterRouters | None:
        """Every replica's counters summed, this one's reported first (None: the index did not
        answer); kept as `last_cluster` for `/metrics`."""
        await self._send_report()
        try:
            routers = self.index.routers.remote()
            self.last_cluster = await within(routers, self.config.failure.rpc_timeout_s)
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
            index = await within(self.index.stats.remote(), self.config.failure.rpc_timeout_s)
        except (*WORKER_LOST_ERRORS, TimeoutError):
            index = None
        return ClusterStats(
            cluster=await self.cluster_routers(),
            workers=workers,
            router=copy.deepcopy(self.counters),
            limits=self.config.limits.backpressure,
            index=index,
            policy=self.config.routing.routing_policy,
            view=self.view.stats(),
        )
