"""The cluster's prefix index: which workers hold which cached KV blocks.

`PrefixIndexState` owns the whole mirror: the `block hash → workers` map in LRU order and, per
worker, the incarnation (`epoch`) and event sequence number it has applied up to. It has no Ray
in it, so every rule is unit-tested alone. `PrefixIndexActor` is the thin named Ray actor around
it: it keeps each worker's handle and, when the state says a worker is out of step, pulls that
worker's `KVSnapshot` under a deadline.

    worker pool ──events(seq 0,1,2,…)──► publish ──in order──► state
          ▲                                 │ gap / new epoch / unknown
          └──────── kv_snapshot() ◄─────────┘ (deadline) ──► apply_snapshot

Rules, in the order `publish` checks them:

- unknown worker: nothing applied, resync needed (only a snapshot introduces a worker);
- another epoch (the worker restarted, its cache is gone): its entries are dropped at once, the
  worker is forgotten, resync needed;
- stale (a gap was seen earlier): nothing applied until a snapshot arrives;
- events with `seq` below the expected one are duplicates and ignored; the rest must run
  consecutively from the expected `seq`, else the batch is refused whole and the worker is
  marked stale. Its entries are *kept* while stale: the gap means a few events were lost, so the
  rest are still good routing hints, and a wrong hint costs one prefill, never correctness. The
  actor resyncs in the same call, so the stale window lasts at most one snapshot deadline; when
  that resync fails the actor drops the worker instead, so an index never stays stale.

Memory is bounded by `max_entries` hash entries. Stored events and `match` hits refresh an entry;
the least recent is evicted, which loses routing information only.

Routers do not ask the actor on the request path: each router replica keeps its own copy
(`cluster/index/view.py`), fed by the actor's change feed (`cluster/index/feed.py`). Every
change the state applies is logged in order with a contiguous offset; `read_feed(epoch,
cursor, wait_s)` long-polls for the entries after a subscriber's cursor, or answers with a
dump of the whole state when the cursor is older than the log keeps or belongs to another
epoch (each start of the actor is a new feed epoch, so a restarted index resets every view).

    state ──changes, in apply order──► FeedLog ──read_feed──► each router's PrefixView

Since routing now matches against the routers' copies, an entry's recency in the index comes
from stores alone (a `match` call still refreshes, for the tools that make one).

Being the one actor every router replica already talks to, it also keeps the replicas' counter
reports (`cluster/router/reports.py`), so any replica answers GetStats for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.index.feed import DEFAULT_FEED_CAPACITY, FeedBatch
from pagedserve.cluster.index.state import (
    DEFAULT_MAX_ENTRIES,
    PrefixIndexState,
    PublishResult,
)
from pagedserve.cluster.index.stats import IndexStats
from pagedserve.cluster.pool.types import MemberState
from pagedserve.cluster.router.reports import ClusterRouters, RouterReport, RouterReports
from pagedserve.workers.deadline import within
from pagedserve.workers.process.cpu_placement import pin_process, set_niceness
from pagedserve.workers.protocol.blocks import BlockHash
from pagedserve.workers.protocol.events import KVEvent, KVSnapshot

__all__ = ["PrefixIndexActor", "PrefixIndexState", "PublishResult"]

logger = logging.getLogger(__name__)

DEFAULT_INDEX_NAME = "pagedserve-prefix-index"
DEFAULT_SNAPSHOT_TIMEOUT_S = 10.0
# The pool's answer at the index's start: a pool starting too answers once it has found the
# index and created or adopted its workers. The index serves meanwhile (a background task).
POOL_MEMBERSHIP_TIMEOUT_S = 60.0


@ray.remote
class PrefixIndexActor:
    """The named actor that owns the cluster's `PrefixIndexState` and resyncs workers.

    Owns the state, each worker's handle (to pull its snapshot) and one lock per worker so that
    a worker's publishes and resyncs apply one at a time, in order.

    A worker must be able to answer `kv_snapshot()` while its `publish` call is pending (an
    async actor, or a publish that is not awaited inside a method of a one-at-a-time actor),
    otherwise the resync waits out the deadline.

    On every start (Ray restarts it with the same arguments) it asks the worker pool named
    `pool_name` for its members now (serving or leaving: a starting one registers itself when
    ready), looks up `worker_names` too, and resyncs each worker found from its snapshot at
    once, so that a restarted index is not blind until some worker happens to publish, however
    the pool has grown or been replaced since the index was created. No pool yet (the first
    start comes before it) or one that does not answer leaves the names alone; a name with no
    actor yet is skipped: that worker registers itself when it is ready.

    Args:
        max_entries: the state's LRU bound.
        snapshot_timeout_s: deadline for one `kv_snapshot()` call.
        feed_capacity: changes the feed keeps; a router further behind resets from a dump.
        worker_names: the named worker actors to resync from on start.
        namespace: their Ray namespace, and the pool's (None: the index's own).
        cpus: the cores to pin this actor's process to (`PlacementConfig.control_cpus`; None:
            not pinned).
        nice: its niceness (`PlacementConfig.control_nice`; None: Ray's).
    """

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        snapshot_timeout_s: float = DEFAULT_SNAPSHOT_TIMEOUT_S,
        worker_names: Sequence[str] = (),
        namespace: str | None = None,
        cpus: tuple[int, ...] | None = None,
        nice: int | None = None,
        feed_capacity: int = DEFAULT_FEED_CAPACITY,
        pool_name: str | None = None,
    ) -> None:
        if cpus is not None:
            pin_process(cpus, what="prefix index")
        if nice is not None:
            set_niceness(nice, what="prefix index")
        if snapshot_timeout_s <= 0:
            raise ValueError(f"snapshot_timeout_s must be > 0, got {snapshot_timeout_s}")
        self._state = PrefixIndexState(max_entries, feed_capacity)
        # Set on every feed append and replaced by a fresh one: what `read_feed` waits on.
        self._feed_changed = asyncio.Event()
        self._state.feed.on_append = self._wake_feed_readers
        self._handles: dict[str, ActorHandle] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._snapshot_timeout_s = snapshot_timeout_s
        self._snapshot_failures = 0
        self._startup_resyncs = 0
        self._routers = RouterReports()
        # Ray runs an async actor's __init__ on the actor's event loop, so the resync starts
        # now and methods are served meanwhile (match answers from what has arrived so far).
        self._startup = asyncio.get_running_loop().create_task(
            self._resync_at_start(tuple(worker_names), pool_name, namespace)
        )

    async def _resync_at_start(
        self, worker_names: Sequence[str], pool_name: str | None, namespace: str | None
    ) -> None:
        """Find the pool's members and each named worker, and resync them; each snapshot under
        its own deadline."""
        found = await asyncio.gather(*(_find_actor(n, namespace) for n in worker_names))
        handles = {n: h for n, h in zip(worker_names, found, strict=True) if h is not None}
        if pool_name is not None:
            handles.update(await self._pool_members(pool_name, namespace))
        for worker_id, handle in handles.items():
            self._handles.setdefault(worker_id, handle)  # a fresh registration wins

        async def resync(worker_id: str) -> None:
            async with self._locks.setdefault(worker_id, asyncio.Lock()):
                if await self._resync(worker_id) is not None:
                    self._startup_resyncs += 1

        await asyncio.gather(*(resync(worker_id) for worker_id in handles))

    async def _pool_members(self, pool_name: str, namespace: str | None) -> dict[str, ActorHandle]:
        """The pool's serving and leaving members now; none when there is no pool (yet) or it
        does not answer within `POOL_MEMBERSHIP_TIMEOUT_S`."""
        pool = await _find_actor(pool_name, namespace)
        if pool is None:
            return {}
        try:
            membership = await within(pool.membership.remote(), timeout=POOL_MEMBERSHIP_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError) as error:
            logger.warning("prefix index: no membership from the pool: %r", error)
            return {}
        members = membership.in_state(MemberState.SERVING, MemberState.LEAVING)
        return {worker_id: member.handle for worker_id, member in members.items()}

    async def register_worker(self, worker_id: str, handle: ActorHandle, epoch: str) -> None:
        """Remember the handle used to resync `worker_id` and, when the index has no view of
        the worker's incarnation `epoch` (none yet, or of an older process), resync it from
        its snapshot now.

        A worker that Ray restarted registers before anyone dropped its old incarnation when
        no router saw it dead (its next stats call just waited for the restart). Without the
        epoch, the index kept the old process's entries until the new one first published,
        which a quiet worker never does: a restarted worker's disk tier stayed out of the
        routers' views (the tiers test timed out on a loaded machine).

        Under the worker's lock, like publishes and resyncs: a registration that arrived while
        a resync of the same worker waited for its snapshot used to swap the handle under it,
        so that resync was dropped as moot and nothing resynced the worker until it next
        published (a restarted index stayed blind on a quiet cluster: the gRPC soak with two
        Router replicas caught it).
        """
        async with self._locks.setdefault(worker_id, asyncio.Lock()):
            self._handles[worker_id] = handle
            if self._state.epoch_of(worker_id) != epoch:
                await self._resync(worker_id)

    async def publish(
        self,
        worker_id: str,
        epoch: str,
        events: Sequence[KVEvent],
        next_seq: int | None = None,
    ) -> PublishResult:
        """Apply a batch; when out of step, pull the worker's snapshot and apply that instead.

        Args are those of `PrefixIndexState.publish`.
        """
        async with self._locks.setdefault(worker_id, asyncio.Lock()):
            result = self._state.publish(worker_id, epoch, events, next_seq)
            if not result.needs_resync:
                return result
            snapshot = await self._resync(worker_id)
            if snapshot is None:
                return result
            applied = 0
            if snapshot.epoch == epoch:
                # The snapshot covers the batch up to its next_seq; anything after it applies.
                applied = self._state.publish(worker_id, epoch, events, next_seq).applied
            return PublishResult(applied=applied, needs_resync=True, resynced=True)

    async def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._state.match(block_hashes)

    async def read_feed(self, epoch: str | None, cursor: int, wait_s: float) -> FeedBatch:
        """The feed's entries from `cursor` on, as soon as there is one (an empty batch after
        `wait_s`), or at once a dump when the cursor cannot be served (see `FeedLog.read`).

        Args:
            epoch: the feed epoch the subscriber follows (None: it has nothing yet).
            cursor: the offset it needs next.
            wait_s: how long to wait for a change when there is none yet.
        """
        feed = self._state.feed
        if epoch == feed.epoch and cursor == feed.next_offset and wait_s > 0:
            changed = self._feed_changed
            with contextlib.suppress(TimeoutError):
                await within(changed.wait(), wait_s)
        return feed.read(epoch, cursor)

    def _wake_feed_readers(self) -> None:
        self._feed_changed.set()
        self._feed_changed = asyncio.Event()

    async def remove_worker(self, worker_id: str) -> int:
        """Forget a dead worker: its handle and all its entries, at once."""
        self._handles.pop(worker_id, None)
        self._locks.pop(worker_id, None)
        return self._state.remove_worker(worker_id)

    async def snapshot_of(self, worker_id: str) -> set[BlockHash]:
        return self._state.hashes_of(worker_id)

    async def tier_counts(self, worker_id: str) -> dict[str, int]:
        """How many of the worker's blocks the index has per tier (`device`, `host`, `disk`)."""
        return self._state.tier_counts(worker_id)

    async def stats(self) -> IndexStats:
        return dataclasses.replace(
            self._state.stats(),
            registered_workers=tuple(sorted(self._handles)),
            snapshot_failures=self._snapshot_failures,
            startup_resyncs=self._startup_resyncs,
        )

    async def report_router(self, report: RouterReport) -> None:
        """A router replica's latest counters (sent every stats interval)."""
        self._routers.put(report)

    async def routers(self) -> ClusterRouters:
        """Every router replica's counters summed, and their requests open on each worker."""
        return self._routers.cluster()

    async def check_invariants(self) -> str | None:
        """The state's invariants (`PrefixIndexState.check_invariants`): None when they hold,
        else what is broken."""
        try:
            self._state.check_invariants()
        except AssertionError as error:
            return str(error) or "the entry map and the per-worker views disagree"
        return None

    async def _resync(self, worker_id: str) -> KVSnapshot | None:
        """Fetch and apply `worker_id`'s snapshot; on any failure drop the worker's entries.

        Returns:
            The applied snapshot, or None when the index has no view of the worker afterwards.
        """
        handle = self._handles.get(worker_id)
        if handle is None:
            self._state.remove_worker(worker_id)
            return None
        snapshot = await self._fetch_snapshot(worker_id, handle)
        if self._handles.get(worker_id) is not handle:
            return None  # removed (or re-registered) while we waited: the reply is moot
        if snapshot is None or not self._state.apply_snapshot(snapshot):
            self._snapshot_failures += 1
            # Better no entries than stale ones; the next publish tries again.
            self._state.remove_worker(worker_id)
            return None
        return snapshot

    async def _fetch_snapshot(self, worker_id: str, handle: ActorHandle) -> KVSnapshot | None:
        ref = handle.kv_snapshot.remote()
        try:
            snapshot = await within(ref, timeout=self._snapshot_timeout_s)
        except (TimeoutError, ray.exceptions.RayError) as error:
            logger.warning("prefix index: no snapshot from %s: %r", worker_id, error)
            _cancel_quietly(ref)
            return None
        if not isinstance(snapshot, KVSnapshot) or snapshot.worker_id != worker_id:
            logger.warning("prefix index: bad snapshot from %s: %r", worker_id, snapshot)
            return None
        return snapshot


