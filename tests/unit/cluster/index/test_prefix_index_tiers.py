"""The prefix index records the tier of each worker's blocks (device, host, disk), from events
and snapshots, and a real pool with a host tier keeps it in step as blocks move down."""

from __future__ import annotations

import torch

from pagedserve.cluster.index.prefix_index import PrefixIndexState
from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.kv.tier_host import HostTier
from pagedserve.workers.kv.tiers import TierStore
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.protocol.events import BlockRemoved, BlockStored, KVSnapshot

KV_SHAPE = (1, 2, 4, 1, 2)  # [L, 2, B, Hkv, D] of a toy pool


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def test_events_and_snapshots_carry_each_blocks_tier():
    state = PrefixIndexState()
    snapshot = KVSnapshot("w0", "e1", 0, (h(1), h(2)), ("device", "disk"))
    assert state.apply_snapshot(snapshot)
    assert state.tier_of("w0", h(1)) == "device" and state.tier_of("w0", h(2)) == "disk"
    events = [
        BlockStored(0, h(1), None, -1, tier="host"),  # moved down from the device
        BlockStored(1, h(2), None, 3),  # loaded back onto the device
        BlockStored(2, h(3), None, -1, tier="disk"),
    ]
    assert state.publish("w0", "e1", events).applied == 3
    assert [state.tier_of("w0", h(i)) for i in (1, 2, 3)] == ["host", "device", "disk"]
    assert state.tier_counts("w0") == {"device": 1, "host": 1, "disk": 1}
    assert state.match([h(1)]) == {"w0": 1}  # a lower-tier block is still a hit
    assert state.publish("w0", "e1", [BlockRemoved(3, h(3), -1)]).applied == 1
    assert state.tier_of("w0", h(3)) is None and state.tier_counts("w0")["disk"] == 0
    state.check_invariants()


def test_a_pool_with_a_host_tier_keeps_the_index_in_step():
    pool = BlockPool(2)
    exported = []

    def export(block_ids):
        exported.append(list(block_ids))
        return torch.zeros((KV_SHAPE[0], 2, len(block_ids), *KV_SHAPE[2:]))

    host = HostTier(2 * 32, bytes_per_block=32)  # two blocks
    pool.attach_lower_tiers(TierStore(host, None, export, bytes_per_block=32))
    state = PrefixIndexState()
    assert state.apply_snapshot(KVSnapshot("w0", "e1", pool.next_event_seq, ()))

    def publish():
        assert not state.publish("w0", "e1", pool.take_events()).needs_resync

    keys = [BlockKey(None, (i, i, i, i), ()) for i in range(4)]
    digests = [block_hash(None, key.token_ids) for key in keys]
    for digest, key in zip(digests, keys, strict=True):
        (block,) = pool.get_new_blocks(1)
        pool.cache_full_block(block, digest, key)
        pool.free_blocks([block])
    publish()
    # Blocks 0 and 1 were evicted to the host tier when 2 and 3 took their device blocks.
    assert exported == [[0], [1]]
    assert [state.tier_of("w0", d) for d in digests] == ["host", "host", "device", "device"]
    # Two more evictions push 0 and 1 out of the two-block host tier: gone everywhere.
    pool.get_new_blocks(2)
    publish()
    assert [state.tier_of("w0", d) for d in digests] == [None, None, "host", "host"]
    assert set(pool.lower.tier_of(d) for d in digests[2:]) == {"host"}
    snapshot = dict(pool.held_blocks())
    assert snapshot == {digests[2]: "host", digests[3]: "host"}
    state.check_invariants()
