"""Loading a waiting request's prefix back from the lower tiers before its prefill.

    request's full blocks   h0   h1   h2   h3   h4
    device pool             ✓    ✓    ✗                      device hit: 2 blocks
    host / disk tiers                 ✓    ✓    ✗            run to load: h2, h3
    after the load          ✓    ✓    ✓    ✓                 the scheduler's hit: 4 blocks

The run's blocks are read from their tier, written into fresh device blocks and registered as
cached free blocks, exactly like a pulled prefix (`PrefixTransfer`). The scheduler's ordinary
prefix lookup then finds them, so they count as a hit and their tokens are never prefilled.
The request's device-hit blocks are held while the new blocks are taken, so taking them cannot
evict the very prefix the run continues.

Builds `TierStore`s from the engine's config (`build_tier_store`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedserve.workers.kv.block import Block
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.kv.manager import KVCacheManager, KVRequest
from pagedserve.workers.kv.memory import blocks_needed
from pagedserve.workers.kv.tier_disk import DiskTier
from pagedserve.workers.kv.tier_file import KVLayout
from pagedserve.workers.kv.tier_host import HostTier
from pagedserve.workers.kv.tiers import StepTierLoad, TierLoad, TierStore
from pagedserve.workers.protocol.blocks import BlockHash, BlockKey

if TYPE_CHECKING:
    from pagedserve.workers.engine.request import Request


def build_tier_store(
    kv_cache: KVCache,
    layout: KVLayout,
    *,
    host_bytes: int,
    disk_dir: str | os.PathLike | None,
    disk_bytes: int,
) -> TierStore | None:
    """The tiers the config asks for (None: neither). Raises `DiskTierError` when the disk
    tier's directory cannot be used, ValueError when a tier's bytes hold no block."""
    host = HostTier(host_bytes, kv_cache.packed_bytes_per_block) if host_bytes > 0 else None
    disk = DiskTier(disk_dir, disk_bytes, layout) if disk_dir is not None else None
    if host is None and disk is None:
        return None
    return TierStore(host, disk, kv_cache.export_blocks, kv_cache.packed_bytes_per_block)


def load_waiting_prefixes(
    kv: KVCacheManager,
    kv_cache: KVCache,
    tiers: TierStore,
    waiting: Iterable[Request],
    slots: int,
) -> list[StepTierLoad]:
    """Before admission: bring the lower-tier prefixes of the waiting requests a step can admit
    (`slots` sequences) back into the device pool, so the scheduler sees them as prefix hits.

    Requests are taken in queue order while their whole sequences fit the pool's free blocks
    together: a load takes free (possibly cached) blocks, so loading for a request the step
    cannot admit would evict the blocks just loaded for the one before it, and a long queue on
    a full pool turned every step into a round of wasted tier reads.

    Returns:
        One `StepTierLoad` per request that loaded blocks (for its trace's spans).
    """
    loads: list[StepTierLoad] = []
    tiers.reap_failed()
    if not tiers.num_blocks:
        return loads
    room = kv.pool.num_free_blocks - kv.reserve_blocks
    for request in waiting:
        if slots <= 0:
            break
        if request.paused:
            continue
        room -= blocks_needed(len(request.all_token_ids), kv.block_size)
        if room < 0:
            break
        slots -= 1 + len(request.pending_branches)
        started, hits = time.time_ns(), tiers.hits()
        if load_prefix_from_tiers(kv, kv_cache, tiers, request):
            after = tiers.hits()
            load = TierLoad(*(a - b for a, b in zip(after, hits, strict=True)))
            loads.append(StepTierLoad(request.group_id, started, time.time_ns(), load))
    return loads


def load_prefix_from_tiers(
    kv: KVCacheManager, kv_cache: KVCache, tiers: TierStore, request: KVRequest
) -> int:
    """Bring the lower-tier continuation of `request`'s device prefix into the device pool.

    Returns:
        How many blocks were loaded (0: nothing to load, or no free room for it).
    """
    pool = kv.pool
    device_hit: list[Block] = []
    run: list[tuple[BlockHash, BlockKey]] = []
    for digest, key in kv.iter_prefix_keys(request):
        if not run:
            block = pool.get_cached_block(digest, key)
            if block is not None:
                device_hit.append(block)
                continue
        if digest in pool.cached or not tiers.holds(digest, key):
            break
        run.append((digest, key))
    if not run:
        return 0
    revived = sum(1 for block in device_hit if block.ref_cnt == 0)
    room = pool.num_free_blocks - revived - kv.reserve_blocks
    del run[max(0, room) :]
    if not run:
        return 0
    started = time.perf_counter()
    packed = tiers.read(run)  # before taking blocks: their spills must not push the run out
    if packed is None:
        return 0
    run = run[: packed.shape[2]]
    pool.touch(device_hit)
    try:
        blocks = pool.get_new_blocks(len(run))
        try:
            kv_cache.import_blocks(packed, [block.block_id for block in blocks])
        except Exception:
            pool.free_blocks(reversed(blocks))
            raise
        for block, (digest, key) in zip(blocks, run, strict=True):
            pool.cache_full_block(block, digest, key)
        pool.free_blocks(reversed(blocks))  # cached and free: the scheduler's hit takes them
    finally:
        pool.free_blocks(reversed(device_hit))
    tiers.record_load(len(run), time.perf_counter() - started)
    return len(run)
