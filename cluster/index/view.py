"""A router replica's own copy of the prefix index, so that routing makes no remote call.

`PrefixView` (no Ray) owns the copy: `block hash → workers` and, per worker, the hashes it
holds and which of them sit below the device (host or disk tier), plus where in the index's
change feed (`cluster/index/feed.py`) the copy stands: the feed's epoch and the next offset.
It applies feed batches strictly in order; an entry past the expected offset is a gap, and a
batch of another epoch means the index restarted: either way the view marks itself for a
reset, and its next read is answered with a dump of the whole index. Entries below the
expected offset were applied already and are skipped, so a batch read twice changes nothing.
`match` answers exactly as `PrefixIndexState.match` does (each worker's longest leading
prefix), from the copy; `tier_hits` says where in each worker's tiers its matched prefix is,
so routing can cost a load (`cluster/routing/tier_costs.py`).

`FeedFollower` is the small async loop a `RouterCore` runs beside its requests: it long-polls
the index actor's `read_feed` from the view's cursor and applies what comes back. An index
that does not answer leaves the last view in place (routing goes on with it); each failed
read is counted (`on_error`) and retried after a short pause, and never reaches a request.

    PrefixIndexActor.read_feed(epoch, cursor, wait_s) ──► FeedFollower ──apply──► PrefixView
                                                                          route ──► match
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.index.feed import (
    Evicted,
    FeedBatch,
    FeedEntry,
    Removed,
    Stored,
    WorkerCleared,
    WorkerReplaced,
)
from pagedserve.cluster.index.match import leading_matches
from pagedserve.cluster.routing.tier_costs import TierHits
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.blocks import BlockHash
from pagedserve.workers.protocol.events import KVTier

logger = logging.getLogger(__name__)

FEED_WAIT_S = 5.0  # how long one read waits for a change before answering empty
RETRY_S = 0.2  # pause after a failed read: an index restarting answers within a few


@dataclass(frozen=True)
class ViewStats:
    """Where a router's view stands.

    Attributes:
        entries: block hashes in the view (each with one or more holders).
        workers: worker id → hashes the view believes it holds.
        epoch: the feed epoch the view follows (None: not yet synced).
        next_offset: the feed offset it needs next.
        resets: dumps applied (the first sync, a gap, a restarted index).
        entries_applied: feed entries applied.
    """

    entries: int
    workers: dict[str, int]
    epoch: str | None
    next_offset: int
    resets: int
    entries_applied: int


class PrefixView:
    """The router's mirror of the index: entries, per-worker hash sets, feed position; no Ray.

    Owns the copy and its counters. Not thread-safe: the router's event loop drives it.
    """

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._hashes: dict[str, set[BlockHash]] = {}
        # Per worker, its held blocks that are below the device (hash → `host` / `disk`).
        self._lower: dict[str, dict[BlockHash, str]] = {}
        self.epoch: str | None = None  # None: the next read asks for a dump
        self.next_offset = 0
        self.resets = 0
        self.entries_applied = 0

    # ----------------------------------------------------------------- updates
    def apply(self, batch: FeedBatch) -> bool:
        """Apply one feed batch in order.

        Returns:
            False when the batch does not continue the view (another epoch, or a gap): nothing
            of it is applied and the view asks for a dump next.
        """
        if batch.dump is not None:
            self._reset(batch)
            return True
        if batch.epoch != self.epoch:
            self.epoch = None
            return False
        fresh = [entry for entry in batch.entries if entry.offset >= self.next_offset]
        if any(entry.offset != self.next_offset + i for i, entry in enumerate(fresh)):
            self.epoch = None
            return False
        for entry in fresh:
            self._apply(entry)
        self.next_offset += len(fresh)
        self.entries_applied += len(fresh)
        return True

    def drop_worker(self, worker_id: str) -> None:
        """Forget a worker the router found dead, at once (the feed says so later too)."""
        self._lower.pop(worker_id, None)
        for block_hash in self._hashes.pop(worker_id, set()):
            self._unlink(worker_id, block_hash)

    # ----------------------------------------------------------------- queries
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker, how many leading `block_hashes` it holds; as `PrefixIndexState.match`.

        A hash a worker lacks ends that worker's prefix; workers with no leading block are
        omitted; stops as soon as no worker is still matching.
        """
        return leading_matches(block_hashes, self._holders)

    def tier_hits(
        self, block_hashes: Sequence[BlockHash], matches: dict[str, int]
    ) -> dict[str, TierHits]:
        """Per worker with a lower-tier block in its match, where its matched prefix is.

        Args:
            block_hashes: the prompt's block hashes.
            matches: `match(block_hashes)`.

        Returns:
            Worker id → `TierHits`; a worker absent holds its whole match on the device.
        """
        hits = {}
        for worker_id, matched in matches.items():
            lower = self._lower.get(worker_id)
            if not lower:
                continue
            tiers = [lower.get(block_hash) for block_hash in block_hashes[:matched]]
            if not any(tiers):
                continue
            device_prefix = tiers.index(next(t for t in tiers if t))
            hits[worker_id] = TierHits(
                device_prefix, tiers.count(KVTier.HOST), tiers.count(KVTier.DISK)
            )
        return hits

    def tier_of(self, worker_id: str, block_hash: BlockHash) -> str | None:
        """Where the view believes `worker_id` holds `block_hash` at best, or None."""
        if block_hash not in self._hashes.get(worker_id, ()):
            return None
        return self._lower.get(worker_id, {}).get(block_hash, KVTier.DEVICE)

    def hashes_of(self, worker_id: str) -> set[BlockHash]:
        """Hashes the view believes `worker_id` holds (a copy)."""
        return set(self._hashes.get(worker_id, ()))

    def stats(self) -> ViewStats:
        return ViewStats(
            entries=len(self._holders),
            workers={w: len(hashes) for w, hashes in sorted(self._hashes.items())},
            epoch=self.epoch,
            next_offset=self.next_offset,
            resets=self.resets,
            entries_applied=self.entries_applied,
        )

    def check_invariants(self) -> None:
        """Assert the entry map and the per-worker sets mirror each other exactly."""
        links = {(w, h) for h, holders in self._holders.items() for w in holders}
        assert all(self._holders.values()), "empty entry kept"
        assert all(self._hashes.values()), "empty worker set kept"
        assert links == {(w, h) for w, hashes in self._hashes.items() for h in hashes}
        for worker_id, lower in self._lower.items():
            assert lower, "empty tier map kept"
            assert lower.keys() <= self._hashes.get(worker_id, set()), "tier of a block not held"

    # ----------------------------------------------------------------- internals
    def _reset(self, batch: FeedBatch) -> None:
        assert batch.dump is not None
        self._holders.clear()
        self._hashes.clear()
        self._lower.clear()
        tiers = batch.dump_tiers or {}
        for worker_id, hashes in batch.dump.items():
            self._replace(worker_id, hashes, tiers.get(worker_id, {}))
        self.epoch = batch.epoch
        self.next_offset = batch.next_offset
        self.resets += 1

    def _apply(self, entry: FeedEntry) -> None:
        if isinstance(entry, Stored):
            self._link(entry.worker_id, entry.block_hash)
            self._set_tier(entry.worker_id, entry.block_hash, entry.tier)
        elif isinstance(entry, Removed):
            self._forget(entry.worker_id, entry.block_hash)
        elif isinstance(entry, Evicted):
            for worker_id in self._holders.get(entry.block_hash, set()).copy():
                self._forget(worker_id, entry.block_hash)
        elif isinstance(entry, WorkerReplaced):
            self._replace(entry.worker_id, entry.block_hashes, entry.lower_tiers)
        elif isinstance(entry, WorkerCleared):
            self.drop_worker(entry.worker_id)
        else:
            raise TypeError(f"not a feed entry: {entry!r}")

    def _replace(
        self,
        worker_id: str,
        hashes: frozenset[BlockHash] | set[BlockHash],
        lower_tiers: Mapping[BlockHash, str],
    ) -> None:
        self.drop_worker(worker_id)
        for block_hash in hashes:
            self._link(worker_id, block_hash)
        for block_hash, tier in lower_tiers.items():
            if block_hash in self._hashes.get(worker_id, ()):
                self._set_tier(worker_id, block_hash, tier)

    def _set_tier(self, worker_id: str, block_hash: BlockHash, tier: str) -> None:
        if tier != KVTier.DEVICE:
            self._lower.setdefault(worker_id, {})[block_hash] = tier
            return
        lower = self._lower.get(worker_id)
        if lower is not None and lower.pop(block_hash, None) is not None and not lower:
            del self._lower[worker_id]

    def _link(self, worker_id: str, block_hash: BlockHash) -> None:
        self._holders.setdefault(block_hash, set()).add(worker_id)
        self._hashes.setdefault(worker_id, set()).add(block_hash)

    def _forget(self, worker_id: str, block_hash: BlockHash) -> None:
        hashes = self._hashes.get(worker_id)
        if hashes is None or block_hash not in hashes:
            return
        hashes.discard(block_hash)
        if not hashes:
            del self._hashes[worker_id]
        self._set_tier(worker_id, block_hash, KVTier.DEVICE)  # no tier kept for a block not held
        self._unlink(worker_id, block_hash)

    def _unlink(self, worker_id: str, block_hash: BlockHash) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            return
        holders.discard(worker_id)
        if not holders:
            del self._holders[block_hash]


