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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.index_stats import IndexStats
from pagedserve.workers.block import BlockHash
from pagedserve.workers.kv_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVSnapshot,
)

logger = logging.getLogger(__name__)

DEFAULT_INDEX_NAME = "pagedserve-prefix-index"
DEFAULT_MAX_ENTRIES = 1_000_000
DEFAULT_SNAPSHOT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PublishResult:
    """What one `publish` did.

    Attributes:
        applied: events of the batch applied to the index.
        needs_resync: the index was out of step with the worker (unknown worker, new epoch,
            gap); from the state this means the batch was not applied.
        resynced: (actor only) a snapshot of the worker was then fetched and applied, so the
            index is back in step. `needs_resync and not resynced` from the actor means the
            worker is not in the index: it is not registered (the index may have restarted:
            register again) or its snapshot failed; the next publish retries.
    """

    applied: int
    needs_resync: bool
    resynced: bool = False


@dataclass
class _WorkerView:
    """What the index believes about one worker's pool."""

    epoch: str
    next_seq: int
    # The inverse of the entry map for this worker, so that `remove_worker` and `AllCleared`
    # cost O(worker's entries) rather than a scan of the whole index.
    hashes: set[BlockHash] = field(default_factory=set)
    stale: bool = False


@dataclass
class _Counters:
    resyncs: int = 0
    gaps_detected: int = 0
    restarts_detected: int = 0
    evictions: int = 0
    events_applied: int = 0
    duplicates_ignored: int = 0


