"""Routing knows tiers: the feed carries each block's tier to a router's view, the view says
where each worker's matched prefix is, and `kv_aware` costs a host or disk hit as a load."""

from __future__ import annotations

import math

import pytest

from pagedserve.cluster.config import ClusterConfig, RoutingConfig
from pagedserve.cluster.index.feed import Stored
from pagedserve.cluster.index.prefix_index import PrefixIndexState
from pagedserve.cluster.index.view import PrefixView
from pagedserve.cluster.routing.kv_aware import KvAwarePolicy
from pagedserve.cluster.routing.policy import WorkerLoad
from pagedserve.cluster.routing.tier_costs import TierCosts, TierHits
from pagedserve.workers.protocol.events import BlockStored, KVSnapshot

COSTS = TierCosts(host_block_cost=0.25, disk_block_cost=0.5)


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def idle(worker_id: str) -> WorkerLoad:
    return WorkerLoad(worker_id, 0, 0, used_blocks=0, total_blocks=64, free_blocks=64)


def cluster_view() -> tuple[PrefixIndexState, PrefixView]:
    """w0: 1 on the device, 2 and 3 on host; w1: all three on the device; w2: 1, 2 on disk."""
    state = PrefixIndexState()
    prefix = (h(1), h(2), h(3))
    state.apply_snapshot(KVSnapshot("w0", "e", 0, prefix, ("device", "host", "host")))
    state.apply_snapshot(KVSnapshot("w1", "e", 0, prefix))
    state.apply_snapshot(KVSnapshot("w2", "e", 0, prefix[:2], ("disk", "disk")))
    view = PrefixView()
    assert view.apply(state.feed.read(view.epoch, view.next_offset))  # a dump: tiers in it
    return state, view


def test_the_view_says_where_each_workers_match_is():
    _, view = cluster_view()
    prompt = [h(1), h(2), h(3), h(4)]
    matches = view.match(prompt)
    assert matches == {"w0": 3, "w1": 3, "w2": 2}
    assert view.tier_hits(prompt, matches) == {
        "w0": TierHits(device_prefix=1, host=2, disk=0),
        "w2": TierHits(device_prefix=0, host=0, disk=2),
    }  # w1 holds all of it on the device: absent
    assert COSTS.per_worker(view.tier_hits(prompt, matches)) == {"w0": 0.5, "w2": 1.0}


def test_a_tier_change_is_fed_to_the_view():
    state, view = cluster_view()
    state.publish("w1", "e", [BlockStored(0, h(3), h(2), -1, tier="disk")])  # moved down
    state.publish("w0", "e", [BlockStored(0, h(2), h(1), 5)])  # loaded back
    entries = state.feed.read(view.epoch, view.next_offset).entries
    assert [(e.worker_id, e.tier) for e in entries if isinstance(e, Stored)] == [
        ("w1", "disk"),
        ("w0", "device"),
    ]
    assert view.apply(state.feed.read(view.epoch, view.next_offset))
    assert view.tier_of("w1", h(3)) == "disk" and view.tier_of("w0", h(2)) == "device"
    assert view.tier_hits([h(1), h(2), h(3)], view.match([h(1), h(2), h(3)]))["w0"] == (2, 1, 0)
    view.check_invariants()


def test_kv_aware_prefers_device_then_host_then_disk_then_prefill():
    _, view = cluster_view()
    prompt = [h(1), h(2), h(3), h(4)]
    policy = KvAwarePolicy(block_size=16)

    def chosen(*workers: str) -> str:
        matches = {w: n for w, n in view.match(prompt).items() if w in workers}
        tier_load = COSTS.per_worker(view.tier_hits(prompt, matches))
        decision = policy.choose(len(prompt), matches, [idle(w) for w in workers], tier_load)
        ranking = policy.new_ranking()  # the router's fast path picks the same
        for worker in workers:
            ranking.put(idle(worker))
        ranked = policy.choose_ranked(len(prompt), matches, ranking, tier_load)
        assert ranked.worker_id == decision.worker_id
        return decision.worker_id

    assert chosen("w0", "w1", "w2", "w3") == "w1"  # all on the device
    assert chosen("w0", "w2", "w3") == "w0"  # two blocks from host beat one more from disk
    assert chosen("w2", "w3") == "w2"  # a disk hit still beats prefilling it
    # Without the tier term w0 and w1 tie on cost; the tie-break (id) picks w0.
    matches = view.match(prompt)
    assert policy.choose(len(prompt), matches, [idle("w0"), idle("w1")]).worker_id == "w0"


def test_tier_costs_are_checked():
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="host_block_cost"):
            TierCosts(bad, 0.5)
        with pytest.raises(ValueError, match="tier_disk_block_cost"):
            ClusterConfig(
                routing=RoutingConfig(tier_disk_block_cost=bad),
            )
