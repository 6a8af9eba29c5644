"""Invariant and leak checks over a `KVCacheManager`, for tests, soak runs and `stats()`.

`check_invariants` holds after every operation; `assert_no_leaks` holds once every request
has ended. Both raise `KVInvariantError` naming the first broken rule.
"""

from __future__ import annotations

from collections import Counter

from pagedserve.workers.block_hash import block_hash
from pagedserve.workers.kv_cache_manager import KVCacheManager
from pagedserve.workers.kv_memory import blocks_needed


class KVInvariantError(AssertionError):
    """A KV pool invariant is broken: a leak, a double free or a corrupt cache map."""


def _fail(message: str) -> None:
    raise KVInvariantError(message)


def check_invariants(manager: KVCacheManager) -> None:
    """Check every structural invariant of the pool and the block tables."""
    pool = manager.pool
    free_ids = pool.free_queue.block_ids()
    if len(free_ids) != len(set(free_ids)) or len(free_ids) != pool.num_free_blocks:
        _fail(f"free queue is corrupt: {free_ids} (count {pool.num_free_blocks})")
    free_set = set(free_ids)
    references: Counter[int] = Counter()
    for request_id, state in manager._requests.items():
        references.update(block.block_id for block in state.blocks)
        _check_request(manager, request_id, state)
    for block in pool.blocks:
        if block.ref_cnt < 0:
            _fail(f"block {block.block_id} has negative ref_cnt {block.ref_cnt}")
        if (block.block_id in free_set) != (block.ref_cnt == 0):
            in_queue = block.block_id in free_set
            _fail(f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue: {in_queue}")
        if block.ref_cnt != references[block.block_id]:
            _fail(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{references[block.block_id]} block-table references"
            )
        if block.block_hash is not None and pool.cached.get(block.block_hash) is not block:
            _fail(f"block {block.block_id} has a hash the cache map does not point back to")
    for digest, block in pool.cached.items():
        key = block.key
        if block.block_hash != digest or key is None:
            _fail(f"cache map entry for block {block.block_id} disagrees with the block")
        if block_hash(key.parent_hash, key.token_ids, key.extra_keys) != digest:
            _fail(f"block {block.block_id}: stored key does not hash to its map entry")
    swap_free = manager._free_swap_slots
    swap_used = [slot for state in manager._requests.values() for slot in state.swap_slots]
    all_slots = swap_free + swap_used
    if sorted(all_slots) != list(range(manager.num_swap_blocks)):
        _fail(f"swap slots lost or doubled: free {swap_free}, used {swap_used}")


def _check_request(manager: KVCacheManager, request_id: str, state) -> None:
    B = manager.block_size
    if state.swap_slots:
        if state.blocks or state.num_draft_slots:
            _fail(f"request {request_id} is swapped out but still holds device blocks or drafts")
        return
    positions = state.num_tokens + state.num_draft_slots
    if len(state.blocks) < blocks_needed(positions, B):
        _fail(f"request {request_id}: {len(state.blocks)} blocks for {positions} positions")
    if len(state.block_hashes) > state.num_tokens // B:
        _fail(f"request {request_id}: more hashes than full blocks")
    for index, digest in enumerate(state.block_hashes):
        block = state.blocks[index]
        if block.block_hash is not None and block.block_hash != digest:
            _fail(f"request {request_id}: block {block.block_id} cached under another hash")


def assert_no_leaks(manager: KVCacheManager) -> None:
    """Once every request has ended: no table, every block free, free + cached = total."""
    check_invariants(manager)
    pool = manager.pool
    if manager._requests:
        _fail(f"requests still hold blocks: {sorted(manager._requests)}")
    held = [block.block_id for block in pool.blocks if block.ref_cnt != 0]
    if held:
        _fail(f"blocks still referenced: {held}")
    if pool.num_free_blocks != pool.num_blocks:
        _fail(f"{pool.num_free_blocks} free blocks of {pool.num_blocks}")
    if manager.num_free_swap_blocks != manager.num_swap_blocks:
        _fail(f"{manager.num_free_swap_blocks} free swap slots of {manager.num_swap_blocks}")
