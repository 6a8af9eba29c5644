"""Draft slots in KVCacheManager: exact block ids, hashes and free-queue order (B = 4)."""

import pytest
from support.kv import FakeRequest, make_manager

from pagedserve.workers.kv.checks import assert_no_leaks, check_invariants


def free_ids(manager):
    return manager.pool.free_queue.block_ids()


def decoding(manager, tokens):
    """A request whose prompt `tokens` is computed and whose first sampled token is known."""
    request = FakeRequest("a", list(tokens))
    manager.allocate_slots(request, len(tokens))
    request.all_token_ids.append(100)  # sampled; its KV comes with the next step
    return request


def test_rejected_drafts_free_whole_blocks_and_keep_accepted_slots():
    m = make_manager(num_blocks=8)
    a = decoding(m, range(6))  # blocks 0, 1; position 6 is the sampled token
    # Verify chunk: position 6 (sampled) + 5 drafts at 7..11 -> blocks 1 and 2 grow in.
    alloc = m.allocate_slots(a, 1, num_draft_tokens=5)
    assert alloc.new_block_ids == (2,) and m.get_block_ids("a") == [0, 1, 2]
    assert m.pool.blocks[1].block_hash is None, "a block holding drafts was hashed"
    check_invariants(m)
    # Accept 1 draft (position 7): block 1 is full of accepted tokens and gets hashed; block 2
    # held only rejected drafts and goes back to the head of the free queue.
    a.all_token_ids.append(7)
    m.accept_draft_slots(a, 1)
    assert m.get_block_ids("a") == [0, 1]
    assert m.pool.blocks[1].block_hash is not None
    assert free_ids(m) == [2, 3, 4, 5, 6, 7]
    check_invariants(m)
    m.free("a")
    assert_no_leaks(m)


def test_accepting_every_draft_keeps_every_block():
    m = make_manager(num_blocks=8)
    a = decoding(m, range(6))
    m.allocate_slots(a, 1, num_draft_tokens=5)
    a.all_token_ids += [7, 8, 9, 10, 11]
    m.accept_draft_slots(a, 5)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert [m.pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, True]
    m.free("a")
    assert_no_leaks(m)


def test_a_rollback_drops_draft_slots_and_the_blocks_only_they_needed():
    m = make_manager(num_blocks=8, num_swap_blocks=4)
    a = decoding(m, range(7))  # blocks 0, 1; the sampled token is position 7 (fills block 1)
    m.allocate_slots(a, 1, num_draft_tokens=4)  # drafts at 8..11: block 2
    assert m.get_block_ids("a") == [0, 1, 2] and m.pool.blocks[1].block_hash is not None
    with pytest.raises(ValueError, match="holds draft slots"):
        m.swap_out("a")
    m.rollback_slots("a", 7)  # preempted before the forward
    assert m.get_block_ids("a") == [0, 1]
    assert m.pool.blocks[1].block_hash is None  # its last slot was never written
    assert m.swap_out("a") == [(0, 0), (1, 1)]
    check_invariants(m)
    m.free("a")
    assert_no_leaks(m)


def test_drafts_never_write_a_shared_block():
    m = make_manager(num_blocks=8)
    a = decoding(m, range(6))
    m.fork("a", "b")  # b shares blocks 0 and 1 (1 is partial)
    b = FakeRequest("b", list(a.all_token_ids))
    alloc = m.allocate_slots(b, 1, num_draft_tokens=3)
    # Block 1 is copied before the verify chunk writes it; drafts land in private blocks.
    assert alloc.copies == ((1, 2),) and m.get_block_ids("b") == [0, 2, 3]
    assert m.get_block_ids("a") == [0, 1]
    check_invariants(m)
    m.free("a")
    m.free("b")
    assert_no_leaks(m)


def test_draft_slots_must_be_resolved_before_the_next_allocation():
    m = make_manager(num_blocks=8)
    a = decoding(m, range(6))
    m.allocate_slots(a, 1, num_draft_tokens=2)
    with pytest.raises(ValueError, match="still holds 2 draft slots"):
        m.allocate_slots(a, 0)
    with pytest.raises(ValueError, match="cannot accept 3 of 2"):
        m.accept_draft_slots(a, 3)
    with pytest.raises(ValueError, match="only 0 new tokens are known"):
        m.accept_draft_slots(a, 1)  # the accepted draft is not among the tokens
    m.free("a")
    assert_no_leaks(m)


def test_truncate_frees_the_blocks_past_the_kept_prefix():
    m = make_manager(num_blocks=8)
    a = FakeRequest("a", list(range(11)))
    m.allocate_slots(a, 11)  # blocks 0, 1, 2
    m.truncate("a", 5)
    assert m.get_block_ids("a") == [0, 1] and free_ids(m)[0] == 2
    check_invariants(m)
    m.free("a")
    assert_no_leaks(m)
