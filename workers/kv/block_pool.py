"""The pool of physical KV blocks: ownership counts, the free queue and the prefix cache.

`BlockPool` owns every `Block`, the `FreeBlockQueue` and the `hash → block` map. A block whose
last owner lets go goes back to the free queue; if it holds a full, hashed block of KV it stays
in the map ("cached, evictable") until the queue hands it out again. Blocks holding nothing worth
keeping go to the head of the queue so they are reused before any cached content is evicted.

With lower tiers attached (`attach_lower_tiers`, a `TierStore`), a cached block that is evicted
is first handed to the tiers (`TierStore.spill`, which copies its KV out before anyone can write
the block), and the events say where each block now is at best: `BlockStored(tier=...)` when it
is still held in a lower tier, `BlockRemoved` only once no tier holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedserve.workers.kv.block import Block, FreeBlockQueue
from pagedserve.workers.protocol.blocks import BlockHash, BlockKey
from pagedserve.workers.protocol.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVTier,
)

if TYPE_CHECKING:
    from pagedserve.workers.kv.tiers import TierStore

logger = logging.getLogger(__name__)


class BlockPool:
    """All blocks of one worker's KV pool.

    Args:
        num_blocks: physical blocks in the pool.
        enable_caching: keep freed full blocks findable by hash until they are reused.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self._events: list[KVEvent] = []
        self._next_event_seq = 0
        self.num_events_published = 0
        self.lower: TierStore | None = None

    def attach_lower_tiers(self, lower: TierStore) -> None:
        """Spill evicted cached blocks into `lower`, and announce what it already holds (a
        disk tier that survived a restart)."""
        self.lower = lower
        lower.announce = self._announce_lower
        for block_hash, key, tier in lower.held_blocks():
            if block_hash not in self.cached:
                self._emit(BlockStored(self._take_seq(), block_hash, key.parent_hash, -1, tier))

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, cached or not: what an allocation can take."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for block in self.cached.values() if block.ref_cnt == 0)

    def get_cached_block(self, block_hash: BlockHash, key: BlockKey) -> Block | None:
        """The block cached under `block_hash` if its content is exactly `key`.

        A hash collision can never hand a request another prefix's KV: the stored parent hash,
        token ids and extra keys must all match.
        """
        block = self.cached.get(block_hash)
        if block is None or block.key != key:
            return None
        return block

    # ------------------------------------------------------------- ownership
    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` from the head of the free queue, evicting their cached content."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self.free_queue)} are free")
        taken = []
        evicted: list[tuple[int, BlockHash, BlockKey]] = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                evicted.append((block.block_id, block.block_hash, block.key))
                del self.cached[block.block_hash]
                block.reset_hash()
            block.ref_cnt = 1
            taken.append(block)
        if evicted and self.lower is not None:
            try:  # the blocks still hold their KV: nothing writes them before the caller
                self.lower.spill(evicted)
            except Exception:  # a lost spill costs a prefill later, never the allocation
                logger.exception("spilling %d evicted blocks down a tier failed", len(evicted))
        for block_id, digest, key in evicted:
            self._announce_gone(digest, key.parent_hash, block_id)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add one owner to each block, reviving cached free blocks out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[Block]) -> None:
        """Drop one owner from each block; blocks left without owners become free.

        Callers pass a request's blocks tail first, so that when a cached prefix must be evicted
        its deepest blocks (least likely to be shared) go first.
        """
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # ---------------------------------------------------------------- caching
    def cache_full_block(self, block: Block, block_hash: BlockHash, key: BlockKey) -> None:
        """Register a block that just became full under its chained hash.

        When another block already holds the same content (two requests computed the same
        prefix concurrently) the first stays the canonical copy and this one stays unhashed.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.key = key
        self.cached[block_hash] = block
        self._emit(BlockStored(self._take_seq(), block_hash, key.parent_hash, block.block_id))

    def uncache_block(self, block: Block) -> None:
        """Forget the hash of a block whose KV will not be written after all (its slots were
        allocated for a step that did not compute them), so no lookup can ever hit it."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
            raise ValueError(f"block {block.block_id} is not the cached block of its hash")
        self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        digest, parent = block.block_hash, block.key.parent_hash
        del self.cached[digest]
        block.reset_hash()
        self._announce_gone(digest, parent, block.block_id)

    def _announce_gone(self, digest: BlockHash, parent: BlockHash | None, block_id: int) -> None:
        """The device no longer holds `digest`: say where it is now, if anywhere."""
        tier = None if self.lower is None else self.lower.tier_of(digest)
        if tier is None:
            self._emit(BlockRemoved(self._take_seq(), digest, block_id))
        else:
            self._emit(BlockStored(self._take_seq(), digest, parent, -1, tier))

    def _announce_lower(self, digest: BlockHash, parent: BlockHash | None) -> None:
        """A lower tier's copy of `digest` moved or left (the `TierStore` callback)."""
        if digest not in self.cached:  # while the device holds it, that is its tier
            self._announce_gone(digest, parent, -1)

    def held_blocks(self) -> list[tuple[BlockHash, str]]:
        """(hash, fastest tier) of every block this pool can give back: its prefix snapshot."""
        held = [(digest, KVTier.DEVICE) for digest in self.cached]
        if self.lower is not None:
            held += [(h, tier) for h, _, tier in self.lower.held_blocks() if h not in self.cached]
        return held

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash, in every tier. Blocks in use keep their KV; only sharing
        is lost."""
        for block in self.cached.values():
            block.reset_hash()
        self.cached.clear()
        if self.lower is not None:
            self.lower.clear()
        self._emit(AllCleared(self._take_seq()))

    # ----------------------------------------------------------------- events
    def _take_seq(self) -> int:
        seq = self._next_event_seq
        self._next_event_seq += 1
        return seq

    def _emit(self, event: KVEvent) -> None:
        self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, in sequence order."""
        events, self._events = self._events, []
        self.num_events_published += len(events)
        return events

    @property
    def next_event_seq(self) -> int:
        return self._next_event_seq
