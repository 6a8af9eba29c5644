"""The KV memory hierarchy below the device pool: a host-memory tier and a disk tier.

    device pool (BlockPool)
        │ a cached block is evicted (its blocks are handed out again): `spill` copies its KV
        ▼ to the CPU in one gather, before anything can write the block
    host tier (HostTier, LRU, bounded bytes)
        │ its LRU entries are demoted when it is full
        ▼
    disk tier (DiskTier, LRU, bounded bytes, files written by a background thread)
        │ its LRU entries are deleted when it is full
        ▼
    gone: the block's BlockRemoved event

Either tier is optional; with only a disk tier, spilled blocks go straight to its write queue.
Keys are the device pool's chained block hashes (salted per tenant by the extra keys) and every
lookup checks the whole `BlockKey`, so isolation holds in every tier. The tiers are inclusive:
a block loaded back into the device pool stays in its tier, so evicting it again costs no copy.

The pool reports the best tier each block is in to the prefix index (`BlockStored.tier`):
`TierStore` calls `announce(hash, parent_hash)` whenever a block's lower-tier presence changes,
and the pool turns that into an event. `read` gives back a run of blocks for the engine to load
before a request's prefill (see `load_waiting_prefixes` in `workers/kv/tier_load.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from pagedserve.workers.protocol.blocks import BlockHash, BlockKey
from pagedserve.workers.protocol.events import KVTier
from pagedserve.workers.protocol.stats import TierStats, TierUsage

# torch is imported where a tensor is made: `TierStats` travels in `WorkerStats`, which
# routers and the control actors read without paying torch's import.
if TYPE_CHECKING:
    from torch import Tensor

    from pagedserve.workers.kv.tier_disk import DiskTier
    from pagedserve.workers.kv.tier_host import HostTier

DEVICE, HOST, DISK = KVTier.DEVICE, KVTier.HOST, KVTier.DISK
TIERS: tuple[str, ...] = (DEVICE, HOST, DISK)

Announce = Callable[[BlockHash, "BlockHash | None"], None]


class TierLoad(NamedTuple):
    """Blocks one load brought back into the device pool, and from which tier."""

    blocks: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0


@dataclass(frozen=True)
class StepTierLoad:
    """One load of an engine step, for the request's trace: whose, when (wall ns), how much."""

    group_id: str
    start_ns: int
    end_ns: int
    load: TierLoad


@dataclass
class _Counters:
    stored_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0
    bytes_out: int = 0
    load_time_s: float = 0.0


