"""A leaving worker's cache handover: its hot prefixes pushed to peers with free blocks.

Before the pool drains and stops a worker (`cluster/pool/pool.py`), it asks the worker for
its cached prefixes as whole chains, hottest first (`Worker.hot_chains`), and pushes each
chain a peer does not already hold to the peer with the most room, through the same
transfer as a push under eviction pressure (`Migrations.transfer`, `cluster/pool/migration.py`:
the peer pulls the blocks, and its KV events put them in the index and every router's view).

"Room" is a peer's uncached free blocks above its push low-water mark
(`push_free_fraction` of its pool): an import that took cached free blocks would evict the
peer's own cache to keep the leaver's, and one that took the last free blocks would put the
peer under pressure at once. So a handover loses no cache that a peer can hold, and costs no
peer any of its own.

Only peers built from the same spec take the KV (equal fingerprints): a peer of another
engine config (a rolling replacement after a config change) may lay its KV out differently.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.pool.migration import Migrations
from pagedserve.cluster.router.types import MigrationKind
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandoverResult:
    chains: int = 0  # chains a peer took (some of their blocks, at least)
    blocks: int = 0  # blocks peers took


async def hand_over(
    source: WorkerState,
    peers: list[WorkerState],
    migrations: Migrations,
    index: Any,
    timeout_s: float,
) -> HandoverResult:
    """Push `source`'s hot chains to `peers`, within their room (see the module docstring).

    Args:
        source: the leaving worker.
        peers: the workers that may take its KV (serving, same spec).
        migrations: whose `transfer` copies a chain.
        index: the prefix index (to skip chains a peer holds already).
        timeout_s: the deadline of each control call.
    """
    room = await _room_of(peers, migrations.config.push_free_fraction, timeout_s)
    budget = sum(room.values())
    if budget <= 0:
        return HandoverResult()
    try:
        chains = await within(source.handle.hot_chains.remote(budget), timeout_s)
    except (*WORKER_LOST_ERRORS, TimeoutError):
        logger.warning("handover: %s did not list its cache", source.worker_id)
        return HandoverResult()
    by_id = {p.worker_id: p for p in peers}
    taken_chains = taken_blocks = 0
    for chain in chains:
        holders = await within(index.match.remote(chain), timeout_s)
        if any(n == len(chain) for wid, n in holders.items() if wid in by_id):
            continue  # a peer holds it already
        target_id = max(room, key=lambda wid: (room[wid], wid))
        if room[target_id] < len(chain):
            continue  # a shorter chain may still fit somewhere
        moved = await migrations.transfer(MigrationKind.PUSH, source, by_id[target_id], chain)
        room[target_id] = room[target_id] - len(chain) if moved else 0
        if moved:
            taken_chains += 1
            taken_blocks += moved
    return HandoverResult(taken_chains, taken_blocks)


async def _room_of(
    peers: list[WorkerState], low_water_fraction: float, timeout_s: float
) -> dict[str, int]:
    """Each peer's uncached free blocks above its low-water mark, fresh from its stats."""

    async def room(peer: WorkerState) -> int:
        try:
            stats = await within(peer.handle.stats.remote(), timeout_s)
        except (*WORKER_LOST_ERRORS, TimeoutError):
            return 0
        low_water = math.ceil(low_water_fraction * stats.kv.total_blocks)
        return max(0, stats.kv.free_blocks - low_water)

    rooms = await asyncio.gather(*(room(p) for p in peers))
    return {p.worker_id: r for p, r in zip(peers, rooms, strict=True)}
