"""The host-memory tier: cached KV blocks evicted from the device pool, kept in CPU memory.

    device pool ──evict──▶ HostTier (LRU, bounded bytes) ──evict LRU──▶ disk tier, or dropped

Entries are keyed by the same chained block hash as the device pool's cache, and each keeps the
block's full `BlockKey`, so a lookup verifies the exact content (parent, tokens, extra keys with
the tenant salt) exactly as `BlockPool.get_cached_block` does. Each entry holds one block's KV as
``[L, 2, B, Hkv, D]`` on the CPU. Only the engine thread touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from pagedserve.workers.protocol.blocks import BlockHash, BlockKey
from pagedserve.workers.protocol.events import KVTier


@dataclass(slots=True)
class HostEntry:
    key: BlockKey
    kv: Tensor  # [L, 2, B, Hkv, D] on the CPU


class HostTier:
    """An LRU map `block hash → (key, KV)` holding at most `capacity_bytes` of KV.

    Args:
        capacity_bytes: bytes of KV it may hold (a whole number of blocks is used).
        bytes_per_block: bytes of one block's K and V across all layers.
    """

    name = KVTier.HOST

    def __init__(self, capacity_bytes: int, bytes_per_block: int) -> None:
        if capacity_bytes < bytes_per_block:
            raise ValueError(
                f"kv_host_tier_bytes {capacity_bytes} holds no block "
                f"({bytes_per_block} bytes per block)"
            )
        self.bytes_per_block = bytes_per_block
        self.capacity_blocks = capacity_bytes // bytes_per_block
        self.capacity_bytes = self.capacity_blocks * bytes_per_block
        # Oldest first: the head is evicted first, `move_to_end` marks a use.
        self._entries: OrderedDict[BlockHash, HostEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    @property
    def num_bytes(self) -> int:
        return len(self._entries) * self.bytes_per_block

    def holds(self, block_hash: BlockHash, key: BlockKey) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and entry.key == key

    def get(self, block_hash: BlockHash, key: BlockKey) -> Tensor | None:
        """The block's KV if held with exactly `key`; a hit becomes most recently used."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.key != key:
            return None
        self._entries.move_to_end(block_hash)
        return entry.kv

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def put(self, block_hash: BlockHash, key: BlockKey, kv: Tensor) -> list[tuple]:
        """Store a block (most recently used); returns the LRU entries it pushed out, as
        ``(hash, key, kv)`` oldest first, for the caller to demote or drop."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return []
        self._entries[block_hash] = HostEntry(key, kv)
        evicted = []
        while len(self._entries) > self.capacity_blocks:
            old_hash, old = self._entries.popitem(last=False)
            evicted.append((old_hash, old.key, old.kv))
        return evicted

    def items(self) -> list[tuple[BlockHash, BlockKey]]:
        """(hash, key) of every entry, oldest first."""
        return [(block_hash, entry.key) for block_hash, entry in self._entries.items()]

    def clear(self) -> None:
        self._entries.clear()
