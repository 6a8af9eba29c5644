"""KV cache events a pool publishes so the cluster's prefix index can mirror it.

Every event carries the pool's sequence number; a consumer that sees a gap knows it lost events
and must resync from a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pagedserve.workers.protocol.blocks import BlockHash


class KVTier(StrEnum):
    """Where a cached block's KV is at best, fastest first: the device pool, the host tier,
    the disk tier (`workers/kv/tiers.py`). Spelled as before in events, stats and the index."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


TIER_NAMES: tuple[str, ...] = tuple(tier.value for tier in KVTier)  # fastest first


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block's KV is now cached under `block_hash`, at best in `tier`.

    `tier` is `device` (the pool; `block_id` is its block), `host` or `disk` (a lower tier;
    `block_id` is -1). A block that moves down a tier is stored again with its new tier; it is
    removed only once no tier holds it.
    """

    seq: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    block_id: int
    tier: KVTier = KVTier.DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block cached under `block_hash` was evicted from every tier; its KV is gone."""

    seq: int
    block_hash: BlockHash
    block_id: int


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every cached block was dropped (prefix cache reset)."""

    seq: int


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Everything a pool holds in its prefix cache, for an index to resync from.

    `epoch` names the worker incarnation (new on every start); `next_seq` is the sequence number
    of the pool's next event, so events below it are already reflected here. `block_tiers`
    gives each block's fastest tier (same order; empty: every block is on the device).
    """

    worker_id: str
    epoch: str
    next_seq: int
    block_hashes: tuple[BlockHash, ...]
    block_tiers: tuple[str, ...] = ()

    def tiers(self) -> tuple[str, ...]:
        """Each block's tier, `device` where `block_tiers` is empty."""
        return self.block_tiers or (KVTier.DEVICE,) * len(self.block_hashes)
