"""KV cache events a pool publishes so the cluster's prefix index can mirror it.

Every event carries the pool's sequence number; a consumer that sees a gap knows it lost events
and must resync from a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.workers.block import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block's KV is now cached under `block_hash`."""

    seq: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    block_id: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block cached under `block_hash` was evicted; its KV is gone."""

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
    of the pool's next event, so events below it are already reflected here.
    """

    worker_id: str
    epoch: str
    next_seq: int
    block_hashes: tuple[BlockHash, ...]
