"""What one run of `pagedserve bench routing` is given: its settings and the seeded workload.

Every policy gets the same requests at the same times: K system prompts of S random byte tokens,
each request one of them plus U tokens of its own, arriving as a Poisson process. Nothing here
starts Ray or a worker, so the workload and its ideal hit counts are testable alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pagedserve.cluster.config import RoutingConfig

POLICIES = ("kv_aware", "round_robin", "least_loaded")
MIGRATION_MODES = ("none", "kv_aware", "all")  # which policies run with pull (or push) on


@dataclass(frozen=True)
class RoutingBenchConfig:
    """One run's settings (`num_kv_blocks` None: the engine default, 256 MiB per CPU worker)."""

    policies: tuple[str, ...] = POLICIES
    num_workers: int = 3
    num_requests: int = 96
    request_rate: float = 6.0
    num_system_prompts: int = 8
    system_prompt_len: int = 1024
    user_len: int = 32
    max_tokens: int = 16
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    pull: str = "kv_aware"
    pull_min_blocks: int = RoutingConfig.pull_min_blocks  # the cluster's measured crossover
    push: str = "kv_aware"
    worker_num_cpus: float = 1.0
    kv_aware_options: tuple[tuple[str, Any], ...] = ()  # KvAwarePolicy keyword options
    model: str = "tiny-llama"  # a built-in name, checkpoint directory or .gguf file

    def __post_init__(self) -> None:
        unknown = sorted(set(self.policies) - set(POLICIES))
        if unknown or not self.policies:
            raise ValueError(f"policies must be some of {POLICIES}, got {self.policies}")
        for name in ("pull", "push"):
            if getattr(self, name) not in MIGRATION_MODES:
                raise ValueError(f"{name} must be one of {MIGRATION_MODES}")
        for name in ("num_workers", "num_requests", "num_system_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_len < 1 or self.user_len < 0:
            raise ValueError("system_prompt_len must be >= 1 and user_len >= 0")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")

    def pulls(self, policy: str) -> bool:
        return self.pull in ("all", policy)

    def pushes(self, policy: str) -> bool:
        return self.push in ("all", policy)

    @property
    def prefix_blocks(self) -> int:
        """KV blocks one worker needs to cache every system prompt."""
        return self.num_system_prompts * -(-self.system_prompt_len // self.block_size)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the workload: when it arrives, which system prompt it shares, its tokens."""

    index: int
    arrival_s: float
    system_prompt: int
    token_ids: tuple[int, ...]


def make_workload(config: RoutingBenchConfig) -> list[PlannedRequest]:
    """The seeded requests every policy gets: prompts, suffixes and Poisson arrival times.

    Args:
        config: the run's settings; `seed`, the prompt shape and `request_rate` are used.

    Returns:
        `num_requests` requests in arrival order, the first arriving at 0.
    """
    rng = random.Random(config.seed)
    systems = [
        [rng.randrange(256) for _ in range(config.system_prompt_len)]
        for _ in range(config.num_system_prompts)
    ]
    requests, now = [], 0.0
    for index in range(config.num_requests):
        now += rng.expovariate(config.request_rate) if index else 0.0
        which = rng.randrange(config.num_system_prompts)
        user = [rng.randrange(256) for _ in range(config.user_len)]
        requests.append(PlannedRequest(index, now, which, tuple(systems[which] + user)))
    return requests


def ideal_cached_tokens(
    workload: list[PlannedRequest], system_prompt_len: int, block_size: int
) -> list[int]:
    """What one worker holding every prefix would find cached, per request.

    That is the full blocks of the request's system prompt, unless it is the first request of
    that prompt (which finds nothing). The engine always computes a prompt's last token, so a
    block ending there does not count.

    Args:
        workload: the requests, in any order.
        system_prompt_len: S, tokens of every system prompt.
        block_size: B, tokens per KV block.

    Returns:
        Cached tokens per request, in `workload` order.
    """
    first_arrival: dict[int, int] = {}
    for request in sorted(workload, key=lambda r: (r.arrival_s, r.index)):
        first_arrival.setdefault(request.system_prompt, request.index)
    ideal = []
    for request in workload:
        full_blocks = min(system_prompt_len, len(request.token_ids) - 1) // block_size
        first = first_arrival[request.system_prompt] == request.index
        ideal.append(0 if first else full_blocks * block_size)
    return ideal
