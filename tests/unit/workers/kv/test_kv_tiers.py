"""The host and disk tiers alone: LRU bounds, host → disk demotion, exact keys (salts), the
disk tier's files, its write queue bound and its index after a restart."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.checks import check_tiers
from pagedserve.workers.kv.tier_disk import DiskTier
from pagedserve.workers.kv.tier_file import KVLayout, encode_block, file_name
from pagedserve.workers.kv.tier_host import HostTier
from pagedserve.workers.kv.tiers import TierStore
from pagedserve.workers.protocol.blocks import BlockKey

LAYOUT = KVLayout("toy", num_layers=1, block_size=2, num_kv_heads=1, head_dim=4, dtype="float32")
KV_BYTES = 1 * 2 * 2 * 1 * 4 * 4  # bytes of one block's KV


def key(i: int, salt: str | None = None) -> BlockKey:
    return BlockKey(None, (i, i + 1), () if salt is None else (salt,))


def digest(k: BlockKey) -> bytes:
    return block_hash(k.parent_hash, k.token_ids, k.extra_keys)


def kv(i: int) -> torch.Tensor:
    return torch.full(LAYOUT.block_shape, float(i))


FILE_BYTES = len(encode_block(digest(key(0)), key(0), kv(0), LAYOUT))


def test_host_tier_evicts_the_least_recently_used_block():
    host = HostTier(2 * KV_BYTES + 1, KV_BYTES)  # room for two
    assert host.capacity_blocks == 2
    assert host.put(digest(key(0)), key(0), kv(0)) == []
    assert host.put(digest(key(1)), key(1), kv(1)) == []
    assert host.get(digest(key(0)), key(0)) is not None  # 0 is now the most recent
    (evicted,) = host.put(digest(key(2)), key(2), kv(2))
    assert evicted[0] == digest(key(1)) and torch.equal(evicted[2], kv(1))
    assert host.holds(digest(key(0)), key(0)) and host.num_bytes == 2 * KV_BYTES


def test_a_salted_key_never_hits_another_tenants_block(tmp_path):
    disk = DiskTier(tmp_path, 10 * FILE_BYTES, LAYOUT)
    host = HostTier(4 * KV_BYTES, KV_BYTES)
    host.put(digest(key(0)), key(0), kv(0))
    disk.put(digest(key(1)), key(1), kv(1))
    for tier, i in ((host, 0), (disk, 1)):
        salted = key(i, "tenant-b")
        assert tier.get(digest(salted), salted) is None  # another hash
        assert tier.get(digest(key(i)), salted) is None  # same hash, other key: refused
        assert tier.get(digest(key(i)), key(i)) is not None
    disk.close()


def test_a_full_host_tier_demotes_to_disk_and_a_full_disk_deletes_lru_files(tmp_path):
    disk = DiskTier(tmp_path, 2 * FILE_BYTES, LAYOUT)
    announced = []
    store = TierStore(HostTier(KV_BYTES, KV_BYTES), disk, lambda ids: None, KV_BYTES)
    store.announce = lambda h, parent: announced.append((h, store.tier_of(h)))
    exports = iter(range(10))
    store.export = lambda ids: torch.stack([kv(next(exports)) for _ in ids], dim=2)
    for i in range(4):
        store.spill([(i, digest(key(i)), key(i))])
    # host holds 3; 1 and 2 were demoted to disk; 0 was demoted, then deleted by the bound.
    assert [store.tier_of(digest(key(i))) for i in range(4)] == [None, "disk", "disk", "host"]
    assert announced[-1] == (digest(key(2)), "disk")
    assert (digest(key(0)), None) in announced
    store.flush()
    check_tiers(store, flushed=True)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [file_name(digest(key(1))), file_name(digest(key(2))), "pagedserve-kv-tier.lock"]
    )
    packed = store.read([(digest(key(i)), key(i)) for i in (1, 2, 0)])
    assert packed.shape[2] == 2 and torch.equal(packed[:, :, 1], kv(2))  # stops at 0's miss
    stats = store.stats()
    assert stats.of("disk").stored_blocks == 3 and stats.of("disk").evicted_blocks == 1
    assert stats.of("host").evicted_blocks == 3 and stats.of("disk").hit_blocks == 2
    store.close()


def test_a_restarted_disk_tier_indexes_its_files_oldest_first_and_keeps_its_bound(tmp_path):
    disk = DiskTier(tmp_path, 3 * FILE_BYTES, LAYOUT)
    for i in range(3):
        disk.put(digest(key(i)), key(i), kv(i))
    disk.flush()
    for i in range(3):  # modification times in order: 0 oldest
        os.utime(disk.file_path(digest(key(i))), ns=(10**9 * (i + 1),) * 2)
    disk.close()
    smaller = DiskTier(tmp_path, 2 * FILE_BYTES, LAYOUT)  # a lower bound: 0 is evicted
    assert [k for _, k in smaller.items()] == [key(1), key(2)]
    assert torch.equal(smaller.get(digest(key(2)), key(2)), kv(2))
    smaller.flush()
    assert not smaller.file_path(digest(key(0))).exists()
    smaller.close()
    other = DiskTier(tmp_path, 2 * FILE_BYTES, dataclasses.replace(LAYOUT, model="b"))
    assert len(other) == 0 and other.corrupt_skipped == 2  # another model's files: removed
    other.close()


def test_the_disk_write_queue_bound_drops_blocks_instead_of_waiting(tmp_path):
    disk = DiskTier(tmp_path, 10 * FILE_BYTES, LAYOUT, max_pending_bytes=FILE_BYTES)
    release = threading.Event()
    write = disk._write

    def held_write(*args):  # the disk is slow: the first write stays pending until released
        release.wait()
        write(*args)

    disk._write = held_write
    assert disk.put(digest(key(0)), key(0), kv(0)) == []
    assert disk.put(digest(key(1)), key(1), kv(1)) is None  # the queue is full: dropped
    assert disk.dropped_blocks == 1 and not disk.holds(digest(key(1)), key(1))
    assert torch.equal(disk.get(digest(key(0)), key(0)), kv(0))  # read while pending
    release.set()
    disk.flush()
    check_tiers(TierStore(None, disk, lambda ids: None, KV_BYTES), flushed=True)
    disk.close()


def test_a_host_tier_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="kv_host_tier_bytes 5 holds no block"):
        HostTier(5, KV_BYTES)
