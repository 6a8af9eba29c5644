"""Invariant and leak checks over a `KVCacheManager`, for tests, soak runs and `stats()`.

`check_invariants` holds after every operation; `assert_no_leaks` holds once every request
has ended. Both raise `KVInvariantError` naming the first broken rule. Both also check the
pool's lower tiers, if any (`check_tiers`: bounds, byte counts, keys, files).
"""

from __future__ import annotations

from collections import Counter

from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.kv.memory import blocks_needed
from pagedserve.workers.kv.tier_file import SUFFIX, file_name
from pagedserve.workers.kv.tiers import TierStore


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
    # A group swapped out together shares a slot per shared block (`workers/kv/swap.py`): each slot
    # held is counted once, and its owner count is the tables that hold it.
    owners = Counter(slot for state in manager._requests.values() for slot in state.swap_slots)
    if owners != manager._swap_slot_owners:
        _fail(f"swap slot owners {dict(owners)} != recorded {dict(manager._swap_slot_owners)}")
    swap_used = sorted(owners)
    if sorted(swap_free + swap_used) != list(range(manager.num_swap_blocks)):
        _fail(f"swap slots lost or doubled: free {swap_free}, used {swap_used}")
    if pool.lower is not None:
        check_tiers(pool.lower)


def check_tiers(store: TierStore, *, flushed: bool = False) -> None:
    """Each lower tier within its bound, with exact byte counts and keys that hash to their
    entries; every written disk entry has its file. With `flushed` (after `store.flush()`), no
    write is pending and the directory holds exactly the indexed files."""
    host, disk = store.host, store.disk
    if host is not None:
        if len(host) > host.capacity_blocks or host.num_bytes > host.capacity_bytes:
            _fail(f"host tier holds {len(host)} blocks, over its {host.capacity_blocks}")
        for digest, entry in host._entries.items():
            _check_key("host tier", digest, entry.key)
    if disk is None:
        return
    if disk.num_bytes > disk.capacity_bytes:
        _fail(f"disk tier holds {disk.num_bytes} bytes, over its {disk.capacity_bytes}")
    if disk.num_bytes != sum(entry.num_bytes for entry in disk._entries.values()):
        _fail(f"disk tier counts {disk.num_bytes} bytes, its entries add up to another sum")
    for digest, entry in disk._entries.items():
        _check_key("disk tier", digest, entry.key)
        pending = entry.pending is not None
        if pending and flushed:
            _fail(f"disk tier: block {digest.hex()[:12]} still pending after a flush")
        if not pending and not entry.failed and not disk.file_path(digest).exists():
            _fail(f"disk tier: block {digest.hex()[:12]} has no file")
    if flushed:
        on_disk = {path.name for path in disk.directory.glob("*" + SUFFIX)}
        indexed = {file_name(digest) for digest in disk._entries}
        if on_disk != indexed or list(disk.directory.glob("*.tmp")):
            _fail(f"disk tier: files {sorted(on_disk ^ indexed)} are not what it indexes")


def _check_key(tier: str, digest: bytes, key) -> None:
    if block_hash(key.parent_hash, key.token_ids, key.extra_keys) != digest:
        _fail(f"{tier}: the key of block {digest.hex()[:12]} does not hash to its entry")


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
