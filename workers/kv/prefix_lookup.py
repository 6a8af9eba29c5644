"""The prefix cache's side of `KVCacheManager`: a request's cached prefix, found and registered.

`KVPrefixLookup` is a part of `KVCacheManager` (it reads the manager's block tables and pool);
it lives here so that workers/kv/manager.py keeps to allocation. The pool holds the cache
itself (`BlockPool`: hash → block, verified against the stored key); this side computes a
request's chained block keys (`iter_prefix_keys`), finds its longest cached prefix before
admission (`get_computed_blocks`: a `ComputedBlocks` hit that `allocate_slots` then takes),
and registers each block of a request as soon as it is full (`_cache_full_blocks`), so a later
request with the same prefix reuses it:

    prompt      t0 … t15 | t16 … t31 | t32 t33
    keys        k0 = (None, t0…t15, extra) → h0;  k1 = (h0, t16…t31, extra) → h1
    hit         h0, h1 cached → 2 blocks, 32 tokens reused (t32 t33 still to compute)

`extra` is the request's `cache_extra_keys` (model, tenant salt, adapter): blocks are shared
only where those match.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.workers.kv.block import Block
from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.protocol.blocks import BlockHash, BlockKey

if TYPE_CHECKING:
    from pagedserve.workers.kv.manager import KVRequest, _RequestBlocks


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A verified prefix-cache hit: blocks whose KV a new request can reuse as is."""

    blocks: tuple[Block, ...]
    block_hashes: tuple[BlockHash, ...]
    num_tokens: int


NO_HIT = ComputedBlocks((), (), 0)


class KVPrefixLookup:
    """`KVCacheManager`'s prefix-cache methods (see the module docstring)."""

    block_size: int
    pool: BlockPool

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    def get_computed_blocks(self, request: KVRequest) -> ComputedBlocks:
        """The longest cached prefix of full blocks for a request that holds no blocks yet.

        At least one token is always left to compute, because the step must produce logits for
        the request's next token. A request that needs the logits of every prompt position
        (``skip_prefix_cache``: prompt log-probabilities) gets no hit.
        """
        blocks: list[Block] = []
        hashes: list[BlockHash] = []
        for digest, key in self.iter_prefix_keys(request):
            block = self.pool.get_cached_block(digest, key)
            if block is None:
                break
            blocks.append(block)
            hashes.append(digest)
        return ComputedBlocks(tuple(blocks), tuple(hashes), len(blocks) * self.block_size)

    def iter_prefix_keys(self, request: KVRequest) -> Iterator[tuple[BlockHash, BlockKey]]:
        """(chained hash, key) of each full block a prefix hit of `request` may cover, in
        order, computed lazily (a caller stops at its first miss). None when the request
        takes no hit at all (caching off, or ``skip_prefix_cache``)."""
        if not self.pool.enable_caching or getattr(request, "skip_prefix_cache", False):
            return
        B = self.block_size
        parent: BlockHash | None = None
        for start in range(0, len(request.all_token_ids) - 1 - B + 1, B):
            tokens = tuple(request.all_token_ids[start : start + B])
            key = BlockKey(parent, tokens, request.cache_extra_keys)
            digest = block_hash(parent, key.token_ids, key.extra_keys)
            yield digest, key
            parent = digest

    def _cache_full_blocks(self, request: KVRequest, state: _RequestBlocks) -> None:
        """Hash and register the request's blocks filled up to `state.num_tokens` since the
        last call (never a draft position: those lie past `num_tokens`)."""
        if not self.pool.enable_caching:
            return
        B = self.block_size
        tokens = request.all_token_ids
        extra = request.cache_extra_keys
        for index in range(len(state.block_hashes), state.num_tokens // B):
            parent = state.block_hashes[-1] if state.block_hashes else None
            key = BlockKey(parent, tuple(tokens[index * B : (index + 1) * B]), extra)
            digest = block_hash(parent, key.token_ids, extra)
            state.block_hashes.append(digest)
            self.pool.cache_full_block(state.blocks[index], digest, key)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (`BlockPool.reset_prefix_cache`): only sharing is lost."""
        self.pool.reset_prefix_cache()