class FeedFollower:
    """Owns the loop that keeps a `PrefixView` following the index actor's feed.

    Args:
        view: the view to keep.
        index: the prefix index actor (its `read_feed`).
        rpc_timeout_s: how much longer than the long-poll one read may take.
        on_error: called for each read that failed or timed out (the router counts them).
        wait_s: the long-poll bound of one read.
        lost_errors: the exceptions that mean the index is unreachable (Ray's actor errors).
    """

    def __init__(
        self,
        view: PrefixView,
        index: Any,
        rpc_timeout_s: float,
        on_error: Callable[[], None] = lambda: None,
        wait_s: float = FEED_WAIT_S,
        lost_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.view = view
        self.index = index
        self.rpc_timeout_s = rpc_timeout_s
        self.on_error = on_error
        self.wait_s = wait_s
        self.lost_errors = lost_errors
        self.unreadable = False  # the last read failed (logged once per outage)

    async def read_once(self, wait_s: float) -> bool:
        """One read and apply; False (and `on_error`) when the index did not answer in time."""
        view = self.view
        ref = self.index.read_feed.remote(view.epoch, view.next_offset, wait_s)
        try:
            batch = await within(ref, wait_s + self.rpc_timeout_s)
        except (*self.lost_errors, TimeoutError) as error:
            self.on_error()
            if not self.unreadable:  # once per outage, not once per retry
                logger.warning("prefix feed unreadable (%r); routing keeps the last view", error)
            self.unreadable = True
            return False
        if self.unreadable:
            logger.warning("prefix feed readable again")
            self.unreadable = False
        view.apply(batch)
        return True

    async def run(self) -> None:
        """Follow the feed until cancelled."""
        while True:
            if not await self.read_once(self.wait_s):
                await asyncio.sleep(RETRY_S)
