"""What a routing policy is: what it reads, what it returns, and the steps every policy scores with.

A policy sees three things: the request's prompt length in blocks, how many leading blocks each
worker already caches (`PrefixIndex.match`), and each alive worker's `WorkerLoad`; and, where a
worker's match sits partly in its host or disk tier, what loading those blocks is worth in
prefill blocks (`tier_load_blocks`, from `cluster/routing/tier_costs.py`). The load joins
what the worker last reported with what the router itself has sent there and not yet seen
finish (`inflight`, `inflight_tokens`): reports lag, and a router blind between them would send a
burst of requests to the same "idle" worker. The caller counts those: after each decision it
adds the request to the chosen worker's `inflight` and removes it when the request ends.
With several router replicas the report is what carries the others' requests (a worker reports
its whole queue); a request count adds only this router's `unreported` ones to it, so its own
requests the report already shows are not counted twice.

Policies are small classes registered by `name` (`RoutingPolicy.registry`); the policies
themselves live one family per module (`kv_aware.py`, `baselines.py`), and `policies.py` holds
the registry's default and `make_policy`.

Two ways to ask: `choose` scores every worker of a list of loads (the reference, and the path
for a decision with workers excluded); `choose_ranked` reads a `LoadRanking` the router keeps
up to date per worker (`cluster/routing/load_ranking.py`). By default it scores
`ranking.loads()` with `choose`; `kv_aware` answers it without scoring every worker.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedserve.cluster.routing.load_ranking import LoadRanking, RankKey


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
        unreported: those of `inflight` that the last report does not count yet.
    """

    worker_id: str
    num_running: int
    num_waiting: int
    used_blocks: int
    total_blocks: int
    free_blocks: int
    inflight: int = 0
    inflight_tokens: int = 0
    unreported: int = 0

    @property
    def num_requests(self) -> int:
        """Reported running + waiting (every router's requests, as of the report) plus this
        router's requests the report does not show yet."""
        return self.unreported + self.num_running + self.num_waiting


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
    """The chosen worker and the scored candidates (for logs, metrics and tests): every worker
    for `choose`; for a ranked `kv_aware` decision the prefix holders and the first
    `RANKED_LISTED` others (`kv_aware.py`) in load order (more when it had to pass over
    excluded ones)."""

    worker_id: str
    policy: str
    candidates: tuple[Candidate, ...]
    matched_blocks: int


class RoutingPolicy(abc.ABC):
    """Picks one worker among the alive ones. Subclasses register themselves by `name`."""

    registry: ClassVar[dict[str, type[RoutingPolicy]]] = {}
    name: ClassVar[str]
    # A policy that orders loads and reads them in order defines `rank_key(load)`, its sort key
    # for `LoadRanking`; None: the ranking keeps loads unordered.
    rank_key: Callable[[WorkerLoad], RankKey] | None = None
    # It takes the engine's `block_size` (to turn router token counts into blocks).
    takes_block_size: ClassVar[bool] = False

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

    def guard_terms(self, load: WorkerLoad) -> tuple[int, ...]:
        """Integer terms of a load whose totals over all workers `choose_ranked` needs."""
        return ()

    def new_ranking(self) -> LoadRanking:
        """An empty ranking in this policy's order, for the router to keep up to date."""
        return LoadRanking(self.rank_key, self.guard_terms)

    def choose_ranked(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        ranking: LoadRanking,
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        """Pick a worker among those in `ranking` (all routable); the same worker `choose`
        picks from `ranking.loads()`.

        Raises:
            ValueError: when `ranking` is empty.
        """
        return self.choose(num_prompt_blocks, matches, ranking.loads(), tier_load_blocks)


# ------------------------------------------------- the steps every policy scores with


def sorted_loads(loads: Sequence[WorkerLoad]) -> list[WorkerLoad]:
    """`loads` sorted by worker id, after checking it is non-empty and names each worker once."""
    if not loads:
        raise ValueError("no alive workers to route to")
    ordered = sorted(loads, key=lambda w: w.worker_id)
    for previous, current in zip(ordered, ordered[1:], strict=False):
        if previous.worker_id == current.worker_id:
            raise ValueError(f"worker {current.worker_id!r} appears twice in loads")
    return ordered


def prefix_split(
    worker_id: str, num_prompt_blocks: int, matches: Mapping[str, int]
) -> tuple[int, int]:
    """(blocks of the prompt the worker caches, blocks it would still have to prefill)."""
    if num_prompt_blocks < 0:
        raise ValueError(f"num_prompt_blocks must be >= 0, got {num_prompt_blocks}")
    matched = min(matches.get(worker_id, 0), num_prompt_blocks)
    return matched, num_prompt_blocks - matched


def tier_load_of(worker_id: str, tier_load_blocks: Mapping[str, float] | None) -> float:
    """The tier term of a worker's cost: 0 without lower-tier hits."""
    return 0.0 if tier_load_blocks is None else tier_load_blocks.get(worker_id, 0.0)


def make_decision(best: Candidate, policy: str, candidates: list[Candidate]) -> RoutingDecision:
    """The decision for `best`, with every scored candidate."""
    return RoutingDecision(
        worker_id=best.worker_id,
        policy=policy,
        candidates=tuple(candidates),
        matched_blocks=best.matched_blocks,
    )
