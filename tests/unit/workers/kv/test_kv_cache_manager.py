"""KVCacheManager: exact block ids, ref counts and free-queue order after each step (B=4)."""

import pytest
from support.kv import FakeRequest, make_manager

from pagedserve.workers.kv.checks import KVInvariantError, assert_no_leaks, check_invariants
from pagedserve.workers.protocol.events import BlockStored


def refs(manager):
    return [block.ref_cnt for block in manager.pool.blocks]


def free_ids(manager):
    return manager.pool.free_queue.block_ids()


def test_allocate_append_free_tail_first():
    m = make_manager(num_blocks=8)
    a = FakeRequest("a", list(range(6)))
    alloc = m.allocate_slots(a, 6)
    assert alloc.new_block_ids == (0, 1) and alloc.copies == ()
    assert m.get_block_ids("a") == [0, 1]
    assert refs(m)[:3] == [1, 1, 0]
    assert free_ids(m) == [2, 3, 4, 5, 6, 7]
    events = m.pool.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored) and events[0].block_id == 0

    a.all_token_ids += [6, 7]  # two decode steps fill block 1
    assert m.allocate_slots(a, 1).new_block_ids == ()
    assert m.allocate_slots(a, 1).new_block_ids == ()
    assert m.pool.blocks[1].block_hash is not None
    a.all_token_ids.append(8)
    assert m.allocate_slots(a, 1).new_block_ids == (2,)
    check_invariants(m)

    assert m.free("a")
    # tail first: partial block 2 (nothing cached) to the head, then hashed 1, then 0
    assert free_ids(m) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert not m.free("a")
    assert_no_leaks(m)


def test_fork_then_copy_on_write_of_shared_partial_block():
    m = make_manager(num_blocks=8)
    a = FakeRequest("a", list(range(6)))
    m.allocate_slots(a, 6)  # [0, 1], block 1 half full
    m.fork("a", "c")
    assert refs(m)[:2] == [2, 2]
    c = FakeRequest("c", list(range(6)) + [50])
    alloc = m.allocate_slots(c, 1)
    assert alloc.copies == ((1, 2),) and alloc.new_block_ids == (2,)
    assert m.get_block_ids("c") == [0, 2]
    assert refs(m)[:3] == [2, 1, 1]
    a.all_token_ids.append(60)
    assert m.allocate_slots(a, 1).copies == ()  # block 1 is a's alone now
    m.free("c")
    m.free("a")
    assert_no_leaks(m)


def test_allocation_is_all_or_nothing():
    m = make_manager(num_blocks=4)
    m.allocate_slots(FakeRequest("a", list(range(12))), 12)
    before = (free_ids(m), refs(m), m.pool.next_event_seq)
    assert m.allocate_slots(FakeRequest("b", list(range(100, 108))), 8) is None
    assert (free_ids(m), refs(m), m.pool.next_event_seq) == before
    assert not m.has_request("b")


def test_watermark_guards_admission_not_growth():
    m = make_manager(num_blocks=10, watermark=0.2)
    assert m.reserve_blocks == 2
    assert m.allocate_slots(FakeRequest("big", list(range(36))), 36) is None  # 9 > 10 - 2
    a = FakeRequest("a", list(range(32)))
    assert m.allocate_slots(a, 32) is not None  # 8 blocks, leaves exactly the reserve
    a.all_token_ids += [1, 2]
    assert m.allocate_slots(a, 2) is not None  # a running request may use the reserve


def test_reserve_max_reserves_whole_context():
    m = make_manager(num_blocks=8, max_model_len=16, allocation_mode="reserve-max")
    a = FakeRequest("a", list(range(5)))
    assert len(m.allocate_slots(a, 5).new_block_ids) == 4
    usage = m.usage()
    assert (usage.useful_tokens, usage.allocated_positions, usage.wasted_positions) == (5, 16, 11)
    a.all_token_ids.append(5)
    assert m.allocate_slots(a, 1).new_block_ids == ()
    assert m.can_fit_ever(5) and not make_manager(
        num_blocks=3, max_model_len=16, allocation_mode="reserve-max"
    ).can_fit_ever(5)
    m.free("a")
    assert_no_leaks(m)


def test_eviction_of_cached_free_blocks_is_lru_and_reported():
    m = make_manager(num_blocks=3)
    m.allocate_slots(FakeRequest("a", list(range(8))), 8)
    m.free("a")
    assert m.usage().cached_free_blocks == 2 and free_ids(m) == [2, 1, 0]
    m.pool.take_events()
    m.allocate_slots(FakeRequest("b", list(range(100, 108))), 8)  # takes 2, then evicts 1
    removed = [e.block_id for e in m.pool.take_events() if type(e).__name__ == "BlockRemoved"]
    assert removed == [1]
    assert m.get_computed_blocks(FakeRequest("x", list(range(8)) + [1])).num_tokens == 4


def test_swap_out_and_in_roundtrip():
    m = make_manager(num_blocks=4, num_swap_blocks=4)
    a = FakeRequest("a", list(range(6)))
    m.allocate_slots(a, 6)
    moves = m.swap_out("a")
    assert moves == [(0, 0), (1, 1)]
    assert m.is_swapped_out("a") and m.pool.num_free_blocks == 4
    check_invariants(m)
    back = m.swap_in(a)
    assert [slot for slot, _ in back] == [0, 1] and m.num_free_swap_blocks == 4
    assert len(m.get_block_ids("a")) == 2
    m.free("a")
    assert_no_leaks(m)


def test_swap_out_refused_without_room_changes_nothing():
    m = make_manager(num_blocks=4, num_swap_blocks=1)
    m.allocate_slots(FakeRequest("a", list(range(6))), 6)
    assert m.swap_out("a") is None
    assert m.get_block_ids("a") == [0, 1] and m.num_free_swap_blocks == 1


def test_usage_reproduces_seed_worked_example():
    lengths = [37, 91, 128, 201, 511]
    m = make_manager(num_blocks=64, block_size=16, max_model_len=512)
    for i, n in enumerate(lengths):
        m.allocate_slots(FakeRequest(f"r{i}", [i * 1000 + t for t in range(n)]), n)
    usage = m.usage()
    assert usage.useful_tokens == 968
    assert usage.allocated_positions == 992
    assert usage.wasted_positions == 24
    assert round(100 * usage.utilization, 2) == 97.58
    assert usage.block_table_entries == 62 and usage.block_table_bytes == 248


def test_leak_check_catches_a_held_block():
    m = make_manager()
    m.allocate_slots(FakeRequest("a", [1, 2]), 2)
    with pytest.raises(KVInvariantError, match="requests still hold blocks"):
        assert_no_leaks(m)
    m._requests.clear()  # lose the table without freeing: a leak
    with pytest.raises(KVInvariantError, match="ref_cnt 1 != 0"):
        assert_no_leaks(m)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="block_size"):
        make_manager(block_size=0)
    with pytest.raises(ValueError, match="allocation_mode"):
        make_manager(allocation_mode="contiguous")
    m = make_manager()
    with pytest.raises(ValueError, match="only 2 are known"):
        m.allocate_slots(FakeRequest("a", [1, 2]), 3)
