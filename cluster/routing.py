"""Routing policies: which alive worker serves a request.

A policy sees three things: the request's prompt length in blocks, how many leading blocks each
worker already caches (`PrefixIndex.match`), and each alive worker's `WorkerLoad`; and, where a
worker's match sits partly in its host or disk tier, what loading those blocks is worth in
prefill blocks (`tier_load_blocks`, from `cluster/tier_costs.py`). The load joins
what the worker last reported with what the router itself has sent there and not yet seen
finish (`inflight`, `inflight_tokens`): reports lag, and a router blind between them would send a
burst of requests to the same "idle" worker. The caller counts those: after each decision it
adds the request to the chosen worker's `inflight` and removes it when the request ends.

Policies are small classes registered by `name`; `make_policy` builds one from config.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

DEFAULT_POLICY = "kv_aware"
# A block still to prefill costs more than a block already resident on a busy worker: with
# weight 1 a holder serving one long request (whose blocks include the very prefix a new
# request would share) looked costlier than a cold idle worker, and hits were lost. The
# routing bench measured this; 4 keeps holders preferred while the imbalance guard still
# stops a hot prefix from piling onto one worker.
DEFAULT_PREFILL_WEIGHT = 4.0


@dataclass(frozen=True)
class WorkerLoad:
    """One alive worker's load: its last report plus the router's own count of what it sent.

    Attributes:
        worker_id: the worker.
        num_running: sequences running, as last reported.
        num_waiting: sequences queued, as last reported.
        used_blocks: KV blocks in use, as last reported.
        total_blocks: KV blocks in its pool.
        free_blocks: KV blocks free, as last reported.
        inflight: requests this router sent there and has not seen finish.
        inflight_tokens: prompt + max_tokens of those requests: their KV demand at most.
    """

    worker_id: str
    num_running: int
    num_waiting: int
    used_blocks: int
    total_blocks: int
    free_blocks: int
    inflight: int = 0
    inflight_tokens: int = 0

    @property
    def num_requests(self) -> int:
        """Reported running + waiting plus the router's in-flight count.

        The two overlap for requests the worker has already reported; counting both errs on
        the side of seeing load, which is the failure that matters (a router that sees none).
        """
        return self.inflight + self.num_running + self.num_waiting


@dataclass(frozen=True)
class Candidate:
    """How a policy scored one worker; `excluded` names why it could not be chosen."""

    worker_id: str
    matched_blocks: int
    prefill_blocks: int
    load: float
    cost: float
    excluded: str | None = None
    tier_load_blocks: float = 0.0  # prefill blocks its lower-tier hits are worth


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen worker and every candidate's score (for logs, metrics and tests)."""

    worker_id: str
    policy: str
    candidates: tuple[Candidate, ...]
    matched_blocks: int


