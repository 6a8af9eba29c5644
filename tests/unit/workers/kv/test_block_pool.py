"""Exact ids, ref counts and queue order for the free queue and the block pool."""

import hashlib
import random
import struct

import pytest

from pagedserve.workers.kv.block import Block, FreeBlockQueue
from pagedserve.workers.kv.block_hash import block_hash, hash_full_blocks
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.protocol.events import AllCleared, BlockRemoved, BlockStored


def test_free_queue_order_and_middle_removal():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])
    assert queue.block_ids() == [1, 3, 4]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert queue.block_ids() == [0, 1, 3, 4, 2]
    assert len(queue) == 5


def test_free_queue_refuses_double_insert_and_foreign_remove():
    blocks = [Block(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    outsider = Block(9)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(outsider)
    queue.popleft()
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_hash_is_chained_deterministic_and_salted():
    first = block_hash(None, [1, 2, 3, 4])
    assert first == block_hash(None, (1, 2, 3, 4))
    assert len(first) == 32
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4], ("salt-a",)) != block_hash(
        None, [1, 2, 3, 4], ("salt-b",)
    )
    assert block_hash(None, [1, 2, 3, 4], ("ab", "c")) != block_hash(
        None, [1, 2, 3, 4], ("a", "bc")
    )
    assert hash_full_blocks(list(range(10)), 4) == [
        block_hash(None, [0, 1, 2, 3]),
        block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7]),
    ]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_hash_full_blocks_equals_chained_block_hash(block_size):
    """The prompt-at-once encoding gives each block's own `block_hash`, tail left out."""
    rng = random.Random(block_size)
    for length in [0, block_size - 1, block_size, 5 * block_size + 2]:
        tokens = [rng.randrange(-(2**40), 2**40) for _ in range(length)]
        extra = ("tiny-llama", "salté")
        expected, parent = [], None
        for start in range(0, length - block_size + 1, block_size):
            parent = block_hash(parent, tokens[start : start + block_size], extra)
            expected.append(parent)
        assert hash_full_blocks(tokens, block_size, extra) == expected
        assert hash_full_blocks(tuple(tokens), block_size, extra) == expected


def _sha256_of_documented_encoding(parent: bytes | None, tokens, extra_keys) -> bytes:
    """The encoding `workers/kv/block_hash.py` documents, written out independently."""
    data = b"pagedserve.block.v1"
    data += b"\x00" * 32 if parent is None else b"\x01" + parent
    data += struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens)
    data += struct.pack("<I", len(extra_keys))
    for key in extra_keys:
        raw = key.encode("utf-8")
        data += struct.pack("<I", len(raw)) + raw
    return hashlib.sha256(data).digest()


# Golden digests: routers and workers of different versions must agree on every hash, so any
# change of the encoding fails here; an intended one bumps the domain string and these.
GOLDEN_FIRST = "8dc49fcb86ab5733bfd9fa9006aaa2bb23c2f8134f29cd16fa56016da78a2b99"
GOLDEN_CHILD = "94ef2fd3865bc2273981d873862ce5f386a5dc53677086b0a1e2e1e3c3db1886"


def test_block_hash_matches_the_documented_encoding_and_the_golden_digests():
    first = block_hash(None, [1, 2, 3, 4])
    child = block_hash(first, [5, -6, 2**40, 0], ("tiny-llama", "salté"))
    assert first == _sha256_of_documented_encoding(None, [1, 2, 3, 4], ())
    assert child == _sha256_of_documented_encoding(
        first, [5, -6, 2**40, 0], ("tiny-llama", "salté")
    )
    assert (first.hex(), child.hex()) == (GOLDEN_FIRST, GOLDEN_CHILD)


def test_pool_cache_evict_and_events():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert [a.block_id, b.block_id, a.ref_cnt] == [0, 1, 1]
    key = BlockKey(None, (1, 2), ())
    digest = block_hash(None, [1, 2])
    pool.cache_full_block(a, digest, key)
    assert pool.get_cached_block(digest, key) is a
    assert pool.get_cached_block(digest, BlockKey(None, (1, 3), ())) is None  # collision guard
    pool.free_blocks([b, a])
    # unhashed b goes to the head (reused first); hashed a to the tail (kept longest)
    assert pool.free_queue.block_ids() == [1, 2, 0]
    assert pool.num_cached_free_blocks == 1
    pool.touch([a])  # a prefix hit revives the cached block
    assert a.ref_cnt == 1 and pool.free_queue.block_ids() == [1, 2]
    pool.free_blocks([a])
    taken = pool.get_new_blocks(3)
    assert [blk.block_id for blk in taken] == [1, 2, 0]
    assert digest not in pool.cached and a.block_hash is None
    events = pool.take_events()
    assert events == [BlockStored(0, digest, None, 0), BlockRemoved(1, digest, 0)]
    assert pool.take_events() == []
    pool.reset_prefix_cache()
    assert pool.take_events() == [AllCleared(2)]


def test_pool_refuses_over_allocation_and_double_free():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="ref_cnt 0"):
        pool.free_blocks([block])


def test_duplicate_content_keeps_first_block_canonical():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    key = BlockKey(None, (7,), ())
    digest = block_hash(None, [7])
    pool.cache_full_block(a, digest, key)
    pool.cache_full_block(b, digest, key)
    assert pool.cached[digest] is a and b.block_hash is None
