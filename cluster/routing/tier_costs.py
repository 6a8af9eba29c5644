"""What a prefix hit below the device costs the router: a load, cheaper than a prefill.

A worker's matched prefix can sit partly in its host or disk tier (`workers/kv/tiers.py`): the
engine loads those blocks back before the prefill, which costs time, though less than computing
them. `PrefixView.tier_hits` counts, per worker, the matched blocks in each tier; `TierCosts`
turns that into prefill blocks' worth (`kv_aware` adds it to the blocks to prefill), so that
of two workers matching the same prefix the one holding it on the device wins, and a worker
holding it on disk still beats one that must prefill it all.

    cost = prefill_weight · (blocks_to_prefill + host_block_cost · host + disk_block_cost · disk)
           + load

`pagedserve bench tier-cost` measures the two fractions on the machine at hand (see
`RoutingConfig.tier_host_block_cost`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple


class TierHits(NamedTuple):
    """Where one worker holds its matched prefix, in blocks.

    Attributes:
        device_prefix: leading matched blocks on the device, before the first lower-tier one
            (what a peer could export to a pull: only device blocks are exported).
        host: matched blocks at best in the host tier.
        disk: matched blocks at best in the disk tier.
    """

    device_prefix: int
    host: int
    disk: int


@dataclass(frozen=True)
class TierCosts:
    """Prefill blocks one block's load from each lower tier is worth (0: free, 1: a prefill).

    Args:
        host_block_cost: a block loaded from the host tier.
        disk_block_cost: a block loaded from the disk tier.
    """

    host_block_cost: float
    disk_block_cost: float

    def __post_init__(self) -> None:
        for name in ("host_block_cost", "disk_block_cost"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    def load_blocks(self, hits: TierHits) -> float:
        """The prefill blocks a worker's lower-tier hits are worth."""
        return self.host_block_cost * hits.host + self.disk_block_cost * hits.disk

    def per_worker(self, hits: Mapping[str, TierHits]) -> dict[str, float]:
        """`load_blocks` of each worker with any lower-tier hit."""
        return {w: cost for w, h in hits.items() if (cost := self.load_blocks(h)) > 0}
