"""The KV endpoints of a worker's core: what peers and checks read or write of its pool.

`WorkerKV` is the part of `WorkerCore` (`workers/worker/core.py`) that serves the cluster's KV
sharing and its checks, each run on the engine between steps (`WorkerCore._on_engine`): a
prefix exported to a peer that pulls it and imported from one that pushes it, the blocks next
in line for eviction (push candidates), the hottest cached chains (a handover before the
worker leaves), a snapshot of every tier's blocks (the prefix index resyncs from it), and the
pool's invariants (the leak checks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.workers.kv.checks import KVInvariantError, assert_no_leaks, check_invariants
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.protocol.events import KVSnapshot
from pagedserve.workers.protocol.stats import PoolCheck
from pagedserve.workers.transfer.hot_chains import eviction_chains, hot_chains


class WorkerKV:
    """The KV endpoints `WorkerCore` inherits. Owns nothing of its own: it reads and writes the
    core's engine (`engine`, `transfer`) and counts what it moved (`num_blocks_imported`,
    `num_blocks_exported`), always through `_on_engine`, so no step runs meanwhile. What it
    uses of the core is declared below."""

    engine: Any
    transfer: Any  # the engine's `PrefixTransfer`
    worker_id: str
    epoch: str
    num_blocks_imported: int
    num_blocks_exported: int
    _streams: Any  # the core's `StreamTable`: a worker with an open stream is not idle
    _on_engine: Callable[[Callable[[], Any]], Any]
    _publish_events: Callable[[], None]

    async def check_pool(self) -> PoolCheck:
        """Pool invariants between steps; when idle, also that no block is held (free + cached
        = total)."""
        return await self._on_engine(self._check_pool_now)

    def _check_pool_now(self) -> PoolCheck:
        idle = not self.engine.has_unfinished_requests() and not self._streams
        proposer = self.engine.proposer
        pools = [self.engine.kv] + ([proposer.kv] if proposer and proposer.kv else [])
        try:
            for kv in pools:  # the engine's, and a speculative draft model's own
                (assert_no_leaks if idle else check_invariants)(kv)
        except KVInvariantError as error:
            return PoolCheck(ok=False, idle=idle, error=str(error))
        return PoolCheck(ok=True, idle=idle)

    async def kv_snapshot(self) -> KVSnapshot:
        """The blocks held in every tier and the event sequence number they reflect, read
        between steps (a step in flight changes both)."""
        return await self._on_engine(self._snapshot_now)

    def _snapshot_now(self) -> KVSnapshot:
        pool = self.engine.kv.pool
        self._publish_events()  # events below next_seq are reflected in the snapshot
        held = pool.held_blocks()  # every tier's blocks, each with its fastest tier
        hashes, tiers = tuple(h for h, _ in held), tuple(t for _, t in held)
        return KVSnapshot(self.worker_id, self.epoch, pool.next_event_seq, hashes, tiers)

    # ----------------------------------------------------------- migration
    async def export_prefix(self, block_hashes: Sequence[bytes]) -> tuple[list[BlockKey], Any]:
        """The leading cached blocks of `block_hashes`: their keys and KV packed on the CPU."""

        def export():
            blocks = self.transfer.cached_prefix(block_hashes)
            if not blocks:
                return [], None
            packed = self.engine.kv_cache.export_blocks([b.block_id for b in blocks])
            self.num_blocks_exported += len(blocks)
            return [b.key for b in blocks], packed

        return await self._on_engine(export)

    async def push_candidates(self, max_chains: int) -> list[list[bytes]]:
        """Chains (root first) ending in the cached free blocks next in line for eviction
        (`eviction_chains`), read between steps."""
        pool = self.engine.kv.pool
        return await self._on_engine(lambda: eviction_chains(pool, max_chains))

    async def hot_chains(self, max_blocks: int) -> list[list[bytes]]:
        """Its cached prefixes as whole chains, hottest first (`workers/transfer/hot_chains.py`),
        read on the engine's thread so that no step changes the pool under the walk."""
        pool = self.engine.kv.pool
        return await self._on_engine(lambda: hot_chains(pool, max_blocks))

    async def import_prefix(self, keys: Sequence[BlockKey], packed: Any) -> int:
        """Store exported blocks as cached here; returns how many were new. 0 without room, and
        0 for blocks of another KV dtype (`kv_cache_dtype`): they are refused, never
        converted, and the request recomputes its prefix here instead."""

        def do_import():
            if packed is None or packed.dtype != self.engine.kv_cache.dtype:
                return 0
            reserved = self.transfer.reserve_for_import(keys)
            if reserved is None or not reserved[0]:
                return 0
            indices, blocks = reserved
            try:
                self.engine.kv_cache.import_blocks(
                    packed[:, :, indices], [b.block_id for b in blocks]
                )
            except Exception:
                self.transfer.abort_import(blocks)
                raise
            self.transfer.commit_import(blocks, [keys[i] for i in indices])
            self.num_blocks_imported += len(blocks)
            return len(blocks)

        imported = await self._on_engine(do_import)
        self._publish_events()
        return imported
