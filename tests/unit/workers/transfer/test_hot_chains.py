"""`hot_chains`: whole cached chains (root first), hottest leaf first, shared ancestors counted
once against the block budget, chains with an evicted ancestor left out. `eviction_chains`: the
chains ending in the free cached blocks, next evicted first."""

from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.transfer.hot_chains import eviction_chains, hot_chains


def cache_chain(pool: BlockPool, tokens: list[int], parent=None) -> list:
    """Cache one block per token (a 1-token block), each chained to the last; all held."""
    blocks, hashes = pool.get_new_blocks(len(tokens)), []
    for block, token in zip(blocks, tokens, strict=True):
        key = BlockKey(parent, (token,), ())
        parent = block_hash(parent, (token,))
        pool.cache_full_block(block, parent, key)
        hashes.append(parent)
    return blocks, hashes


def test_chains_come_hottest_first_and_share_ancestors_once():
    pool = BlockPool(16)
    trunk_blocks, trunk = cache_chain(pool, [1, 2])
    old_blocks, old = cache_chain(pool, [3], parent=trunk[-1])  # trunk + 3, freed first
    new_blocks, new = cache_chain(pool, [4], parent=trunk[-1])  # trunk + 4, freed last
    busy_blocks, busy = cache_chain(pool, [5, 6])  # another root, still in use
    pool.free_blocks(reversed(old_blocks))
    pool.free_blocks(reversed(new_blocks))
    pool.free_blocks(reversed(trunk_blocks))

    chains = hot_chains(pool, max_blocks=100)
    assert chains == [busy, trunk + new, trunk + old]
    # A budget of 5 blocks: busy (2) and trunk + new (3); trunk + old would need 1 more.
    assert hot_chains(pool, max_blocks=5) == [busy, trunk + new]
    # 4: busy, then trunk + new (3 new blocks) does not fit, trunk + old neither.
    assert hot_chains(pool, max_blocks=4) == [busy]
    assert busy_blocks[0].ref_cnt == 1


def test_a_chain_whose_ancestor_was_evicted_is_left_out():
    pool = BlockPool(4)
    blocks, chain = cache_chain(pool, [1, 2])
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(4)  # reuses every free block: the root goes first, then its child
    assert hot_chains(pool, 10) == []
    pool2 = BlockPool(8)
    blocks2, chain2 = cache_chain(pool2, [1, 2, 3])
    pool2.uncache_block(blocks2[0])  # the root's content is gone
    assert hot_chains(pool2, 10) == []


def test_eviction_chains_end_in_free_cached_blocks_next_evicted_first():
    pool = BlockPool(16)
    trunk_blocks, trunk = cache_chain(pool, [1, 2])
    old_blocks, old = cache_chain(pool, [3], parent=trunk[-1])
    new_blocks, new = cache_chain(pool, [4], parent=trunk[-1])
    _, busy = cache_chain(pool, [5, 6])  # held: never a candidate
    pool.free_blocks(reversed(old_blocks))  # evicted first
    pool.free_blocks(reversed(new_blocks))
    pool.free_blocks(reversed(trunk_blocks))  # the leaf of trunk before its root

    assert eviction_chains(pool, 10) == [trunk + old, trunk + new, trunk, trunk[:1]]
    assert eviction_chains(pool, 2) == [trunk + old, trunk + new]
    assert all(busy[-1] not in chain for chain in eviction_chains(pool, 10))


def test_an_eviction_chain_needs_every_ancestor_cached():
    pool = BlockPool(8)
    blocks, chain = cache_chain(pool, [1, 2, 3])
    pool.uncache_block(blocks[0])
    pool.free_blocks(reversed(blocks))
    assert eviction_chains(pool, 10) == []