async def _find_actor(name: str, namespace: str | None) -> ActorHandle | None:
    """The named actor, or None when there is none (yet)."""
    try:
        return await asyncio.to_thread(ray.get_actor, name, namespace=namespace)
    except ValueError:
        return None


def _cancel_quietly(ref: ray.ObjectRef) -> None:
    """Best effort: a stuck worker may not be cancellable, and the index must not care."""
    try:
        ray.cancel(ref)
    except Exception:  # cancellation is an optimisation only
        logger.debug("prefix index: could not cancel %s", ref, exc_info=True)


def get_or_create_prefix_index(
    name: str = DEFAULT_INDEX_NAME,
    namespace: str | None = None,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    snapshot_timeout_s: float = DEFAULT_SNAPSHOT_TIMEOUT_S,
    worker_names: Sequence[str] = (),
    cpus: tuple[int, ...] | None = None,
    nice: int | None = None,
    pool_name: str | None = None,
) -> ActorHandle:
    """The cluster's prefix index actor, started if no actor of that name exists yet.

    The options only apply when the actor is created; an existing one keeps its own. Ray
    restarts a crashed index with the same options, and it resyncs at once from the snapshot of
    every member of the pool `pool_name` (serving or leaving) and every worker in
    `worker_names` that exists; any worker it missed registers again when its next publish
    finds the index out of step.

    Args:
        name: the actor's name.
        namespace: its Ray namespace (None: the job's); also the workers'.
        max_entries: the LRU bound on hash entries.
        snapshot_timeout_s: deadline for one worker snapshot during a resync.
        worker_names: the named worker actors to resync from whenever the index (re)starts.
        cpus: the cores the index pins itself to (None: not pinned).
        nice: its niceness (None: Ray's).
        pool_name: the worker pool actor (same namespace) that tells it its members.

    Returns:
        The actor's handle.
    """
    # Detached: the index must outlive whichever router replica happened to create it.
    return PrefixIndexActor.options(
        name=name, namespace=namespace, get_if_exists=True, max_restarts=-1, lifetime="detached"
    ).remote(
        max_entries=max_entries,
        snapshot_timeout_s=snapshot_timeout_s,
        worker_names=tuple(worker_names),
        namespace=namespace,
        cpus=cpus,
        nice=nice,
        pool_name=pool_name,
    )
