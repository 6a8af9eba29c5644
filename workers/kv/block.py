"""Physical KV blocks and the free queue that orders their reuse.

The free queue is an intrusive doubly-linked list: each `Block` carries its own links, so a block
can leave the middle of the queue in O(1) when a prefix-cache hit revives it.

    head ⇄ [b7] ⇄ [b2] ⇄ [b9] ⇄ tail
           ▲ evicted first       ▲ freed last (kept longest)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pagedserve.workers.protocol.blocks import BlockHash, BlockKey


@dataclass(eq=False, slots=True)
class Block:
    """One physical block of the pool: its id, owners and (when full and cached) content key.

    `ref_cnt` counts block-table references; a block with `ref_cnt == 0` sits in the free queue.
    `block_hash`/`key` are set once the block is full and registered in the pool's cache.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    key: BlockKey | None = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    def reset_hash(self) -> None:
        self.block_hash = None
        self.key = None


class FreeBlockQueue:
    """Blocks with no owner, in eviction order: the head is reused first.

    Owns only the links between free blocks; ref counts and hashes belong to `BlockPool`.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(block_id=-1)
        self._tail = Block(block_id=-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> Block:
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append(self, block: Block) -> None:
        """Put `block` at the tail: reused last."""
        self._link_before(self._tail, block)

    def appendleft(self, block: Block) -> None:
        """Put `block` at the head: reused first."""
        assert self._head.next is not None
        self._link_before(self._head.next, block)

    def _link_before(self, anchor: Block, block: Block) -> None:
        if block.prev is not None or block.next is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        previous = anchor.prev
        assert previous is not None
        previous.next = block
        block.prev = previous
        block.next = anchor
        anchor.prev = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]