class TierStore:
    """Owns the host and disk tiers of one engine, its counters and the spill/read paths.

    Args:
        host: the host-memory tier, or None.
        disk: the disk tier, or None.
        export: copies device blocks out as ``[L, 2, M, B, Hkv, D]`` on the CPU
            (`KVCache.export_blocks`).
        bytes_per_block: KV bytes of one block.
    """

    def __init__(
        self,
        host: HostTier | None,
        disk: DiskTier | None,
        export: Callable[[list[int]], Tensor],
        bytes_per_block: int,
    ) -> None:
        if host is None and disk is None:
            raise ValueError("a TierStore needs a host tier, a disk tier or both")
        self.host = host
        self.disk = disk
        self.export = export
        self.bytes_per_block = bytes_per_block
        self.announce: Announce = lambda block_hash, parent: None  # set by the pool
        self._counters = {tier.name: _Counters() for tier in self.tiers}
        self.loads = 0
        self.loaded_blocks = 0
        self.load_time_s = 0.0

    @property
    def tiers(self) -> list[HostTier | DiskTier]:
        return [tier for tier in (self.host, self.disk) if tier is not None]

    @property
    def num_blocks(self) -> int:
        return sum(len(tier) for tier in self.tiers)

    # ---------------------------------------------------------------- queries
    def tier_of(self, block_hash: BlockHash) -> str | None:
        """The fastest lower tier holding `block_hash`, or None."""
        return next((tier.name for tier in self.tiers if block_hash in tier), None)

    def holds(self, block_hash: BlockHash, key: BlockKey) -> bool:
        return any(tier.holds(block_hash, key) for tier in self.tiers)

    def held_blocks(self) -> list[tuple[BlockHash, BlockKey, str]]:
        """(hash, key, fastest tier) of every block held below the device."""
        held: dict[BlockHash, tuple[BlockHash, BlockKey, str]] = {}
        for tier in reversed(self.tiers):  # the faster tier's entry wins
            for block_hash, key in tier.items():
                held[block_hash] = (block_hash, key, tier.name)
        return list(held.values())

    # ---------------------------------------------------------------- spilling
    def spill(self, evicted: Sequence[tuple[int, BlockHash, BlockKey]]) -> None:
        """Keep cached blocks the device pool is evicting: ``(block id, hash, key)`` each.

        Called while the blocks still hold their KV (before the new owner's step writes
        them). Blocks a tier already holds are only marked recently used, without a copy.
        """
        first = self.host if self.host is not None else self.disk
        wanted = []
        for block_id, block_hash, key in evicted:
            if block_hash in first:
                first.touch(block_hash)
            else:
                wanted.append((block_id, block_hash, key))
        if not wanted:
            return
        packed = self.export([block_id for block_id, _, _ in wanted])
        for index, (_, block_hash, key) in enumerate(wanted):
            self._put(first, block_hash, key, packed[:, :, index].clone())

    def _put(self, tier, block_hash: BlockHash, key: BlockKey, kv: Tensor) -> None:
        if tier is self.host:
            for old_hash, old_key, old_kv in self.host.put(block_hash, key, kv):
                self._counters[HOST].evicted_blocks += 1
                if self.disk is not None and old_hash not in self.disk:
                    self._put(self.disk, old_hash, old_key, old_kv)
                self.announce(old_hash, old_key.parent_hash)
            self._counters[HOST].stored_blocks += 1
            return
        evicted = self.disk.put(block_hash, key, kv)
        if evicted is None:  # dropped: nothing to announce beyond what the caller does
            return
        self._counters[DISK].stored_blocks += 1
        self._counters[DISK].evicted_blocks += len(evicted)
        for old_hash in evicted:
            if self.host is None or old_hash not in self.host:  # else still best in host
                self.announce(old_hash, None)

    # ---------------------------------------------------------------- loading
    def read(self, run: Sequence[tuple[BlockHash, BlockKey]]) -> Tensor | None:
        """The KV of the leading blocks of `run` this store can give back intact, packed as
        ``[L, 2, M, B, Hkv, D]`` (M may be shorter than `run`: a block went missing or was
        corrupt); None when not even the first is here."""
        blocks = []
        for block_hash, key in run:
            kv = self._read_one(block_hash, key)
            if kv is None:
                break
            blocks.append(kv)
        import torch

        return torch.stack(blocks, dim=2) if blocks else None

    def _read_one(self, block_hash: BlockHash, key: BlockKey) -> Tensor | None:
        for tier in self.tiers:
            started = time.perf_counter()
            held = block_hash in tier
            kv = tier.get(block_hash, key)
            if kv is None:
                if held and block_hash not in tier and self.tier_of(block_hash) is None:
                    self.announce(block_hash, key.parent_hash)  # its corrupt file was dropped
                continue
            counters = self._counters[tier.name]
            counters.hit_blocks += 1
            counters.bytes_out += self.bytes_per_block
            counters.load_time_s += time.perf_counter() - started
            return kv
        return None

    def hits(self) -> TierLoad:
        """Blocks loaded from each tier so far (a load's share: the difference around it)."""
        host, disk = (
            self._counters[t].hit_blocks if t in self._counters else 0 for t in (HOST, DISK)
        )
        return TierLoad(host + disk, host, disk)

    def record_load(self, num_blocks: int, seconds: float) -> None:
        self.loads += 1
        self.loaded_blocks += num_blocks
        self.load_time_s += seconds

    # ---------------------------------------------------------------- upkeep
    def reap_failed(self) -> None:
        """Forget disk entries whose background write failed (announcing them)."""
        if self.disk is None:
            return
        for block_hash in self.disk.reap_failed():
            if self.tier_of(block_hash) is None:
                self.announce(block_hash, None)

    def clear(self) -> None:
        """Drop every lower-tier block (prefix cache reset); the caller announces it."""
        for tier in self.tiers:
            tier.clear()

    def flush(self) -> None:
        """Wait for the disk tier's queued writes (tests, shutdown)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> TierStats:
        usages = []
        for tier in self.tiers:
            counters = self._counters[tier.name]
            is_disk = tier is self.disk
            usages.append(
                TierUsage(
                    tier=tier.name,
                    blocks=len(tier),
                    bytes=tier.num_bytes,
                    capacity_bytes=tier.capacity_bytes,
                    stored_blocks=counters.stored_blocks,
                    hit_blocks=counters.hit_blocks,
                    evicted_blocks=counters.evicted_blocks,
                    bytes_in=counters.stored_blocks * self.bytes_per_block,
                    bytes_out=counters.bytes_out,
                    load_time_s=counters.load_time_s,
                    dropped_blocks=tier.dropped_blocks if is_disk else 0,
                    corrupt_skipped=tier.corrupt_skipped if is_disk else 0,
                )
            )
        return TierStats(tuple(usages), self.loads, self.loaded_blocks, self.load_time_s)
