"""Swapping a group (a beam search's beams) out and in: one swap slot per distinct block, the
shared blocks shared again after swap-in, slots freed by their last owner (B=4)."""

from support.kv import FakeRequest, make_manager

from pagedserve.workers.kv.checks import assert_no_leaks, check_invariants


def two_beams(m):
    """ "a" [0, 1] and its fork "b" [0, 2]: block 0 shared, b copied block 1 on its write."""
    a = FakeRequest("a", list(range(6)))
    m.allocate_slots(a, 6)
    m.fork("a", "b")
    b = FakeRequest("b", list(range(6)) + [50])
    b.num_computed = 6
    assert m.allocate_slots(b, 1).copies == ((1, 2),)
    a.all_token_ids.append(60)
    m.allocate_slots(a, 1)
    assert m.get_block_ids("a") == [0, 1] and m.get_block_ids("b") == [0, 2]
    return a, b


def test_a_group_swaps_its_distinct_blocks_once_and_shares_them_again():
    m = make_manager(num_blocks=8, num_swap_blocks=8)
    a, b = two_beams(m)
    moves = m.swap_out_group(["a", "b"])
    assert [block for block, _ in moves] == [0, 1, 2]  # block 0 once, not once per beam
    assert m.num_free_swap_blocks == 5 and m.pool.num_free_blocks == 8
    assert m.num_swapped_blocks("a") == m.num_swapped_blocks("b") == 2
    check_invariants(m)
    back = m.swap_in_group([a, b])
    assert len(back) == 3 and m.num_free_swap_blocks == 8
    shared = m.get_block_ids("a")[0]
    assert m.get_block_ids("b")[0] == shared and m.pool.blocks[shared].ref_cnt == 2
    assert m.pool.num_free_blocks == 5
    check_invariants(m)
    m.free("a")
    m.free("b")
    assert_no_leaks(m)


def test_a_shared_slot_is_freed_by_its_last_owner():
    m = make_manager(num_blocks=8, num_swap_blocks=8)
    two_beams(m)
    m.swap_out_group(["a", "b"])
    m.free("a")  # its own slot goes back; the shared one stays with b
    assert m.num_free_swap_blocks == 6
    m.free("b")
    assert m.num_free_swap_blocks == 8
    assert_no_leaks(m)


def test_a_group_that_does_not_fit_changes_nothing():
    m = make_manager(num_blocks=8, num_swap_blocks=2)
    two_beams(m)
    assert m.swap_out_group(["a", "b"]) is None
    assert m.num_free_swap_blocks == 2 and m.get_block_ids("b") == [0, 2]
    m.free("a")
    m.free("b")
    assert_no_leaks(m)
