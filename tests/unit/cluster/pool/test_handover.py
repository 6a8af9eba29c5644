"""`hand_over` with fake workers: chains go hottest first to the peer with the most room
(uncached free blocks above its push low-water mark), a chain a peer holds is skipped, a chain
that fits nowhere is skipped for a shorter one, and the leaver is asked for no more blocks
than its peers can take."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pagedserve.cluster.config import RoutingConfig
from pagedserve.cluster.pool.handover import HandoverResult, hand_over
from pagedserve.cluster.router.worker_state import WorkerState


class Method:
    """`handle.<method>.remote(...)` over a plain function."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


def peer(free_blocks: int, total: int = 100):
    kv = SimpleNamespace(free_blocks=free_blocks, total_blocks=total)
    return SimpleNamespace(stats=Method(lambda: SimpleNamespace(kv=kv)))


class FakeMigrations:
    """Records each transfer; the target takes every block of the chain."""

    def __init__(self) -> None:
        self.config = RoutingConfig(push_free_fraction=0.1)
        self.transfers: list[tuple[str, str, list[bytes]]] = []

    async def transfer(self, kind, source, target, chain):
        self.transfers.append((source.worker_id, target.worker_id, list(chain)))
        return len(chain)


def test_hot_chains_go_to_the_peer_with_the_most_room_within_it():
    a, b, c, d = [bytes([i]) for i in range(4)]
    chains = [[a, b, c], [a, d], [c] * 30, [d]]  # hottest first
    asked = []

    def hot_chains(max_blocks):
        asked.append(max_blocks)
        return chains

    source = WorkerState("leaver", SimpleNamespace(hot_chains=Method(hot_chains)))
    # Room: 14 - 10 = 4 blocks on p1, 22 - 10 = 12 on p2 (10 = 10% of 100 blocks kept free).
    peers = [WorkerState("p1", peer(14)), WorkerState("p2", peer(22))]
    holders = {(a, d): {"p1": 2}}  # p1 holds [a, d] whole already
    index = SimpleNamespace(match=Method(lambda chain: holders.get(tuple(chain), {})))
    migrations = FakeMigrations()

    result = asyncio.run(hand_over(source, peers, migrations, index, timeout_s=60.0))
    assert asked == [16]
    assert migrations.transfers == [
        ("leaver", "p2", [a, b, c]),  # the most room: p2 (12)
        # [a, d]: held by p1; [c] * 30 fits nowhere; [d]: p2 has 9 left, p1 4
        ("leaver", "p2", [d]),
    ]
    assert result == HandoverResult(chains=2, blocks=4)


def test_no_room_anywhere_asks_the_leaver_for_nothing():
    source = WorkerState("leaver", SimpleNamespace(hot_chains=Method(lambda n: 1 / 0)))
    peers = [WorkerState("p1", peer(10))]  # exactly at its low-water mark
    result = asyncio.run(hand_over(source, peers, FakeMigrations(), None, timeout_s=60.0))
    assert result == HandoverResult()