class PrefixIndexState:
    """The `block hash → workers` map with per-worker event bookkeeping; no Ray.

    Owns the entries (in LRU order), the per-worker views and the counters. Not thread-safe:
    the actor calls it from one event loop.

    Args:
        max_entries: most hash entries kept; beyond it the least recently used is evicted.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        # Oldest first; `move_to_end` marks an entry most recently used.
        self._entries: OrderedDict[BlockHash, set[str]] = OrderedDict()
        self._views: dict[str, _WorkerView] = {}
        self._counters = _Counters()

    # ----------------------------------------------------------------- updates
    def publish(
        self,
        worker_id: str,
        epoch: str,
        events: Sequence[KVEvent],
        next_seq: int | None = None,
    ) -> PublishResult:
        """Apply a worker's batch of events if it continues exactly where the index is.

        Args:
            worker_id: the publishing worker.
            epoch: the worker's incarnation (new for each process start).
            events: the batch, in `seq` order.
            next_seq: optional, the seq the worker's next event will carry. Without it a lost
                batch is only noticed when a later event arrives; with it, an empty batch is a
                heartbeat that also catches a lost last batch.

        Returns:
            How many events were applied and whether a snapshot is needed. A batch that needs
            a resync is not applied at all.
        """
        view = self._views.get(worker_id)
        if view is None:
            return PublishResult(applied=0, needs_resync=True)
        if view.epoch != epoch:
            # A new incarnation starts with an empty pool: the old entries are all wrong.
            self._counters.restarts_detected += 1
            self.remove_worker(worker_id)
            return PublishResult(applied=0, needs_resync=True)
        if view.stale:
            return PublishResult(applied=0, needs_resync=True)
        fresh = [event for event in events if event.seq >= view.next_seq]
        if not _continues(view.next_seq, fresh, next_seq):
            self._counters.gaps_detected += 1
            view.stale = True
            return PublishResult(applied=0, needs_resync=True)
        for event in fresh:
            self._apply(worker_id, view, event)
        view.next_seq += len(fresh)
        self._counters.events_applied += len(fresh)
        self._counters.duplicates_ignored += len(events) - len(fresh)
        return PublishResult(applied=len(fresh), needs_resync=False)

    def apply_snapshot(self, snapshot: KVSnapshot) -> bool:
        """Replace everything known about `snapshot.worker_id` with the snapshot.

        A snapshot of the same epoch that is older than what the index already applied (a late
        reply) is ignored: applying it would roll the worker back.

        Returns:
            Whether the snapshot was applied.
        """
        if snapshot.next_seq < 0:
            raise ValueError(f"snapshot next_seq must be >= 0, got {snapshot.next_seq}")
        view = self._views.get(snapshot.worker_id)
        if view is not None and view.epoch == snapshot.epoch and snapshot.next_seq < view.next_seq:
            return False
        self.remove_worker(snapshot.worker_id)
        view = _WorkerView(epoch=snapshot.epoch, next_seq=snapshot.next_seq)
        self._views[snapshot.worker_id] = view
        for block_hash in snapshot.block_hashes:
            self._store(snapshot.worker_id, view, block_hash)
        self._counters.resyncs += 1
        return True

    def remove_worker(self, worker_id: str) -> int:
        """Forget a worker and drop all its entries at once.

        Returns:
            How many entries it held.
        """
        view = self._views.pop(worker_id, None)
        if view is None:
            return 0
        for block_hash in view.hashes:
            self._unlink(worker_id, block_hash)
        return len(view.hashes)

    # ----------------------------------------------------------------- queries
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker, how many leading `block_hashes` it holds (its cached prefix, in blocks).

        A hash a worker lacks ends that worker's prefix even if it holds later ones. Workers with
        no leading block are omitted. Matched entries become most recently used. Costs
        O(len(block_hashes) × holders) and stops as soon as no worker is still matching.
        """
        matched: dict[str, int] = {}
        still_matching: set[str] | None = None
        for depth, block_hash in enumerate(block_hashes):
            holders = self._entries.get(block_hash)
            if not holders:
                break
            survivors = set(holders) if still_matching is None else still_matching & holders
            if not survivors:
                break
            self._entries.move_to_end(block_hash)
            for worker_id in survivors:
                matched[worker_id] = depth + 1
            still_matching = survivors
        return matched

    def workers(self) -> list[str]:
        """Workers the index has a view of (stale ones included), sorted."""
        return sorted(self._views)

    def num_entries(self) -> int:
        return len(self._entries)

    def holders(self, block_hash: BlockHash) -> set[str]:
        """Workers holding `block_hash` (a copy; does not refresh recency)."""
        return set(self._entries.get(block_hash, ()))

    def hashes_of(self, worker_id: str) -> set[BlockHash]:
        """Hashes the index believes `worker_id` holds (a copy)."""
        view = self._views.get(worker_id)
        return set(view.hashes) if view is not None else set()

    def is_stale(self, worker_id: str) -> bool:
        view = self._views.get(worker_id)
        return view is not None and view.stale

    def stats(self) -> IndexStats:
        """Entry and worker counts plus the counters since construction."""
        counters = self._counters
        return IndexStats(
            entries=len(self._entries),
            max_entries=self.max_entries,
            workers={w: len(view.hashes) for w, view in sorted(self._views.items())},
            stale_workers=tuple(sorted(w for w, view in self._views.items() if view.stale)),
            resyncs=counters.resyncs,
            gaps_detected=counters.gaps_detected,
            restarts_detected=counters.restarts_detected,
            evictions=counters.evictions,
            events_applied=counters.events_applied,
            duplicates_ignored=counters.duplicates_ignored,
        )

    def check_invariants(self) -> None:
        """Assert the entry map and the per-worker views mirror each other exactly."""
        assert len(self._entries) <= self.max_entries
        links = {(w, h) for h, holders in self._entries.items() for w in holders}
        assert all(holders for holders in self._entries.values()), "empty entry kept"
        assert links == {(w, h) for w, view in self._views.items() for h in view.hashes}

    # ----------------------------------------------------------------- internals
    def _apply(self, worker_id: str, view: _WorkerView, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._store(worker_id, view, event.block_hash)
        elif isinstance(event, BlockRemoved):
            view.hashes.discard(event.block_hash)
            self._unlink(worker_id, event.block_hash)
        elif isinstance(event, AllCleared):
            for block_hash in view.hashes:
                self._unlink(worker_id, block_hash)
            view.hashes.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def _store(self, worker_id: str, view: _WorkerView, block_hash: BlockHash) -> None:
        holders = self._entries.get(block_hash)
        if holders is None:
            holders = self._entries[block_hash] = set()
        else:
            self._entries.move_to_end(block_hash)
        holders.add(worker_id)
        view.hashes.add(block_hash)
        self._evict_over_bound()

    def _unlink(self, worker_id: str, block_hash: BlockHash) -> None:
        """Remove `worker_id` from the entry's holders (the caller updates the view)."""
        holders = self._entries.get(block_hash)
        if holders is None:  # already evicted by the LRU bound
            return
        holders.discard(worker_id)
        if not holders:
            del self._entries[block_hash]

    def _evict_over_bound(self) -> None:
        while len(self._entries) > self.max_entries:
            block_hash, holders = self._entries.popitem(last=False)
            for worker_id in holders:
                self._views[worker_id].hashes.discard(block_hash)
            self._counters.evictions += 1


def _continues(expected: int, fresh: Sequence[KVEvent], next_seq: int | None) -> bool:
    """Whether `fresh` runs consecutively from `expected` and ends where `next_seq` says."""
    if any(event.seq != expected + i for i, event in enumerate(fresh)):
        return False
    if next_seq is None:
        return True
    end = expected + len(fresh)
    # An old, wholly duplicate batch may carry an older next_seq; that is no gap.
    return next_seq == end if fresh else next_seq <= end


@ray.remote
class PrefixIndexActor:
    """The named actor that owns the cluster's `PrefixIndexState` and resyncs workers.

    Owns the state, each worker's handle (to pull its snapshot) and one lock per worker so that
    a worker's publishes and resyncs apply one at a time, in order.

    A worker must be able to answer `kv_snapshot()` while its `publish` call is pending (an
    async actor, or a publish that is not awaited inside a method of a one-at-a-time actor),
    otherwise the resync waits out the deadline.

    On every start (Ray restarts it with the same arguments) it looks up `worker_names` and
    resyncs each worker that exists from its snapshot at once, so that a restarted index is not
    blind until some worker happens to publish. A name with no actor yet (the first start comes
    before the workers) is skipped: that worker registers itself when it is ready.

    Args:
        max_entries: the state's LRU bound.
        snapshot_timeout_s: deadline for one `kv_snapshot()` call.
        worker_names: the named worker actors to resync from on start.
        namespace: their Ray namespace (None: the index's own).
    """

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        snapshot_timeout_s: float = DEFAULT_SNAPSHOT_TIMEOUT_S,
        worker_names: Sequence[str] = (),
        namespace: str | None = None,
    ) -> None:
        if snapshot_timeout_s <= 0:
            raise ValueError(f"snapshot_timeout_s must be > 0, got {snapshot_timeout_s}")
        self._state = PrefixIndexState(max_entries)
        self._handles: dict[str, ActorHandle] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._snapshot_timeout_s = snapshot_timeout_s
        self._snapshot_failures = 0
        self._startup_resyncs = 0
        # Ray runs an async actor's __init__ on the actor's event loop, so the resync starts
        # now and methods are served meanwhile (match answers from what has arrived so far).
        self._startup = asyncio.get_running_loop().create_task(
            self._resync_named(tuple(worker_names), namespace)
        )

    async def _resync_named(self, worker_names: Sequence[str], namespace: str | None) -> None:
        """Look up each named worker and resync it; each snapshot under its own deadline."""
        found = await asyncio.gather(*(_find_actor(n, namespace) for n in worker_names))
        handles = {n: h for n, h in zip(worker_names, found, strict=True) if h is not None}
        for worker_id, handle in handles.items():
            self._handles.setdefault(worker_id, handle)  # a fresh registration wins

        async def resync(worker_id: str) -> None:
            async with self._locks.setdefault(worker_id, asyncio.Lock()):
                if await self._resync(worker_id) is not None:
                    self._startup_resyncs += 1

        await asyncio.gather(*(resync(worker_id) for worker_id in handles))

    async def register_worker(self, worker_id: str, handle: ActorHandle) -> None:
        """Remember the handle used to resync `worker_id`; its entries come with its publishes."""
        self._handles[worker_id] = handle

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

    async def remove_worker(self, worker_id: str) -> int:
        """Forget a dead worker: its handle and all its entries, at once."""
        self._handles.pop(worker_id, None)
        self._locks.pop(worker_id, None)
        return self._state.remove_worker(worker_id)

    async def snapshot_of(self, worker_id: str) -> set[BlockHash]:
        return self._state.hashes_of(worker_id)

    async def stats(self) -> IndexStats:
        return dataclasses.replace(
            self._state.stats(),
            registered_workers=tuple(sorted(self._handles)),
            snapshot_failures=self._snapshot_failures,
            startup_resyncs=self._startup_resyncs,
        )

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
            snapshot = await asyncio.wait_for(ref, timeout=self._snapshot_timeout_s)
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
) -> ActorHandle:
    """The cluster's prefix index actor, started if no actor of that name exists yet.

    The options only apply when the actor is created; an existing one keeps its own. Ray
    restarts a crashed index with the same options, and it resyncs at once from the snapshot of
    every worker in `worker_names` that exists; any worker it missed registers again when its
    next publish finds the index out of step.

    Args:
        name: the actor's name.
        namespace: its Ray namespace (None: the job's); also the workers'.
        max_entries: the LRU bound on hash entries.
        snapshot_timeout_s: deadline for one worker snapshot during a resync.
        worker_names: the named worker actors to resync from whenever the index (re)starts.

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
    )
