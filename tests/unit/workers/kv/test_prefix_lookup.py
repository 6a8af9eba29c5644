"""KVCacheManager's prefix lookup (workers/kv/prefix_lookup.py): hits, their keys and
verification, registration as blocks fill, reset (B=4)."""

from support.kv import FakeRequest, make_manager

from pagedserve.workers.kv.checks import assert_no_leaks


def refs(manager):
    return [block.ref_cnt for block in manager.pool.blocks]


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    m = make_manager(num_blocks=8)
    a = FakeRequest("a", list(range(10)))
    m.allocate_slots(a, 10)  # blocks 0,1 full and cached, 2 partial
    m.free("a")
    b = FakeRequest("b", list(range(8)) + [99, 98, 97])
    hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_tokens == 8
    alloc = m.allocate_slots(b, 3, hit)
    assert alloc.new_block_ids == (2,)
    assert m.get_block_ids("b") == [0, 1, 2]
    assert refs(m)[:3] == [1, 1, 1]
    # exactly two full blocks of prompt: only the first may be reused
    c = FakeRequest("c", list(range(8)))
    assert m.get_computed_blocks(c).num_tokens == 4
    usage = m.usage()
    assert usage.prefix_hits_tokens == 8 and usage.prefix_queries_tokens == 21
    m.free("b")
    assert_no_leaks(m)


def test_cache_salt_never_shares():
    m = make_manager(num_blocks=8)
    a = FakeRequest("a", list(range(9)), ("tiny", "tenant-a"))
    m.allocate_slots(a, 9)
    b = FakeRequest("b", list(range(9)), ("tiny", "tenant-b"))
    assert m.get_computed_blocks(b).num_tokens == 0
    m.allocate_slots(b, 9)
    assert set(m.get_block_ids("a")).isdisjoint(m.get_block_ids("b"))
    same = FakeRequest("s", list(range(9)), ("tiny", "tenant-a"))
    assert m.get_computed_blocks(same).num_tokens == 8
    m.free("a")
    m.free("b")
    assert_no_leaks(m)


def test_hash_collision_is_not_a_hit():
    m = make_manager(num_blocks=8)
    a = FakeRequest("a", list(range(9)))
    m.allocate_slots(a, 9)
    block0 = m.pool.blocks[0]
    # Pretend block 0 holds other tokens under the same hash: the stored key no longer matches.
    block0.key = type(block0.key)(None, (9, 9, 9, 9), ())
    assert m.get_computed_blocks(FakeRequest("b", list(range(9)))).num_tokens == 0


def test_reset_prefix_cache_drops_every_hit():
    m = make_manager()
    m.allocate_slots(FakeRequest("a", list(range(9))), 9)
    m.free("a")
    m.reset_prefix_cache()
    assert m.get_computed_blocks(FakeRequest("b", list(range(9)))).num_tokens == 0
    assert m.usage().cached_free_blocks == 0
    assert_no_leaks(m)