class RoutingPolicy(abc.ABC):
    """Picks one worker among the alive ones. Subclasses register themselves by `name`."""

    registry: ClassVar[dict[str, type[RoutingPolicy]]] = {}
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RoutingPolicy.registry[cls.name] = cls

    @abc.abstractmethod
    def choose(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        loads: Sequence[WorkerLoad],
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        """Pick a worker.

        Args:
            num_prompt_blocks: the prompt's length in KV blocks.
            matches: per worker, leading prompt blocks it caches (absent: none).
            loads: alive workers only, one entry each.
            tier_load_blocks: per worker, the prefill blocks its matched blocks below the
                device are worth to load (absent: all on the device).

        Returns:
            The decision, with every worker's candidate score sorted by worker id.

        Raises:
            ValueError: when `loads` is empty or names a worker twice.
        """


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """Build the routing policy registered as `name` with its options.

    Raises:
        ValueError: on an unknown name (listing the known ones) or an unknown option.
    """
    policy_class = RoutingPolicy.registry.get(name)
    if policy_class is None:
        raise ValueError(
            f"unknown routing policy {name!r}; known: {sorted(RoutingPolicy.registry)}"
        )
    try:
        return policy_class(**options)
    except TypeError as error:
        raise ValueError(f"bad options for routing policy {name!r}: {error}") from error


class KvAwarePolicy(RoutingPolicy):
    """Cheapest worker by `cost = prefill_weight · (blocks_to_prefill + tier_load) + load`.

    Definitions, all in KV blocks:

    - `blocks_to_prefill = num_prompt_blocks − matched_blocks` (the prompt blocks it lacks);
    - `tier_load`: what loading its matched blocks from the host or disk tier is worth in
      prefilled blocks (`tier_load_blocks`; `TierCosts.load_blocks`);
    - `load = max(used_blocks, ⌈inflight_tokens / block_size⌉) + waiting_weight · num_waiting`.
      The first term is decode load: the worker's reported KV use, or the router's estimate of
      what it sent there when that is larger (the report has not caught up yet). Waiting
      requests add a queueing term on top.

    Imbalance guard: a worker whose `load > imbalance_factor · mean(load) + imbalance_slack` is
    excluded (`"overloaded"`), so a hot prefix cached on one worker cannot pull every request
    there; with `imbalance_factor >= 1` some worker is always under the bound. The guard only
    applies once the load is also a real share of that worker's pool
    (`> imbalance_pool_fraction · total_blocks`) or requests wait there: with few workers, one
    long request on a large pool is far above the mean but no pile-up worth a lost cache hit.
    Ties go to the lower load, then fewer in-flight requests, then the lower worker id.

    Args:
        prefill_weight: blocks of decode load one block of prefill is worth.
        block_size: tokens per KV block, to turn `inflight_tokens` into blocks.
        waiting_weight: load, in blocks, of each waiting request.
        imbalance_factor: how far above the mean load a worker may go (>= 1).
        imbalance_slack: absolute headroom in blocks, so that idle clusters are not guarded.
        imbalance_pool_fraction: share of its own pool a worker's load must pass before the
            guard may exclude it (unless requests wait there).
    """

    name = "kv_aware"

    def __init__(
        self,
        prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
        block_size: int = 16,
        waiting_weight: float = 1.0,
        imbalance_factor: float = 1.5,
        imbalance_slack: float = 16.0,
        imbalance_pool_fraction: float = 0.25,
    ) -> None:
        weights = {
            "prefill_weight": prefill_weight,
            "waiting_weight": waiting_weight,
            "imbalance_factor": imbalance_factor,
            "imbalance_slack": imbalance_slack,
            "imbalance_pool_fraction": imbalance_pool_fraction,
        }
        for name, value in weights.items():
            if not math.isfinite(value):  # NaN would pass every range check below
                raise ValueError(f"{name} must be a finite number, got {value}")
        if prefill_weight < 0 or waiting_weight < 0 or imbalance_slack < 0:
            raise ValueError("prefill_weight, waiting_weight and imbalance_slack must be >= 0")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if imbalance_factor < 1:
            raise ValueError(f"imbalance_factor must be >= 1, got {imbalance_factor}")
        self.prefill_weight = prefill_weight
        self.block_size = block_size
        self.waiting_weight = waiting_weight
        self.imbalance_factor = imbalance_factor
        self.imbalance_slack = imbalance_slack
        if not 0 <= imbalance_pool_fraction <= 1:
            raise ValueError(
                f"imbalance_pool_fraction must be in [0, 1], got {imbalance_pool_fraction}"
            )
        self.imbalance_pool_fraction = imbalance_pool_fraction

    def load_of(self, load: WorkerLoad) -> float:
        """The worker's load in blocks (see the class docstring)."""
        inflight_blocks = math.ceil(load.inflight_tokens / self.block_size)
        return max(load.used_blocks, inflight_blocks) + self.waiting_weight * load.num_waiting

    def guard_bound(self, load_values: Sequence[float]) -> float:
        """The load above which a worker is excluded as overloaded."""
        mean = sum(load_values) / len(load_values)
        return self.imbalance_factor * mean + self.imbalance_slack

    def _saturating(self, load: WorkerLoad, value: float) -> bool:
        if load.num_waiting > 0 or load.total_blocks <= 0:
            return True
        return value > self.imbalance_pool_fraction * load.total_blocks

    def choose(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        loads: Sequence[WorkerLoad],
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        ordered = _checked(loads)
        values = {w.worker_id: self.load_of(w) for w in ordered}
        bound = self.guard_bound(list(values.values()))
        over = {
            w.worker_id
            for w in ordered
            if values[w.worker_id] > bound and self._saturating(w, values[w.worker_id])
        }
        if len(over) == len(values):  # cannot happen with factor >= 1; never leave no one
            over = set()
        candidates = []
        for worker in ordered:
            matched, prefill = _prefix(worker.worker_id, num_prompt_blocks, matches)
            value = values[worker.worker_id]
            excluded = "overloaded" if worker.worker_id in over else None
            tier_load = _tier_load(worker.worker_id, tier_load_blocks)
            cost = self.prefill_weight * (prefill + tier_load) + value
            candidates.append(
                Candidate(worker.worker_id, matched, prefill, value, cost, excluded, tier_load)
            )
        inflight = {w.worker_id: w.inflight for w in ordered}
        best = min(
            (c for c in candidates if c.excluded is None),
            key=lambda c: (c.cost, c.load, inflight[c.worker_id], c.worker_id),
        )
        return _decision(best, self.name, candidates)


class LeastLoadedPolicy(RoutingPolicy):
    """Fewest requests: in-flight from this router + reported running + waiting; then id."""

    name = "least_loaded"

    def choose(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        loads: Sequence[WorkerLoad],
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        candidates = []
        for worker in _checked(loads):
            matched, prefill = _prefix(worker.worker_id, num_prompt_blocks, matches)
            count = float(worker.num_requests)
            candidates.append(Candidate(worker.worker_id, matched, prefill, count, count))
        best = min(candidates, key=lambda c: (c.cost, c.worker_id))
        return _decision(best, self.name, candidates)


class RoundRobinPolicy(RoutingPolicy):
    """Cycles over the alive workers in id order.

    It remembers the last worker id it chose, not a position, so a worker joining or leaving
    neither skips nor repeats anyone. `cost` is each worker's distance from the chosen one in
    the rotation.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        loads: Sequence[WorkerLoad],
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        ordered = _checked(loads)
        ids = [w.worker_id for w in ordered]
        # The first id after the last one chosen, wrapping to the start.
        start = 0 if self._last is None else bisect.bisect_right(ids, self._last) % len(ids)
        candidates = []
        for i, worker in enumerate(ordered):
            matched, prefill = _prefix(worker.worker_id, num_prompt_blocks, matches)
            turn = float((i - start) % len(ids))
            candidates.append(
                Candidate(worker.worker_id, matched, prefill, float(worker.num_requests), turn)
            )
        best = candidates[start]
        self._last = best.worker_id
        return _decision(best, self.name, candidates)


def _checked(loads: Sequence[WorkerLoad]) -> list[WorkerLoad]:
    """`loads` sorted by worker id, after checking it is non-empty and names each worker once."""
    if not loads:
        raise ValueError("no alive workers to route to")
    ordered = sorted(loads, key=lambda w: w.worker_id)
    for previous, current in zip(ordered, ordered[1:], strict=False):
        if previous.worker_id == current.worker_id:
            raise ValueError(f"worker {current.worker_id!r} appears twice in loads")
    return ordered


def _prefix(worker_id: str, num_prompt_blocks: int, matches: Mapping[str, int]) -> tuple[int, int]:
    """(blocks of the prompt the worker caches, blocks it would still have to prefill)."""
    if num_prompt_blocks < 0:
        raise ValueError(f"num_prompt_blocks must be >= 0, got {num_prompt_blocks}")
    matched = min(matches.get(worker_id, 0), num_prompt_blocks)
    return matched, num_prompt_blocks - matched


def _tier_load(worker_id: str, tier_load_blocks: Mapping[str, float] | None) -> float:
    """The tier term of a worker's cost: 0 without lower-tier hits."""
    return 0.0 if tier_load_blocks is None else tier_load_blocks.get(worker_id, 0.0)


def _decision(best: Candidate, policy: str, candidates: list[Candidate]) -> RoutingDecision:
    return RoutingDecision(
        worker_id=best.worker_id,
        policy=policy,
        candidates=tuple(candidates),
        matched_blocks=best.matched_blocks,
    )
