"""A worker's cached prefixes as whole chains: hottest first, what it hands over before it
leaves the pool (`cluster/pool/pool.py`); or next evicted first, what it pushes to a peer
(`cluster/pool/migration.py`).

A cached block is only useful with its ancestors (a prefix match walks from the root), so the
unit handed over is a chain from the root to a leaf (a cached block no other cached block
continues). Chains are ordered by the heat of their leaf:

    in use (ref_cnt > 0)  >  free, freed last (the free queue's tail)  >  ...  >  next evicted

Chains share their ancestors: a block counts once against `max_blocks`, in the first chain
that holds it, and a chain whose new blocks do not fit is skipped for a shorter later one.
"""

from __future__ import annotations

from pagedserve.workers.kv.block import Block
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.protocol.blocks import BlockHash


def hot_chains(pool: BlockPool, max_blocks: int) -> list[list[BlockHash]]:
    """The pool's complete cached chains (root first), hottest first, within `max_blocks`
    distinct blocks."""
    cached = pool.cached
    continued = {b.key.parent_hash for b in cached.values() if b.key.parent_hash is not None}
    leaves = [b for h, b in cached.items() if h not in continued]
    freed_order = {block.block_id: i for i, block in enumerate(pool.free_queue)}

    def heat(leaf: Block) -> tuple[int, int]:
        if leaf.ref_cnt > 0:
            return (0, 0)
        return (1, -freed_order.get(leaf.block_id, 0))

    chains, taken = [], set()
    for leaf in sorted(leaves, key=heat):
        chain = _chain_to(leaf, cached)
        if chain is None:
            continue  # an ancestor was evicted: the rest cannot be matched from the root
        new = [h for h in chain if h not in taken]
        if len(taken) + len(new) > max_blocks:
            continue
        taken.update(new)
        chains.append(chain)
    return chains


def eviction_chains(pool: BlockPool, max_chains: int) -> list[list[BlockHash]]:
    """Up to `max_chains` chains (root first), each ending in a cached free block, in the order
    those blocks will be evicted. A block whose ancestors are not all cached is skipped: pushed
    alone it could never be matched."""
    chains = []
    for block in pool.free_queue:
        if len(chains) >= max_chains:
            break
        if block.block_hash is None:
            continue
        chain = _chain_to(block, pool.cached)
        if chain is not None:
            chains.append(chain)
    return chains


def _chain_to(leaf: Block, cached: dict[BlockHash, Block]) -> list[BlockHash] | None:
    """The hashes from the root to `leaf`, or None when an ancestor is not cached."""
    chain = [leaf.block_hash]
    parent = leaf.key.parent_hash
    while parent is not None:
        block = cached.get(parent)
        if block is None:
            return None
        chain.append(parent)
        parent = block.key.parent_hash
    return chain[::-1]
