"""How a router picks a worker, and when KV moves between workers instead of being
recomputed. Read by the router (`cluster/router/`), KV migration (`cluster/pool/migration.py`)
and the pool's handover of a leaving worker's cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.config.checks import at_least, non_negative_finite, positive_finite
from pagedserve.cluster.routing.policies import DEFAULT_POLICY, RoutingPolicy, policy_names


@dataclass(frozen=True)
class RoutingConfig:
    """The routing policy and the migration (pull, push) settings.

    Attributes:
        routing_policy: a registered routing policy (`cluster/routing/policies.py`).
        routing_options: keyword options of the policy (e.g. `prefill_weight`).
        enable_pull: let the chosen worker fetch a prefix a peer holds instead of prefilling.
        pull_min_blocks: pull only when the holder has at least this many more blocks (below
            it, recomputing is cheaper than the transfer: `pagedserve bench pull` measured the
            crossover at 8 blocks of 16 tokens on CPU workers).
        pull_timeout_s: deadline of one pull; past it the request prefills as usual.
        tier_host_block_cost: what loading one matched block from a worker's host tier is
            worth in prefilled blocks, for `kv_aware` routing (`cluster/routing/tier_costs.py`): a
            device hit costs 0, a prefill 1. `pagedserve bench tier-cost` measured, on CPU
            workers at 16 tokens a block, a host load at 0.05 of a prefill per block with
            tiny-llama (0.05 ms vs 1.06 ms) and 0.03 with SmolLM2-135M (0.58 ms vs 18.4 ms).
        tier_disk_block_cost: the same for a block loaded from the disk tier: 0.32 with
            tiny-llama (0.33 ms a block) and 0.12 with SmolLM2-135M (2.1 ms), files in the
            page cache. On a GPU both are larger (a prefill per block is far cheaper there,
            a load crosses PCIe): measure there before serving.
        lora_load_block_cost: what putting a LoRA adapter into a worker's device slots is worth
            in prefilled blocks, for `kv_aware` routing of a request on that adapter
            (`cluster/router/loras.py`): workers with it resident win ties, and a worker's
            cached prefix still outweighs a load. `pagedserve bench lora` measures the load.
        enable_push: let a worker under eviction pressure hand cached blocks that no other
            worker holds to the worker with the most free blocks, instead of dropping them.
        push_free_fraction: "under pressure" means fewer uncached free blocks than this
            fraction of the pool, with cached blocks about to be evicted.
        push_max_chains: prefix chains pushed per worker per poll.
    """

    routing_policy: str = field(default=DEFAULT_POLICY, metadata={"choices": policy_names()})
    routing_options: dict[str, Any] = field(default_factory=dict)
    enable_pull: bool = True
    pull_min_blocks: int = 8
    pull_timeout_s: float = 5.0
    tier_host_block_cost: float = 0.05
    tier_disk_block_cost: float = 0.3
    lora_load_block_cost: float = 1.0
    enable_push: bool = True
    push_free_fraction: float = 0.1
    push_max_chains: int = 4

    def __post_init__(self) -> None:
        if self.routing_policy not in RoutingPolicy.registry:
            raise ValueError(
                f"routing_policy must be one of {sorted(RoutingPolicy.registry)}, "
                f"got {self.routing_policy!r}"
            )
        at_least(self, 1, "pull_min_blocks", "push_max_chains")
        positive_finite(self, "pull_timeout_s", "push_free_fraction")
        non_negative_finite(
            self, "tier_host_block_cost", "tier_disk_block_cost", "lora_load_block_cost"
        )
