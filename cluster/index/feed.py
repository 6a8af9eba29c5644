"""The prefix index's change feed: every change to its state, in apply order, for subscribers.

Each router replica keeps its own copy of the index (`cluster/index/view.py`) so that routing
needs no remote call. `FeedLog` is how those copies stay true: `PrefixIndexState` appends one
entry per change it applies, in the order it applies them, and a subscriber that applies the
same entries in the same order holds the same `block hash → workers` map.

    PrefixIndexState ──append(offset 0,1,2,…)──► FeedLog (last `capacity` entries, an epoch)
                                                    │ read(epoch, cursor)
                       entries after cursor ◄───────┤ in range, same epoch
                       a dump of the whole state ◄──┘ cursor too old, or another epoch

Offsets run contiguously from 0 within one `epoch` (a fresh id each time the log is built, so
each incarnation of the index actor). A subscriber names the epoch and the offset it needs
next; a cursor the log no longer keeps, or one from another epoch, is answered with a dump of
the state, from which the subscriber resets. Entries and dumps carry each block's best tier
(`device`, `host`, `disk`), so a router can cost a lower-tier hit as the load it is. The
records here cross a process boundary: frozen dataclasses, no Ray.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pagedserve.workers.protocol.blocks import BlockHash
from pagedserve.workers.protocol.events import TIER_NAMES

DEFAULT_FEED_CAPACITY = 65_536


@dataclass(frozen=True, slots=True)
class Stored:
    """`worker_id` now holds `block_hash`, at best in `tier` (`device`, `host`, `disk`).

    A block already held is stored again when its tier changes (spilled down, loaded back)."""

    offset: int
    worker_id: str
    block_hash: BlockHash
    tier: str = TIER_NAMES[0]  # device


@dataclass(frozen=True, slots=True)
class Removed:
    """`worker_id` no longer holds `block_hash` (its pool evicted the block)."""

    offset: int
    worker_id: str
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class Evicted:
    """The index's LRU bound dropped `block_hash` for every holder."""

    offset: int
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class WorkerReplaced:
    """A snapshot replaced all of `worker_id`'s entries: it now holds exactly `block_hashes`,
    those in `lower_tiers` (hash → `host` or `disk`) below the device, the rest on it."""

    offset: int
    worker_id: str
    block_hashes: frozenset[BlockHash]
    lower_tiers: Mapping[BlockHash, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerCleared:
    """`worker_id` holds nothing any more (dropped from the index, or its cache was reset)."""

    offset: int
    worker_id: str


FeedEntry = Stored | Removed | Evicted | WorkerReplaced | WorkerCleared


@dataclass(frozen=True)
class FeedBatch:
    """One answer to a feed read.

    Attributes:
        epoch: the feed's epoch (one per incarnation of the index).
        next_offset: the offset the feed's next entry will carry; the subscriber's next cursor.
        entries: the entries from the cursor up to `next_offset`, in order (empty with a dump).
        dump: when not None, the whole state as of `next_offset` (worker id → the hashes it
            holds): the subscriber replaces its copy with it.
        dump_tiers: with a dump, worker id → its blocks below the device (hash → tier); a
            block not listed is on the device.
    """

    epoch: str
    next_offset: int
    entries: tuple[FeedEntry, ...] = ()
    dump: Mapping[str, frozenset[BlockHash]] | None = None
    dump_tiers: Mapping[str, Mapping[BlockHash, str]] | None = None


class FeedLog:
    """The last `capacity` changes of the index state, with contiguous offsets and an epoch.

    Owns the kept entries and the offset counter; the state it logs is read through `dump`
    (given by the owner) only when a subscriber must reset. Not thread-safe.

    Args:
        dump: returns the logged state now (worker id → hashes it holds).
        capacity: entries kept; a subscriber further behind gets a dump instead.
        on_append: called after every append (the actor wakes its long-polls with it).
        dump_tiers: returns each worker's blocks below the device now (hash → tier).
    """

    def __init__(
        self,
        dump: Callable[[], dict[str, frozenset[BlockHash]]],
        capacity: int = DEFAULT_FEED_CAPACITY,
        on_append: Callable[[], None] | None = None,
        dump_tiers: Callable[[], dict[str, dict[BlockHash, str]]] = dict,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"feed capacity must be >= 1, got {capacity}")
        self.epoch = uuid.uuid4().hex
        self.capacity = capacity
        self.on_append = on_append
        self._dump = dump
        self._dump_tiers = dump_tiers
        self._entries: deque[FeedEntry] = deque(maxlen=capacity)
        self.next_offset = 0

    @property
    def first_offset(self) -> int:
        """The oldest offset still kept (== `next_offset` while nothing is kept)."""
        return self.next_offset - len(self._entries)

    def append(self, kind: type[FeedEntry], *fields: object) -> None:
        """Log one change: an entry of `kind` with the next offset and `fields` after it."""
        self._entries.append(kind(self.next_offset, *fields))
        self.next_offset += 1
        if self.on_append is not None:
            self.on_append()

    def read(self, epoch: str | None, cursor: int) -> FeedBatch:
        """The entries from `cursor` on, or a dump when the cursor cannot be served.

        Args:
            epoch: the epoch the subscriber's cursor belongs to (None: it has nothing yet).
            cursor: the offset the subscriber needs next.
        """
        if epoch != self.epoch or not self.first_offset <= cursor <= self.next_offset:
            dump, tiers = self._dump(), self._dump_tiers()
            return FeedBatch(self.epoch, self.next_offset, dump=dump, dump_tiers=tiers)
        entries = tuple(itertools.islice(self._entries, cursor - self.first_offset, None))
        return FeedBatch(self.epoch, self.next_offset, entries)
