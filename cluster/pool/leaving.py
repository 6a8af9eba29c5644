"""How a worker leaves the worker pool (`cluster/pool/pool.py`): retired (scale-down, or
replaced by a reconcile) or removed when lost.

- **retire**: publish it leaving and wait until every router holds that version (out of
  routing everywhere; a router silent for longer than its lease counts no more); push its hot
  cached prefixes to peers with room (`cluster/pool/handover.py`); drain it (`Worker.drain`:
  open streams get `scale_down_grace_s`, the rest are handed back and replayed on peers, none
  lost); push again what its last requests left cached; drop it from the membership and wait
  until every router forgot it; then kill it and drop it from the index.
- **lost**: a worker gone for good is dropped from the membership and the index at once
  (its routers replay what it had).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.handover import HandoverResult, hand_over
from pagedserve.cluster.pool.members import PoolMembers
from pagedserve.cluster.pool.migration import Migrations
from pagedserve.cluster.pool.planner import Reason
from pagedserve.cluster.pool.types import MembershipVersion, MemberState, PoolCounters
from pagedserve.cluster.router.metrics import RouterMetrics
from pagedserve.cluster.router.types import RouterCounters
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within
from pagedserve.workers.telemetry.telemetry import NOOP

logger = logging.getLogger(__name__)
CALL_ERRORS = (*WORKER_LOST_ERRORS, TimeoutError, ray.exceptions.RayError)


class PoolLeaving:
    """The pool's part that takes workers out (`WorkerPoolActor` inherits it): it uses the
    pool's config, members, counters and index handle."""

    _config: PoolConfig
    _index: ActorHandle | None
    members: PoolMembers
    counters: PoolCounters

    async def _retire(self, worker_id: str, reason: Reason) -> None:
        """Out of routing everywhere, cache handed over, drained, forgotten, then stopped."""
        member = self.members.get(worker_id)
        assert member is not None
        self.members.set_state(worker_id, MemberState.LEAVING)
        await self._routers_hold(self.members.version)
        source = WorkerState(worker_id, member.handle)
        first = await self._hand_over(source, member.fingerprint)
        await self._drain(member.handle)
        second = await self._hand_over(source, member.fingerprint)
        # Counted in the same step as the removal, so that stats never show one without the
        # other (a snapshot taken while the routers catch up reads both).
        self.members.remove(worker_id)
        counters = self.counters
        counters.workers_removed += 1
        counters.workers_replaced += reason == Reason.RECONCILE
        counters.handover_chains += first.chains + second.chains
        counters.handover_blocks += first.blocks + second.blocks
        await self._routers_hold(self.members.version)
        self._kill(member.handle)
        await self._forget_in_index(worker_id)

    async def _remove_lost(self, worker_id: str) -> None:
        """A worker gone for good: nothing to hand over or drain (its routers replay what it
        had); out of the membership and the index at once."""
        member = self.members.get(worker_id)
        assert member is not None
        logger.warning("pool: worker %s is gone for good; removing it", worker_id)
        self.members.remove(worker_id)
        self.counters.workers_lost += 1
        self._kill(member.handle)
        await self._forget_in_index(worker_id)

    async def _routers_hold(self, version: MembershipVersion) -> None:
        """Wait until every live router holds `version`, at most one lease."""
        failure = self._config.failure
        end = time.monotonic() + failure.lease_timeout_s
        while time.monotonic() < end:
            if self.members.routers_caught_up(version, time.monotonic(), failure.lease_timeout_s):
                return
            await asyncio.sleep(failure.stats_interval_s)
        logger.warning("pool: not every router took membership %s within a lease", version)

    async def _hand_over(self, source: WorkerState, fingerprint: str) -> HandoverResult:
        peers = [
            WorkerState(m.worker_id, m.handle)
            for m in self._in_state(MemberState.SERVING)
            if m.fingerprint == fingerprint and m.worker_id != source.worker_id
        ]
        config = self._config
        if not peers or not config.routing.enable_push:
            return HandoverResult()
        timeout_s = config.failure.rpc_timeout_s
        disaggregated = config.scaling.disaggregated
        migrations = Migrations(
            config.routing,
            timeout_s,
            disaggregated,
            self._index,
            {},
            NOOP,
            RouterCounters(),
            RouterMetrics(False, dict),
        )
        try:
            return await hand_over(source, peers, migrations, self._index, timeout_s)
        except CALL_ERRORS:
            logger.warning("pool: handover from %s failed", source.worker_id, exc_info=True)
            return HandoverResult()

    async def _drain(self, handle: ActorHandle) -> None:
        grace = self._config.scaling.scale_down_grace_s
        try:
            deadline_s = grace + self._config.failure.rpc_timeout_s
            result = await within(handle.drain.remote(grace), deadline_s)
        except CALL_ERRORS:
            logger.warning("pool: drain failed; its routers replay what it had", exc_info=True)
            return
        self.counters.drain_finished += result.finished
        self.counters.drain_handed_off += result.handed_off

    def _kill(self, handle: ActorHandle) -> None:
        with contextlib.suppress(ValueError):  # gone already
            ray.kill(handle, no_restart=True)

    async def _forget_in_index(self, worker_id: str) -> None:
        try:
            timeout_s = self._config.failure.rpc_timeout_s
            await within(self._index.remove_worker.remote(worker_id), timeout_s)
        except CALL_ERRORS:
            logger.warning("pool: could not drop %s from the index", worker_id)

    def _in_state(self, *states: MemberState) -> list:
        return [m for m in self.members.members() if m.state in states]
