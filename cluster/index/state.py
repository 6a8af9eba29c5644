"""The prefix index's state without Ray: which workers hold which cached KV blocks.

`PrefixIndexState` owns the whole mirror: the `block hash → workers` map in LRU order and, per
worker, the incarnation (`epoch`) and event sequence number it has applied up to. Every rule is
unit-tested here alone; `cluster/index/prefix_index.py` (the actor) and its docstring say how the
state is fed and resynced.

Every change the state applies to the map is also appended, in apply order, to its `FeedLog`
(`cluster/index/feed.py`): a block stored for a worker or removed from it, a worker's entries
replaced by a snapshot, a worker dropped or cleared, an entry evicted by the LRU bound. Router
replicas follow that feed to keep their own copy (`cluster/index/view.py`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.cluster.index.feed import (
    DEFAULT_FEED_CAPACITY,
    Evicted,
    FeedLog,
    Removed,
    Stored,
    WorkerCleared,
    WorkerReplaced,
)
from pagedserve.cluster.index.match import leading_matches
from pagedserve.cluster.index.stats import IndexStats
from pagedserve.workers.protocol.blocks import BlockHash
from pagedserve.workers.protocol.events import (
    TIER_NAMES,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVSnapshot,
    KVTier,
)

DEFAULT_MAX_ENTRIES = 1_000_000


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
    # The tier of each held block that is not on the device (`host`, `disk`); the rest are.
    lower_tiers: dict[BlockHash, str] = field(default_factory=dict)
    stale: bool = False


@dataclass
class _Counters:
    """The counters of `IndexStats` that the state keeps (same names)."""

    resyncs: int = 0
    gaps_detected: int = 0
    restarts_detected: int = 0
    evictions: int = 0
    events_applied: int = 0
    duplicates_ignored: int = 0


class PrefixIndexState:
    """The `block hash → workers` map with per-worker event bookkeeping; no Ray.

    Owns the entries (in LRU order), the per-worker views, the counters and the change feed
    (`feed`). Not thread-safe: the actor calls it from one event loop.

    Args:
        max_entries: most hash entries kept; beyond it the least recently used is evicted.
        feed_capacity: changes the feed keeps for subscribers that fall behind.
    """

    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, feed_capacity: int = DEFAULT_FEED_CAPACITY
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        # Oldest first; `move_to_end` marks an entry most recently used.
        self._entries: OrderedDict[BlockHash, set[str]] = OrderedDict()
        self._views: dict[str, _WorkerView] = {}
        self._counters = _Counters()
        self.feed = FeedLog(self._dump, feed_capacity, dump_tiers=self._dump_tiers)

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
        worker_id = snapshot.worker_id
        self._drop(worker_id)
        view = _WorkerView(epoch=snapshot.epoch, next_seq=snapshot.next_seq)
        self._views[worker_id] = view
        for block_hash, tier in zip(snapshot.block_hashes, snapshot.tiers(), strict=True):
            self._store(worker_id, view, block_hash, logged=False, tier=tier)
        # One entry for the whole snapshot, after any evictions it caused: what it left.
        hashes = frozenset(view.hashes)
        self.feed.append(WorkerReplaced, worker_id, hashes, dict(view.lower_tiers))
        self._counters.resyncs += 1
        return True

    def remove_worker(self, worker_id: str) -> int:
        """Forget a worker and drop all its entries at once.

        Returns:
            How many entries it held.
        """
        view = self._drop(worker_id)
        if view is None:
            return 0
        self.feed.append(WorkerCleared, worker_id)
        return len(view.hashes)

    # ----------------------------------------------------------------- queries
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker, how many leading `block_hashes` it holds (its cached prefix, in blocks).

        A hash a worker lacks ends that worker's prefix even if it holds later ones. Workers with
        no leading block are omitted. Matched entries become most recently used. Costs
        O(len(block_hashes) × holders) and stops as soon as no worker is still matching.
        """
        return leading_matches(block_hashes, self._entries, self._entries.move_to_end)

    def epoch_of(self, worker_id: str) -> str | None:
        """The incarnation of `worker_id` the index's view is of (None: no view)."""
        view = self._views.get(worker_id)
        return None if view is None else view.epoch

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

    def tier_of(self, worker_id: str, block_hash: BlockHash) -> str | None:
        """Where `worker_id` holds `block_hash` at best (`device`, `host`, `disk`), or None."""
        view = self._views.get(worker_id)
        if view is None or block_hash not in view.hashes:
            return None
        return view.lower_tiers.get(block_hash, KVTier.DEVICE)

    def tier_counts(self, worker_id: str) -> dict[str, int]:
        """How many of `worker_id`'s blocks the index has in each tier."""
        view = self._views.get(worker_id)
        if view is None:
            return {}
        counts = Counter(view.lower_tiers.values())
        counts[KVTier.DEVICE] = len(view.hashes) - len(view.lower_tiers)
        return {tier: counts[tier] for tier in TIER_NAMES}

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
            **dataclasses.asdict(counters),
        )

    def check_invariants(self) -> None:
        """Assert the entry map and the per-worker views mirror each other exactly."""
        assert len(self._entries) <= self.max_entries
        links = {(w, h) for h, holders in self._entries.items() for w in holders}
        assert all(holders for holders in self._entries.values()), "empty entry kept"
        assert links == {(w, h) for w, view in self._views.items() for h in view.hashes}
        for view in self._views.values():
            assert view.lower_tiers.keys() <= view.hashes, "a tier kept for a block not held"

    # ----------------------------------------------------------------- internals
    def _apply(self, worker_id: str, view: _WorkerView, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._store(worker_id, view, event.block_hash, tier=event.tier)
        elif isinstance(event, BlockRemoved):
            block_hash = event.block_hash
            if block_hash in view.hashes:  # else already gone (LRU): nothing changes
                view.hashes.discard(block_hash)
                view.lower_tiers.pop(block_hash, None)
                self._unlink(worker_id, block_hash)
                self.feed.append(Removed, worker_id, block_hash)
        elif isinstance(event, AllCleared):
            for block_hash in view.hashes:
                self._unlink(worker_id, block_hash)
            view.hashes.clear()
            view.lower_tiers.clear()
            self.feed.append(WorkerCleared, worker_id)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def _drop(self, worker_id: str) -> _WorkerView | None:
        """Forget a worker and unlink its entries, unlogged; its old view (None: unknown)."""
        view = self._views.pop(worker_id, None)
        if view is not None:
            for block_hash in view.hashes:
                self._unlink(worker_id, block_hash)
        return view

    def _dump(self) -> dict[str, frozenset[BlockHash]]:
        """Worker id → the hashes it holds: the feed's reset point."""
        return {worker_id: frozenset(view.hashes) for worker_id, view in self._views.items()}

    def _dump_tiers(self) -> dict[str, dict[BlockHash, str]]:
        """Worker id → its blocks below the device (hash → tier), for the feed's dumps."""
        return {worker_id: dict(view.lower_tiers) for worker_id, view in self._views.items()}

    def _store(
        self,
        worker_id: str,
        view: _WorkerView,
        block_hash: BlockHash,
        logged: bool = True,
        tier: KVTier = KVTier.DEVICE,
    ) -> None:
        """Link `worker_id` to `block_hash` (held at best in `tier`); `logged=False` when the
        caller logs the change. A held block whose tier changes is logged again, with it."""
        held_in = (
            view.lower_tiers.get(block_hash, KVTier.DEVICE) if block_hash in view.hashes else None
        )
        if tier == KVTier.DEVICE:
            view.lower_tiers.pop(block_hash, None)
        else:
            view.lower_tiers[block_hash] = tier
        holders = self._entries.get(block_hash)
        if holders is None:
            holders = self._entries[block_hash] = set()
        else:
            self._entries.move_to_end(block_hash)
        if logged and (worker_id not in holders or held_in != tier):
            self.feed.append(Stored, worker_id, block_hash, tier)
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
                self._views[worker_id].lower_tiers.pop(block_hash, None)
            self.feed.append(Evicted, block_hash)
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
