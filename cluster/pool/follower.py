"""A router replica's side of the worker pool's membership (`cluster/pool/pool.py`).

`PoolFollower.sync` runs at the start of each stats poll round (`WorkerLiveness`), never on
the request path. It asks the pool for the membership, passing the router's id and the
version it holds (the pool's proof that this router has applied it), and applies what
changed to the router's own tables:

- a worker now serving that the router does not know: a new `WorkerState`, readied
  (`WorkerLiveness.revive`) before routing may pick it;
- a worker leaving: out of routing (`WorkerState.leaving`); its streams run on;
- a worker no longer listed: its `WorkerState` dropped, and its entries in the router's
  prefix view, at once (the index's removal follows through the feed).

A worker still starting is neither routed to nor dropped. When the pool restarted and waits
for a config, or follows an older config revision than this router's, the router sends its
own (`WorkerPoolActor.configure`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pagedserve.cluster.index.view import PrefixView
from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.types import Membership, MembershipVersion, MemberState
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS, WorkerLiveness
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within

logger = logging.getLogger(__name__)


class PoolFollower:
    """Owns the membership version a router holds, and applies the pool's changes to the
    router's `workers` and prefix view (both shared with the router).

    Args:
        pool: the pool actor.
        config: the pool's part of this router's app config (sent when the pool needs it).
        rpc_timeout_s: the deadline of a membership call.
        revision: that config's revision (newer wins at the pool).
        router_id: this router's id.
        workers: the router's worker id → `WorkerState`.
        liveness: the router's watch (readies joiners, forgets leavers).
        view: the router's prefix view.
    """

    def __init__(
        self,
        pool: Any,
        config: PoolConfig,
        rpc_timeout_s: float,
        revision: float,
        router_id: str,
        workers: dict[str, WorkerState],
        liveness: WorkerLiveness,
        view: PrefixView,
    ) -> None:
        self.pool = pool
        self.config = config
        self.rpc_timeout_s = rpc_timeout_s
        self.revision = revision
        self.router_id = router_id
        self.workers = workers
        self.liveness = liveness
        self.view = view
        self.held: MembershipVersion | None = None
        self.joined = self.left = 0
        self.pool_unanswered = False  # the last round's call failed (logged once per outage)

    async def sync(self) -> None:
        """One look at the pool; apply what changed. A pool that does not answer leaves the
        workers as they are (counted nowhere: the next round asks again)."""
        timeout = self.rpc_timeout_s
        try:
            membership = await within(
                self.pool.membership.remote(self.router_id, self.held), timeout
            )
            if membership is not None and self._pool_needs_config(membership):
                membership = await within(
                    self.pool.configure.remote(self.config, self.revision), timeout
                )
        except (*WORKER_LOST_ERRORS, TimeoutError):
            if not self.pool_unanswered:  # once per outage, not once per poll round
                logger.warning("the worker pool did not answer; keeping the workers as they are")
            self.pool_unanswered = True
            return
        if self.pool_unanswered:
            logger.warning("the worker pool answers again")
            self.pool_unanswered = False
        if membership is not None:
            await self.apply(membership)

    async def first(self, timeout_s: float) -> None:
        """At the router's start: hand the pool this config (it creates or adopts the first
        workers, which may take a while on a loaded machine: `timeout_s`) and take its
        starting and serving members as the router's workers, to be readied by the liveness
        watch. Raises what the call raised (the router's start fails and is retried)."""
        membership = await within(self.pool.configure.remote(self.config, self.revision), timeout_s)
        current = membership.in_state(MemberState.STARTING, MemberState.SERVING)
        for worker_id, member in current.items():
            self.workers.setdefault(worker_id, WorkerState(worker_id, member.handle))

    def _pool_needs_config(self, membership: Membership) -> bool:
        return not membership.configured or membership.config_revision < self.revision

    async def apply(self, membership: Membership) -> None:
        """Add the serving workers the router lacks, mark the leaving, drop the unlisted; then
        hold `membership.version` (acknowledged on the next poll)."""
        listed = {m.worker_id: m for m in membership.members}
        joining = []
        for worker_id, member in listed.items():
            state = self.workers.get(worker_id)
            if state is None and member.state == MemberState.SERVING:
                state = self.workers[worker_id] = WorkerState(worker_id, member.handle)
                joining.append(state)
                self.joined += 1
            if state is not None:
                state.leaving = member.state == MemberState.LEAVING
        for worker_id in [w for w in self.workers if w not in listed]:
            del self.workers[worker_id]
            self.liveness.forget(worker_id)
            self.view.drop_worker(worker_id)
            self.left += 1
        await asyncio.gather(*(self.liveness.revive(w) for w in joining))
        self.held = membership.version
