"""KVCacheManager's slots taken back (workers/kv/slot_rollback.py): a dropped step's positions
and hashes rolled back (B=4). Draft slots are tested with speculative decoding
(tests/unit/workers/spec/test_spec_kv.py)."""

import pytest
from support.kv import FakeRequest, make_manager

from pagedserve.workers.kv.checks import assert_no_leaks, check_invariants


def test_rollback_slots_forgets_positions_a_preempted_step_never_computed():
    # "a" was scheduled to decode position 7 (the token that fills block 1), then preempted
    # by a later allocation of the same step: no forward writes position 7.
    m = make_manager(num_blocks=4, num_swap_blocks=4)
    a = FakeRequest("a", list(range(7)))
    m.allocate_slots(a, 7)
    a.all_token_ids.append(7)
    m.allocate_slots(a, 1)
    assert m.pool.blocks[1].block_hash is not None  # hashed at allocation, not yet written
    m.pool.take_events()
    m.rollback_slots("a", 7)
    assert m.pool.blocks[1].block_hash is None and len(m.pool.cached) == 1
    assert [type(e).__name__ for e in m.pool.take_events()] == ["BlockRemoved"]
    assert m.get_block_ids("a") == [0, 1] and m._requests["a"].num_tokens == 7
    check_invariants(m)
    # No later request may hit the block whose last slot is unwritten.
    assert m.get_computed_blocks(FakeRequest("x", list(range(9)))).num_tokens == 4
    # After a swap round trip the next allocation starts at position 7 again.
    m.swap_out("a")
    m.swap_in(a)
    assert m.allocate_slots(a, 1) is not None and m._requests["a"].num_tokens == 8
    m.free("a")
    assert_no_leaks(m)


def test_rollback_slots_keeps_a_hash_it_did_not_register():
    # Two requests with the same prompt: "b" fills block 0 after "a" registered it, so "b"'s
    # copy stays unhashed, and rolling "b" back must leave "a"'s cached block alone.
    m = make_manager(num_blocks=4)
    a, b = FakeRequest("a", list(range(4))), FakeRequest("b", list(range(3)))
    m.allocate_slots(a, 4)
    m.allocate_slots(b, 3)
    b.all_token_ids.append(3)
    m.allocate_slots(b, 1)
    m.rollback_slots("b", 3)
    assert m.pool.blocks[0].block_hash is not None and m._requests["b"].block_hashes == []
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback_slots("b", 4)
    m.free("a")
    m.free("b")
    assert_no_leaks(m)
