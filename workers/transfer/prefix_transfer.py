"""Moving cached prefix blocks between two workers' pools: lookup and export on the source,
import on the target (`WorkerCore.import_prefix`, `cluster/pool/migration.py`).

An import is all or nothing: `reserve_for_import` takes fresh blocks for the keys the pool
lacks, the caller writes their KV, then `commit_import` registers them under their hashes and
frees them as cached (or `abort_import` gives them back).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.workers.kv.block import Block
from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.blocks import BlockHash, BlockKey


class PrefixTransfer:
    """Moves cached prefix blocks between pools: lookup and export here, import there.

    Imported blocks are registered under their hashes and left free ("cached, evictable"), so
    the next request with that prefix hits them exactly as if this pool had computed them.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager

    def cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[Block]:
        """The leading blocks of `block_hashes` this pool holds, in order."""
        blocks = []
        for digest in block_hashes:
            block = self.manager.pool.cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def reserve_for_import(self, keys: Sequence[BlockKey]) -> tuple[list[int], list[Block]] | None:
        """Take fresh blocks for the keys this pool lacks, all or nothing.

        Returns:
            (indices into `keys` to import, their new blocks), or None without room. The
            blocks are owned by the caller until `commit_import` or `abort_import`.
        """
        pool = self.manager.pool
        wanted = [
            i
            for i, key in enumerate(keys)
            if block_hash(key.parent_hash, key.token_ids, key.extra_keys) not in pool.cached
        ]
        if len(wanted) > pool.num_free_blocks - self.manager.reserve_blocks:
            return None
        return wanted, pool.get_new_blocks(len(wanted))

    def commit_import(self, blocks: Sequence[Block], keys: Sequence[BlockKey]) -> None:
        """Register imported blocks (their KV is now written) and release them as cached."""
        pool = self.manager.pool
        for block, key in zip(blocks, keys, strict=True):
            pool.cache_full_block(
                block, block_hash(key.parent_hash, key.token_ids, key.extra_keys), key
            )
        pool.free_blocks(reversed(blocks))

    def abort_import(self, blocks: Sequence[Block]) -> None:
        self.manager.pool.free_blocks(reversed(blocks))
